// One int4 or int8 decoder layer of the llama family in one call:
//   splitinfer::decoder_layer(hidden, cos, sin, key_cache, value_cache, start, index, offsets, weights, heads,
//                             kv_heads, eps, scale) -> hidden after the layer
//
// Why one call: at one row a layer's integer products take less time than the Python and small tensor calls
// around them (views, rotary, residual adds, the cache write). Here the layer is the kernels of the other
// files run back to back on raw buffers:
//   a = norm1(x); qkv = a W_qkv (+ b); rotate q and k; write k, v at slots start.. of the cache;
//   attention of each row over its visible slots index[offsets[i] : offsets[i + 1]] (rows_attention.cpp);
//   x1 = x + attn W_o (+ b); g = norm2(x1) W_gate_up (+ b); x2 = x1 + (silu(gate) * up) W_down (+ b).
// Every value is computed by the same operations, in the same order, as model/fastpath.py's forwards over the
// same kernels (rotary: q * cos + rotate_half(q) * sin, without fused multiply-adds; silu: ATen's), so both
// paths give the same bits (tests/model/test_native_layer.py) and rows stay independent of each other.
//   hidden [Q, D]; cos, sin [Q, head_dim]; key_cache, value_cache [KVH, S, head_dim] (written in place);
//   weights: norm1, norm2 [D], then (packed, bias, column sums, scales, smoothing) for qkv, o, gate_up and down:
//   int4 (kernels/w4a8.py's uint8 packing) with three empty tensors, or int8 (kernels/w8a8.py's int8 packing, int32
//   column sums, float32 scales, SmoothQuant's factors or empty); an empty bias for none. Each product may be either.
//
// A lone block takes every layer of a stack in one call: NativeStack, a class built once a stack with all its
// layers' weights (model/native_layer.py's StackCall), checks them when the stack loads, builds each row's visible
// keys from the block's structure and the cache length (masks.py's rule), reads rotary rows from a table, and runs
// the layers back to back in buffers kept between calls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "layout.h"

namespace {

constexpr int64_t QK = splitinfer::W4A8_GROUP, COLS = splitinfer::W4A8_COLS, TILE_BYTES = splitinfer::W4A8_TILE_BYTES;
constexpr int64_t PRODUCT_WEIGHTS = 5;  // packed, bias, column sums, scales, smoothing
constexpr int64_t INT8_TILES = splitinfer::W8A8_TILES, INT8_GROUP_BYTES = splitinfer::W8A8_GROUP_BYTES;

// One product of the layer, int4 (w4a8) or int8 (w8a8: column sums, row scales and SmoothQuant's factors).
struct Product {
  bool int8;
  const void* packed;
  int64_t k, n;
  const float* bias;  // nullptr: none
  const int32_t* sums;
  const float* scale;
  const float* smooth;  // nullptr: none
};

const float* optional_floats(const at::Tensor& t, int64_t size, const char* what, const char* name) {
  TORCH_CHECK(t.numel() == 0 || (t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == size),
              "decoder_layer: the ", what, " of ", name, " must be empty or float32 [", size, "]");
  return t.numel() ? t.data_ptr<float>() : nullptr;
}

// weights: packed, bias, then for int8 the column sums, the scales and the smoothing (int4: three empty tensors).
Product product(const at::Tensor* weights, int64_t k, const char* name) {
  const at::Tensor& packed = weights[0];
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "decoder_layer: ", name, " must be a packed weight");
  if (packed.scalar_type() == at::kByte) {
    TORCH_CHECK(packed.size(1) * QK == k && packed.size(2) == TILE_BYTES,
                "decoder_layer: ", name, " must be kernels/w4a8.py's packing of a weight of ", k, " inputs, got ",
                packed.sizes());
    const int64_t n = packed.size(0) * COLS;
    return {false, packed.data_ptr<uint8_t>(), k, n, optional_floats(weights[1], n, "bias", name), nullptr, nullptr,
            nullptr};
  }
  const at::Tensor& sums = weights[2];
  const int64_t n = sums.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.size(1) * 4 == k && packed.size(2) == INT8_GROUP_BYTES &&
                  n % splitinfer::W8A8_COLS == 0 && packed.size(0) == (n / splitinfer::W8A8_COLS + INT8_TILES - 1) / INT8_TILES &&
                  sums.scalar_type() == at::kInt && sums.is_contiguous(),
              "decoder_layer: ", name, " must be kernels/w4a8.py's or kernels/w8a8.py's packing (with column sums) of a "
              "weight of ", k, " inputs, got ", packed.sizes(), " ", packed.scalar_type());
  const float* scale = optional_floats(weights[3], n, "scales", name);
  TORCH_CHECK(scale != nullptr, "decoder_layer: the int8 product ", name, " needs its scales");
  return {true, packed.data_ptr<int8_t>(), k, n, optional_floats(weights[1], n, "bias", name), sums.data_ptr<int32_t>(),
          scale, optional_floats(weights[4], k, "smoothing", name)};
}

