// One int4 or int8 decoder layer of the llama family in one call:
//   splitinfer::decoder_layer(hidden, cos, sin, key_cache, value_cache, start, index, offsets, weights, heads,
//                             kv_heads, eps, scale) -> hidden after the layer
//
// A step through 26 layers of integer products spends more time in Python and in small tensor calls (views,
// rotary, residual adds, the cache write; ~150 us a layer at one row, notes/bench/step-int4-rows at 723520d) than in its
// products. Here the layer is the kernels of the other files run back to back on raw buffers:
//   a = norm1(x); qkv = a W_qkv (+ b); rotate q and k; write k, v at slots start.. of the cache;
//   attention of each row over its visible slots index[offsets[i] : offsets[i + 1]] (rows_attention.cpp);
//   x1 = x + attn W_o (+ b); g = norm2(x1) W_gate_up (+ b); x2 = x1 + (silu(gate) * up) W_down (+ b).
// Every value is computed by the same operations, in the same order, as model/fastpath.py's forwards over the
// same kernels (rotary: q * cos + rotate_half(q) * sin, without fused multiply-adds; silu: ATen's), so both
// paths give the same bits (tests/model/test_native_layer.py) and rows stay independent of each other.
//   hidden [Q, D]; cos, sin [Q, head_dim]; key_cache, value_cache [KVH, S, head_dim] (written in place);
//   weights: norm1, norm2 [D], then (packed, bias, column sums, scales, smoothing) for qkv, o, gate_up and down:
//   int4 (model/w4a8.py's uint8 packing) with three empty tensors, or int8 (model/w8a8.py's int8 packing, int32
//   column sums, float32 scales, SmoothQuant's factors or empty); an empty bias for none. Each product may be either.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "native.h"

namespace {

constexpr int64_t QK = 32, COLS = 16, TILE_BYTES = 320;  // model/w4a8.py's packing
constexpr int64_t PRODUCT_WEIGHTS = 5;  // packed, bias, column sums, scales, smoothing
constexpr int64_t INT8_TILES = 4, INT8_GROUP_BYTES = 64 * INT8_TILES;  // model/w8a8.py's packing

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
                "decoder_layer: ", name, " must be model/w4a8.py's packing of a weight of ", k, " inputs, got ",
                packed.sizes());
    const int64_t n = packed.size(0) * COLS;
    return {false, packed.data_ptr<uint8_t>(), k, n, optional_floats(weights[1], n, "bias", name), nullptr, nullptr,
            nullptr};
  }
  const at::Tensor& sums = weights[2];
  const int64_t n = sums.numel();
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.size(1) * 4 == k && packed.size(2) == INT8_GROUP_BYTES &&
                  n % COLS == 0 && packed.size(0) == (n / COLS + INT8_TILES - 1) / INT8_TILES &&
                  sums.scalar_type() == at::kInt && sums.is_contiguous(),
              "decoder_layer: ", name, " must be model/w4a8.py's or model/w8a8.py's packing (with column sums) of a "
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
    thread_local std::vector<uint8_t> a;
    thread_local std::vector<float> sx;
    a.assign(splitinfer::w8a8_padded_rows(rows) * p.k, 128);  // the kernel reads whole blocks: padding rows of zeros
    sx.resize(rows);
    splitinfer::quantize_rows_int8(x, rows, p.k, p.smooth, a.data(), sx.data());
    splitinfer::w8a8_product(a.data(), rows, p.k, static_cast<const int8_t*>(p.packed), p.sums, p.scale, sx.data(),
                             p.n, y);
  } else {
    RECORD_FUNCTION("splitinfer::w4a8_mm", std::vector<c10::IValue>());
    splitinfer::w4a8_product(x, rows, p.k, static_cast<const uint8_t*>(p.packed), p.n, y);
  }
  if (p.bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < p.n; ++j) y[r * p.n + j] += p.bias[j];
  }
}

void norm(const float* x, int64_t rows, int64_t dim, const at::Tensor& weight, float eps, float* y) {
  RECORD_FUNCTION("splitinfer::rms_norm", std::vector<c10::IValue>());
  splitinfer::rms_norm_rows(x, rows, dim, weight.data_ptr<float>(), eps, y);
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
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] + y[i];
}

void check_float(const at::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(-1) == 1,
              "decoder_layer: ", name, " must be a ", dims, "-D float32 CPU tensor with contiguous rows, got ",
              t.sizes(), " ", t.scalar_type());
}

