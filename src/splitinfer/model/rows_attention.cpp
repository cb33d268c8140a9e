// Exact-rows attention: splitinfer::rows_attention(query, key, value, index, offsets, scale) -> out.
//
// Query row i attends to the cached keys index[offsets[i] : offsets[i + 1]], in that order (model/attention.py
// lists them in ascending position: the committed prefix, then the row's ancestors in the block, then itself).
// A row's arithmetic reads nothing but its own query and those keys, in a fixed order, so a tree's row and
// the same row decoded alone on a cache holding its ancestors get the same bits.
//
// Per row and query head: scores s_j = scale * <q, k_j> (16-lane partial sums, then a fixed reduction),
// p_j = exp(s_j - max s) (a float32 polynomial, below), out = sum_j p_j v_j / sum_j p_j.
//   query [H, Q, D] (strides any, the last 1); key, value [KVH, S, D] (the KV cache's buffers, read in place);
//   index int64 [sum of visible keys]; offsets int64 [Q + 1]; out float32 [Q, H, D]. D a multiple of 16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "native.h"

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t MAX_DIM = 256;  // head dimensions up to this stay in registers' worth of stack

// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), x = n ln2 + r (Cody-Waite), p of degree 7.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline float dot(const float* a, const float* b, int64_t dim) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

using Operands = splitinfer::AttentionOperands;

// One query row and one query head: scores (in `scores`, room for the row's keys), softmax, weighted values.
void attend(const Operands& o, int64_t row, int64_t head, float* scores) {
  const int64_t first = o.offsets[row], count = o.offsets[row + 1] - first;
  const int64_t g = head / (o.heads / o.kv_heads);
  const float* q = o.q + head * o.q_head + row * o.q_row;
  const float* keys = o.k + g * o.k_head;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = o.scale * dot(q, keys + o.index[first + j] * o.k_row, o.dim);
    top = scores[j] > top ? scores[j] : top;
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += LANES) {
    const __mmask16 m = count - j >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (count - j)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(m, scores + j);
    const __m512 p = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(scores + j, m, p);
    total = _mm512_add_ps(total, p);
  }
  const float inv = 1.f / _mm512_reduce_add_ps(total);
  __m512 acc[MAX_DIM / LANES];
  const int64_t chunks = o.dim / LANES;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  const float* values = o.v + g * o.v_head;
  for (int64_t j = 0; j < count; ++j) {
    const float* vj = values + o.index[first + j] * o.v_row;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + c * LANES), acc[c]);
  }
  float* out = o.out + (row * o.heads + head) * o.dim;
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + c * LANES, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
}

}  // namespace

namespace splitinfer {

int64_t check_visible(const int64_t* idx, int64_t index_numel, const int64_t* off, int64_t rows, int64_t slots) {
  int64_t longest = 0;
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(off[i] <= off[i + 1] && off[i + 1] <= index_numel && off[i + 1] > off[i],
                "rows_attention: row ", i, " sees no keys or its offsets are out of order");
    longest = std::max(longest, off[i + 1] - off[i]);
  }
  TORCH_CHECK(off[0] >= 0, "rows_attention: offsets must start at 0 or later");
  for (int64_t j = off[0]; j < off[rows]; ++j) {
    TORCH_CHECK(idx[j] >= 0 && idx[j] < slots, "rows_attention: key slot ", idx[j], " outside the ", slots, " cached");
  }
  return longest;
}

void attend_rows(const Operands& o, int64_t rows, int64_t longest) {
  at::parallel_for(0, rows * o.heads, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest + LANES);
    for (int64_t t = begin; t < end; ++t) attend(o, t / o.heads, t % o.heads, scores.data());
  });
}

}  // namespace splitinfer

namespace {

at::Tensor rows_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& index, const at::Tensor& offsets, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3, "rows_attention: query [H, Q, D], key and value [KVH, S, D]");
  for (const at::Tensor* t : {&query, &key, &value}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(2) == 1,
                "rows_attention: float32 CPU tensors with contiguous rows");
  }
  const int64_t heads = query.size(0), rows = query.size(1), dim = query.size(2), kv_heads = key.size(0);
  TORCH_CHECK(dim % LANES == 0 && dim <= MAX_DIM && key.size(2) == dim && value.size(2) == dim &&
                  value.size(0) == kv_heads && value.size(1) == key.size(1) && kv_heads > 0 && heads % kv_heads == 0,
              "rows_attention: shapes ", query.sizes(), ", ", key.sizes(), ", ", value.sizes(), " do not fit");
  TORCH_CHECK(index.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong && index.is_contiguous() &&
                  offsets.is_contiguous() && offsets.numel() == rows + 1,
              "rows_attention: index and offsets must be contiguous int64, offsets one longer than the rows");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* idx = index.data_ptr<int64_t>();
  const int64_t longest = splitinfer::check_visible(idx, index.numel(), off, rows, key.size(1));
  at::Tensor out = at::empty({rows, heads, dim}, query.options());
  const Operands o{query.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(),
                   query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                   idx, off, heads, kv_heads, dim, static_cast<float>(scale), out.data_ptr<float>()};
  splitinfer::attend_rows(o, rows, longest);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) {
  m.def("rows_attention(Tensor query, Tensor key, Tensor value, Tensor index, Tensor offsets, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("rows_attention", &rows_attention); }