// y [rows, p.n] = x [rows, p.k] W^T (+ bias), as Int4Linear.forward and Int8Linear.forward: the product (int8:
// of x times its smoothing, quantized per row), then the bias added.
void multiply(const Product& p, const float* x, int64_t rows, float* y) {
  if (p.int8) {
    RECORD_FUNCTION("splitinfer::w8a8_mm", std::vector<c10::IValue>());
    splitinfer::w8a8_rows(x, rows, p.k, p.smooth, static_cast<const int8_t*>(p.packed), p.sums, p.scale, p.n, y);
  } else {
    RECORD_FUNCTION("splitinfer::w4a8_mm", std::vector<c10::IValue>());
    splitinfer::w4a8_product(x, rows, p.k, static_cast<const uint8_t*>(p.packed), p.n, y);
  }
  if (p.bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < p.n; ++j) y[r * p.n + j] += p.bias[j];
  }
}

void norm(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* y) {
  RECORD_FUNCTION("splitinfer::rms_norm", std::vector<c10::IValue>());
  splitinfer::rms_norm_rows(x, rows, dim, weight, eps, y);
}

// The first `heads` heads of each row (queries, then keys) rotated in place: v * cos + rotate_half(v) * sin.
void rotate(float* qkv, int64_t rows, int64_t width, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  std::vector<float> v(dim);
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * dim;
    const float* s = sin + r * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* out = qkv + r * width + h * dim;
      std::memcpy(v.data(), out, dim * sizeof(float));
      for (int64_t i = 0; i < half; ++i) out[i] = v[i] * c[i] + (-v[i + half]) * s[i];
      for (int64_t i = half; i < dim; ++i) out[i] = v[i] * c[i] + v[i - half] * s[i];
    }
  }
}

void add(float* y, const float* x, int64_t count) {  // y += x (a float sum does not depend on the order of two terms)
  at::parallel_for(0, count, 16384, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = x[i] + y[i];
  });
}

void check_float(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(-1) == 1,
              "decoder_layer: ", name, " must be a ", dims, "-D float32 CPU tensor with contiguous rows, got ",
              t.sizes(), " ", t.scalar_type());
}

// What every layer of a stack shares: its widths and constants.
struct Shape {
  int64_t width, heads, kv_heads, dim;  // width: the hidden size; dim: a head's
  float eps, scale;
};

// One layer's operands, checked once: the norms' weights and the four products.
struct Layer {
  const float *norm1, *norm2;
  Product qkv, o, gate_up, down;
};

Layer make_layer(const at::Tensor* weights, int64_t count, const Shape& s) {
  TORCH_CHECK(count == 2 + 4 * PRODUCT_WEIGHTS, "decoder_layer: weights are norm1, norm2 and (packed, bias, column "
              "sums, scales, smoothing) for qkv, o, gate_up and down");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].is_contiguous() && weights[i].numel() == s.width,
                "decoder_layer: the norms' weights must be float32 [", s.width, "]");
  }
  const at::Tensor* w = weights + 2;
  Layer layer{weights[0].data_ptr<float>(), weights[1].data_ptr<float>(), product(w, s.width, "qkv"),
              product(w + PRODUCT_WEIGHTS, s.heads * s.dim, "o_proj"), product(w + 2 * PRODUCT_WEIGHTS, s.width, "gate_up"),
              {}};
  layer.down = product(w + 3 * PRODUCT_WEIGHTS, layer.gate_up.n / 2, "down_proj");
  const int64_t inner = layer.gate_up.n / 2;
  TORCH_CHECK(layer.qkv.n == (s.heads + 2 * s.kv_heads) * s.dim && layer.o.n == s.width && layer.gate_up.n == 2 * inner &&
                  layer.down.n == s.width,
              "decoder_layer: the products' outputs (", layer.qkv.n, ", ", layer.o.n, ", ", layer.gate_up.n, ", ",
              layer.down.n, ") do not fit ", s.heads, " heads, ", s.kv_heads, " key/value heads of ", s.dim,
              " and width ", s.width);
  return layer;
}

