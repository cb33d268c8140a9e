// The op library every kernel file adds its ops to (TORCH_LIBRARY_FRAGMENT), and the one op that reports the
// packing layout of layout.h: kernels/w4a8.py and kernels/w8a8.py pack weights with the numbers the built
// library was compiled with, so a change to layout.h cannot leave Python packing for another layout.
#include <torch/library.h>

#include <vector>

#include "layout.h"

namespace {

// [W4A8_GROUP, W4A8_COLS, W4A8_TILE_BYTES, W8A8_COLS, W8A8_TILES, W8A8_ROWS, W8A8_DEPTH] (kernels/build.py's LAYOUT names them).
std::vector<int64_t> layout() {
  return {splitinfer::W4A8_GROUP, splitinfer::W4A8_COLS, splitinfer::W4A8_TILE_BYTES,
          splitinfer::W8A8_COLS,  splitinfer::W8A8_TILES, splitinfer::W8A8_ROWS, splitinfer::W8A8_DEPTH};
}

}  // namespace

TORCH_LIBRARY(splitinfer, m) { m.def("layout() -> int[]"); }

// No tensor argument to dispatch on: registered for every backend.
TORCH_LIBRARY_IMPL(splitinfer, CompositeExplicitAutograd, m) { m.impl("layout", &layout); }
