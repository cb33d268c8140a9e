// The int8 product on AMX tiles, where the CPU has AMX-INT8 and Linux lets this process use it: the same
// operands, the same integer sums and the same epilogue as w8a8.cpp's AVX512-VNNI loops, so the same bits
// (tests/kernels/test_w8a8.py), at up to sixteen rows a pass with one read of the weight.
//
// Why: a VNNI pass shares each load of the weight among four to eight rows, so from eight rows a step is bound
// by vpdpbusd (two a cycle, 64 multiply-adds each) and sixteen rows read each group four times; one tdpbusd
// multiplies a 16 x 64 tile of inputs by a 64 x 16 tile of weights (16,384 multiply-adds), so at any row count
// up to sixteen the weight stream, not the dot products, is the bound (kernels/probe.cpp measures both peaks).
//
// The packed weight is w8a8.cpp's (layout.h): a group's stream is chunks of 64 inputs, each the four tiles' 1 KB
// in turn, and a tile's 1 KB (16 rows of four inputs x 16 columns) is exactly the B operand of tdpbusd, loaded
// with a 64-byte stride. The activations (bytes + 128, as vpdpbusd takes them) are the A operand, a row a tile
// row. Laid out so, the stream read 7-10% faster than with the tiles of a step side by side
// (notes/bench/amx-7b), and the VNNI loops read it as fast.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "layout.h"

namespace {

constexpr int64_t COLS = splitinfer::W8A8_COLS;
constexpr int64_t TILES = splitinfer::W8A8_TILES;
constexpr int64_t DEPTH = splitinfer::W8A8_DEPTH;  // inputs a weight tile holds (64 bytes an input row)
constexpr int64_t STEP_BYTES = COLS * 4;          // a weight tile's row: four inputs of its 16 columns
constexpr int64_t TILE_BYTES = DEPTH / 4 * STEP_BYTES;
constexpr int TILE_ROWS = 16;  // rows of a tile, so of a pass
static_assert(TILES == 4 && COLS == 16, "the tile registers below hold a group of four 16-column tiles");

// The tile registers' configuration (palette 1): tmm0-3 the group's four 16 x 16 int32 sums, tmm4 the rows'
// inputs, tmm6-7 the weight tiles (tmm5 unused).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

Config config_for(int rows) {
  Config c;
  for (int t = 0; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(rows), c.bytes_per_row[t] = COLS * 4;
  c.rows[4] = static_cast<uint8_t>(rows), c.bytes_per_row[4] = DEPTH;
  for (int t = 6; t < 8; ++t) c.rows[t] = DEPTH / 4, c.bytes_per_row[t] = COLS * 4;
  return c;
}

// CPUID leaf 7: AMX-TILE and AMX-INT8; then Linux (5.16 and later) must grant the process the tile data state.
bool detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  constexpr long REQ_XCOMP_PERM = 0x1023, XTILEDATA = 18;
  return syscall(SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA) == 0;
}

std::atomic<bool> chosen{true};  // kernels/build.py turns it off with SPLITINFER_KERNELS=...,-amx

bool ready() {
  static const bool able = detect();
  return able;
}

// One group (four tiles, 64 columns) times `rows` (<= 16) rows a: [rows, K] bytes -> sums [rows, 64] int32. A chunk
// of the stream (layout.h) is the four weight tiles of 64 inputs, 1 KB each, one after the other.
void group(const int8_t* w, int64_t K, const uint8_t* a, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += DEPTH, w += TILES * TILE_BYTES) {
    _tile_loadd(4, a + k, K);
    _tile_loadd(6, w, STEP_BYTES);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, w + TILE_BYTES, STEP_BYTES);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(6, w + 2 * TILE_BYTES, STEP_BYTES);
    _tile_dpbusd(2, 4, 6);
    _tile_loadd(7, w + 3 * TILE_BYTES, STEP_BYTES);
    _tile_dpbusd(3, 4, 7);
  }
  _tile_stored(0, sums, TILES * COLS * 4);
  _tile_stored(1, sums + COLS, TILES * COLS * 4);
  _tile_stored(2, sums + 2 * COLS, TILES * COLS * 4);
  _tile_stored(3, sums + 3 * COLS, TILES * COLS * 4);
}

}  // namespace

namespace splitinfer {

bool amx_runs(int64_t K) { return K % DEPTH == 0 && chosen.load(std::memory_order_relaxed) && ready(); }

void amx_product(const uint8_t* a, int64_t M, int64_t K, const int8_t* w, const int32_t* col_sums, const float* scale,
                 const float* sx, int64_t N, float* y) {
  const int64_t real_tiles = N / COLS, groups = (real_tiles + TILES - 1) / TILES;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    alignas(64) int32_t sums[TILE_ROWS * TILES * COLS];
    int configured = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * TILES;
      const int tiles = static_cast<int>(std::min<int64_t>(TILES, real_tiles - t));
      for (int64_t m = 0; m < M; m += TILE_ROWS) {  // past sixteen rows, the group's next pass reads it from L2
        const int rows = static_cast<int>(std::min<int64_t>(M - m, TILE_ROWS));
        if (rows != configured) {
          const Config c = config_for(rows);
          _tile_loadconfig(&c);
          configured = rows;
        }
        group(w + t * K * COLS, K, a + m * K, sums);
        for (int r = 0; r < rows; ++r) {
          for (int c = 0; c < tiles; ++c) {
            const int64_t col = (t + c) * COLS;
            splitinfer::w8a8_epilogue(_mm512_loadu_si512(sums + r * TILES * COLS + c * COLS), col_sums + col, scale + col,
                                      sx == nullptr ? nullptr : sx + m + r, y + (m + r) * N + col);
          }
        }
      }
    }
    if (configured != 0) _tile_release();
  });
}

// The AMX-INT8 peak of the threads torch runs (kernels/probe.cpp's counterpart for the dot products of
// tdpbusd): four independent 16 x 16 accumulators, `iterations` times each thread; 0 where AMX does not run.
double amx_peak(int64_t iterations) {
  if (!ready()) return 0.0;
  std::atomic<int64_t> done{0};
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t t0, int64_t t1) {
    const Config c = config_for(TILE_ROWS);
    _tile_loadconfig(&c);
    alignas(64) static const uint8_t zeros[TILE_ROWS * DEPTH] = {};
    _tile_loadd(4, zeros, DEPTH);
    _tile_loadd(6, zeros, DEPTH);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t i = 0; i < iterations; ++i) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 6);
        _tile_dpbusd(2, 4, 6);
        _tile_dpbusd(3, 4, 6);
      }
      done += iterations;
    }
    _tile_release();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(done.load()) * 4 * TILE_ROWS * COLS * DEPTH * 2 / seconds / 1e9;
}

}  // namespace

namespace {

// Turn the AMX path on or off for this process (it runs where the CPU and Linux allow it: the result).
bool amx(bool on) {
  chosen.store(on);
  return ready();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) {
  m.def("amx(bool on) -> bool");
  m.def("amx_peak(int iterations) -> float");
}

// No tensor argument to dispatch on: registered for every backend.
TORCH_LIBRARY_IMPL(splitinfer, CompositeExplicitAutograd, m) {
  m.impl("amx", &amx);
  m.impl("amx_peak", &splitinfer::amx_peak);
}