at::Tensor decoder_layer(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor key_cache, at::Tensor value_cache, int64_t start, const at::Tensor& index,
                         const at::Tensor& offsets, at::TensorList weights, int64_t heads, int64_t kv_heads,
                         double eps, double scale) {
  check_float(hidden, 2, "hidden");
  check_float(key_cache, 3, "key_cache");
  check_float(value_cache, 3, "value_cache");
  TORCH_CHECK(hidden.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "decoder_layer: hidden, cos and sin must be contiguous");
  const int64_t rows = hidden.size(0), width_in = hidden.size(1), dim = key_cache.size(2);
  const int64_t slots = key_cache.size(1), kv_width = kv_heads * dim, width = (heads + 2 * kv_heads) * dim;
  TORCH_CHECK(weights.size() == 2 + 4 * PRODUCT_WEIGHTS, "decoder_layer: weights are norm1, norm2 and (packed, "
              "bias, column sums, scales, smoothing) for qkv, o, gate_up and down");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && key_cache.size(0) == kv_heads && dim % 16 == 0 && dim <= 256 &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.stride(2) == 1,
              "decoder_layer: caches ", key_cache.sizes(), " do not hold ", kv_heads, " heads of a multiple of 16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim, "decoder_layer: cos and sin must be float32 [", rows, ", ", dim, "]");
  TORCH_CHECK(start >= 0 && start + rows <= slots, "decoder_layer: rows ", start, "..", start + rows,
              " do not fit a cache of ", slots, " slots");
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(weights[i].scalar_type() == at::kFloat && weights[i].is_contiguous() && weights[i].numel() == width_in,
                "decoder_layer: the norms' weights must be float32 [", width_in, "]");
  }
  const at::Tensor* w = weights.data() + 2;
  const Product qkv_w = product(w, width_in, "qkv");
  const Product o_w = product(w + PRODUCT_WEIGHTS, heads * dim, "o_proj");
  const Product gate_up_w = product(w + 2 * PRODUCT_WEIGHTS, width_in, "gate_up");
  const int64_t inner = gate_up_w.n / 2;
  const Product down_w = product(w + 3 * PRODUCT_WEIGHTS, inner, "down_proj");
  TORCH_CHECK(qkv_w.n == width && o_w.n == width_in && gate_up_w.n == 2 * inner && down_w.n == width_in,
              "decoder_layer: the products' outputs (", qkv_w.n, ", ", o_w.n, ", ", gate_up_w.n, ", ", down_w.n,
              ") do not fit ", heads, " heads, ", kv_heads, " key/value heads of ", dim, " and width ", width_in);
  TORCH_CHECK(index.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && index.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == rows + 1,
              "decoder_layer: index and offsets must be contiguous int64, offsets one longer than the rows");
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t longest = splitinfer::check_visible(idx, index.numel(), off, rows, start + rows);

  const float* x = hidden.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::Tensor out = at::empty({rows, width_in}, hidden.options());
  at::Tensor qkv_t = at::empty({rows, width}, hidden.options());
  at::Tensor gate_up_t = at::empty({rows, 2 * inner}, hidden.options());
  at::Tensor act_t = at::empty({rows, inner}, hidden.options());
  std::vector<float> a(rows * std::max(width_in, heads * dim));
  float* y = out.data_ptr<float>();
  float* qkv = qkv_t.data_ptr<float>();

  norm(x, rows, width_in, weights[0], e, a.data());
  multiply(qkv_w, a.data(), rows, qkv);
  {
    RECORD_FUNCTION("splitinfer::rotary_and_cache", std::vector<c10::IValue>());
    rotate(qkv, rows, width, heads + kv_heads, dim, cos.data_ptr<float>(), sin.data_ptr<float>());
    float* keys = key_cache.data_ptr<float>();
    float* values = value_cache.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < kv_heads; ++g) {
        const float* row = qkv + r * width + heads * dim + g * dim;
        std::memcpy(keys + g * key_cache.stride(0) + (start + r) * key_cache.stride(1), row, dim * sizeof(float));
        std::memcpy(values + g * value_cache.stride(0) + (start + r) * value_cache.stride(1), row + kv_width,
                    dim * sizeof(float));
      }
    }
  }
  {
    RECORD_FUNCTION("splitinfer::rows_attention", std::vector<c10::IValue>());
    const splitinfer::AttentionOperands o{qkv, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                                          dim, width, key_cache.stride(0), key_cache.stride(1),
                                          value_cache.stride(0), value_cache.stride(1), idx, off, heads, kv_heads, dim,
                                          static_cast<float>(scale), a.data()};
    splitinfer::attend_rows(o, rows, longest);
  }
  multiply(o_w, a.data(), rows, y);
  add(y, x, rows * width_in);  // y = x + attn W_o = x1
  norm(y, rows, width_in, weights[1], e, a.data());
  float* gate_up = gate_up_t.data_ptr<float>();
  multiply(gate_up_w, a.data(), rows, gate_up);
  at::silu_out(act_t, gate_up_t.narrow(1, 0, inner));
  float* act = act_t.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < inner; ++i) act[r * inner + i] = act[r * inner + i] * gate_up[r * 2 * inner + inner + i];
  }
  std::vector<float> down(rows * width_in);
  multiply(down_w, act, rows, down.data());
  add(y, down.data(), rows * width_in);  // y = down + x1: the same sum as x1 + down
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) {
  m.def("decoder_layer(Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, int start, "
        "Tensor index, Tensor offsets, Tensor[] weights, int heads, int kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