void check_shape(const Shape& s) {
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0 && s.dim % 16 == 0 && s.dim <= 256,
              "decoder_layer: ", s.heads, " heads over ", s.kv_heads, " key/value heads of ", s.dim,
              " (a multiple of 16, at most 256) do not fit the kernels");
}

// A layer's key/value cache: [KVH, S, dim] buffers, rows contiguous, written in place.
struct Cache {
  float *keys, *values;
  int64_t k_head, k_row, v_head, v_row, slots;
};

// keys, values: [KVH, S, dim], or a stack cache's [1, KVH, S, dim].
Cache cache_of(const at::Tensor& keys, const at::Tensor& values, const Shape& s) {
  const int64_t dims = keys.dim() == 4 && keys.size(0) == 1 ? 4 : 3;
  check_float(keys, dims, "key_cache");
  check_float(values, dims, "value_cache");
  TORCH_CHECK(keys.size(-3) == s.kv_heads && keys.size(-1) == s.dim && values.sizes() == keys.sizes(),
              "decoder_layer: caches ", keys.sizes(), " do not hold ", s.kv_heads, " heads of ", s.dim);
  return {keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(-3), keys.stride(-2), values.stride(-3),
          values.stride(-2), keys.size(-2)};
}

// The buffers a layer works in, kept between calls (a thread's own).
struct Scratch {
  std::vector<float> a, qkv, gate_up, act, down;
};

Scratch& scratch(int64_t rows, const Shape& s, int64_t inner) {
  thread_local Scratch t;
  t.a.resize(rows * std::max(s.width, s.heads * s.dim));
  t.qkv.resize(rows * (s.heads + 2 * s.kv_heads) * s.dim);
  t.gate_up.resize(rows * 2 * inner);
  t.act.resize(rows * inner);
  t.down.resize(rows * s.width);
  return t;
}

// x [rows, width] -> y [rows, width] through one layer (y must not alias x); the block's keys and values written at
// slots start.. of `c`; row i attends to slots idx[off[i] : off[i + 1]] (checked by the caller, `longest` the most).
void layer_pass(const Layer& L, const Shape& s, const float* x, int64_t rows, const float* cos, const float* sin,
                const Cache& c, int64_t start, const int64_t* idx, const int64_t* off, int64_t longest, float* y) {
  const int64_t width = (s.heads + 2 * s.kv_heads) * s.dim, kv_width = s.kv_heads * s.dim, inner = L.gate_up.n / 2;
  Scratch& t = scratch(rows, s, inner);
  float* a = t.a.data();
  float* qkv = t.qkv.data();
  norm(x, rows, s.width, L.norm1, s.eps, a);
  multiply(L.qkv, a, rows, qkv);
  {
    RECORD_FUNCTION("splitinfer::rotary_and_cache", std::vector<c10::IValue>());
    rotate(qkv, rows, width, s.heads + s.kv_heads, s.dim, cos, sin);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < s.kv_heads; ++g) {
        const float* row = qkv + r * width + s.heads * s.dim + g * s.dim;
        std::memcpy(c.keys + g * c.k_head + (start + r) * c.k_row, row, s.dim * sizeof(float));
        std::memcpy(c.values + g * c.v_head + (start + r) * c.v_row, row + kv_width, s.dim * sizeof(float));
      }
    }
  }
  {
    RECORD_FUNCTION("splitinfer::rows_attention", std::vector<c10::IValue>());
    const splitinfer::AttentionOperands o{qkv, c.keys, c.values, s.dim, width, c.k_head, c.k_row, c.v_head, c.v_row,
                                          idx, off, s.heads, s.kv_heads, s.dim, s.scale, a};
    splitinfer::attend_rows(o, rows, longest);
  }
  multiply(L.o, a, rows, y);
  add(y, x, rows * s.width);  // y = x + attn W_o = x1
  norm(y, rows, s.width, L.norm2, s.eps, a);
  float* gate_up = t.gate_up.data();
  float* act = t.act.data();
  multiply(L.gate_up, a, rows, gate_up);
  {  // ATen's silu (model/fastpath.py's act_fn), over views of the buffers
    const auto floats = at::TensorOptions().dtype(at::kFloat);
    at::Tensor act_t = at::from_blob(act, {rows, inner}, floats);
    at::silu_out(act_t, at::from_blob(gate_up, {rows, inner}, {2 * inner, 1}, floats));
  }
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {  // silu(gate) * up, a row a thread
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < inner; ++i) act[r * inner + i] = act[r * inner + i] * gate_up[r * 2 * inner + inner + i];
    }
  });
  multiply(L.down, act, rows, t.down.data());
  add(y, t.down.data(), rows * s.width);  // y = down + x1: the same sum as x1 + down
}

void check_rows(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const Shape& s) {
  check_float(hidden, 2, "hidden");
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(hidden.is_contiguous() && hidden.size(1) == s.width, "decoder_layer: hidden must be a contiguous [rows, ",
              s.width, "]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * s.dim && sin.numel() == rows * s.dim,
              "decoder_layer: cos and sin must be contiguous float32 [", rows, ", ", s.dim, "]");
}

at::Tensor decoder_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor key_cache, at::Tensor value_cache, int64_t start, const at::Tensor& index,
                         const at::Tensor& offsets, at::TensorList weights, int64_t heads, int64_t kv_heads,
                         double eps, double scale) {
  check_float(key_cache, 3, "key_cache");
  const Shape s{hidden.dim() == 2 ? hidden.size(1) : 0, heads, kv_heads, key_cache.size(2), static_cast<float>(eps),
                static_cast<float>(scale)};
  check_shape(s);
  check_rows(hidden, cos, sin, s);
  const Cache c = cache_of(key_cache, value_cache, s);
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(start >= 0 && start + rows <= c.slots, "decoder_layer: rows ", start, "..", start + rows,
              " do not fit a cache of ", c.slots, " slots");
  const Layer layer = make_layer(weights.data(), static_cast<int64_t>(weights.size()), s);
  TORCH_CHECK(index.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && index.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == rows + 1,
              "decoder_layer: index and offsets must be contiguous int64, offsets one longer than the rows");
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t longest = splitinfer::check_visible(idx, index.numel(), off, rows, start + rows);
  at::Tensor out = at::empty({rows, s.width}, hidden.options());
  layer_pass(layer, s, hidden.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>(), c, start, idx,
             off, longest, out.data_ptr<float>());
  return out;
}

// The keys each row of a lone block sees (model/masks.py's attention_mask read as lists, model/attention.py's
// visible_keys): the `committed` cached rows (positions 0..committed - 1, slots alike), then the block rows it is
// allowed to see (slots committed..), within `window` positions of its own where the layer has one (0: none).
void visible(const bool* allowed, const int64_t* positions, int64_t rows, int64_t committed, int64_t window,
             std::vector<int64_t>& idx, std::vector<int64_t>& off) {
  idx.clear();
  off.assign(1, 0);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t lowest = window > 0 ? positions[i] - window : std::numeric_limits<int64_t>::min();
    for (int64_t j = std::max<int64_t>(0, lowest + 1); j < committed; ++j) idx.push_back(j);
    for (int64_t j = 0; j < rows; ++j) {
      if (allowed[i * rows + j] && positions[j] > lowest) idx.push_back(committed + j);
    }
    off.push_back(static_cast<int64_t>(idx.size()));
  }
}

// The layers of a stack, checked once; `run` takes a lone block through all of them in one call.
struct NativeStack : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;  // kept alive: the layers point into them
  std::vector<Layer> layers;
  std::vector<int64_t> windows;  // each layer's sliding window (0: none)
  Shape s;

  NativeStack(std::vector<at::Tensor> all, std::vector<int64_t> layer_windows, int64_t width, int64_t heads,
              int64_t kv_heads, int64_t dim, double eps, double scale)
      : weights(std::move(all)), windows(std::move(layer_windows)),
        s{width, heads, kv_heads, dim, static_cast<float>(eps), static_cast<float>(scale)} {
    check_shape(s);
    const int64_t per = 2 + 4 * PRODUCT_WEIGHTS, count = static_cast<int64_t>(windows.size());
    TORCH_CHECK(static_cast<int64_t>(weights.size()) == per * count, "NativeStack: ", per, " weights a layer for ",
                count, " layers, got ", weights.size());
    for (int64_t l = 0; l < count; ++l) layers.push_back(make_layer(weights.data() + l * per, per, s));
  }

  // hidden [q, width]; cos_table, sin_table [P, dim] (rows: positions); positions [q] int64 (< P); allowed [q, q]
  // bool; keys, values: each layer's [1, KVH, S, dim] buffers, the block written at slots committed.. Every operand
  // is checked before the first layer writes its cache.
  at::Tensor run(const at::Tensor& hidden, const at::Tensor& cos_table, const at::Tensor& sin_table,
                 const at::Tensor& positions, const at::Tensor& allowed, int64_t committed,
                 const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values) {
    const int64_t rows = check_block(hidden, positions, allowed);
    TORCH_CHECK(committed >= 0, "NativeStack: the block cannot start at slot ", committed);
    const std::vector<Cache> caches = caches_of(keys, values, committed + rows);
    thread_local std::vector<float> cos, sin, ping;
    rotary_rows(cos_table, positions, cos);
    rotary_rows(sin_table, positions, sin);
    const Visible seen(windows, allowed.data_ptr<bool>(), positions.data_ptr<int64_t>(), rows, committed);
    at::Tensor out = at::empty({rows, s.width}, hidden.options());
    ping.resize(rows * s.width);
    const float* x = hidden.data_ptr<float>();
    const int64_t count = static_cast<int64_t>(layers.size());
    for (int64_t l = 0; l < count; ++l) {  // layer l reads x and writes the other buffer; the last one `out`
      const int64_t k = seen.of(windows[l]);
      float* y = (count - 1 - l) % 2 == 0 ? out.data_ptr<float>() : ping.data();
      layer_pass(layers[l], s, x, rows, cos.data(), sin.data(), caches[l], committed, seen.idx[k].data(),
                 seen.off[k].data(), seen.longest[k], y);
      x = y;
    }
    return out;
  }

  // The visible keys of each distinct window, built once a block (`visible`).
  struct Visible {
    std::vector<int64_t> kinds, longest;
    std::vector<std::vector<int64_t>> idx, off;
    Visible(const std::vector<int64_t>& windows, const bool* allowed, const int64_t* pos, int64_t rows,
            int64_t committed) {
      for (int64_t w : windows) {
        if (std::find(kinds.begin(), kinds.end(), w) != kinds.end()) continue;
        kinds.push_back(w);
        idx.emplace_back();
        off.emplace_back();
        visible(allowed, pos, rows, committed, w, idx.back(), off.back());
        longest.push_back(splitinfer::check_visible(idx.back().data(), static_cast<int64_t>(idx.back().size()),
                                                    off.back().data(), rows, committed + rows));
      }
    }
    int64_t of(int64_t window) const { return std::find(kinds.begin(), kinds.end(), window) - kinds.begin(); }
  };

  // The block's rows: hidden [q, width], positions int64 [q], allowed bool [q, q]; returns q.
  int64_t check_block(const at::Tensor& hidden, const at::Tensor& positions, const at::Tensor& allowed) const {
    check_float(hidden, 2, "hidden");
    const int64_t rows = hidden.size(0);
    TORCH_CHECK(hidden.is_contiguous() && hidden.size(1) == s.width && rows > 0,
                "NativeStack: hidden must be a contiguous [rows, ", s.width, "]");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == rows &&
                    allowed.scalar_type() == at::kBool && allowed.is_contiguous() && allowed.numel() == rows * rows,
                "NativeStack: positions must be int64 [", rows, "] and allowed bool [", rows, ", ", rows, "]");
    return rows;
  }

  // Each layer's cache, every one holding at least `slots` slots.
  std::vector<Cache> caches_of(const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                               int64_t slots) const {
    TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
                "NativeStack: one key and one value buffer a layer");
    std::vector<Cache> caches;
    for (size_t l = 0; l < layers.size(); ++l) {
      TORCH_CHECK(keys[l].dim() == 4 && values[l].dim() == 4, "NativeStack: cache buffers are [1, KVH, S, dim]");
      caches.push_back(cache_of(keys[l], values[l], s));
      TORCH_CHECK(caches.back().slots >= slots, "NativeStack: rows up to ", slots, " do not fit a cache of ",
                  caches.back().slots, " slots");
    }
    return caches;
  }

  // The table's rows at the block's positions, one after another, into `out`.
  void rotary_rows(const at::Tensor& table, const at::Tensor& positions, std::vector<float>& out) const {
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 2 && table.size(1) == s.dim,
                "NativeStack: the rotary tables must be contiguous float32 [positions, ", s.dim, "]");
    const int64_t rows = positions.numel();
    const int64_t* pos = positions.data_ptr<int64_t>();
    out.resize(rows * s.dim);
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(pos[r] >= 0 && pos[r] < table.size(0), "NativeStack: position ", pos[r],
                  " is past the rotary table (", table.size(0), " rows)");
      std::memcpy(out.data() + r * s.dim, table.data_ptr<float>() + pos[r] * s.dim, s.dim * sizeof(float));
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) {
  m.class_<NativeStack>("NativeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("run", &NativeStack::run);
  m.def("decoder_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, int start, "
        "Tensor index, Tensor offsets, Tensor[] weights, int heads, int kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
