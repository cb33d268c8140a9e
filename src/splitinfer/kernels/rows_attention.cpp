// Exact-rows attention: splitinfer::rows_attention(query, key, value, index, offsets, scale) -> out.
//
// Query row i attends to the cached keys index[offsets[i] : offsets[i + 1]], in that order (model/attention.py
// lists them in ascending position: the committed prefix, then the row's ancestors in the block, then itself).
// A row's arithmetic reads nothing but its own query and those keys, in a fixed order, so a tree's row and
// the same row decoded alone on a cache holding its ancestors get the same bits.
//
// Per row and query head: scores s_j = scale * <q, k_j> (16-lane partial sums, then a fixed reduction, four
// keys at a time), p_j = exp(s_j - max s) (a float32 polynomial, below), out = sum_j p_j v_j / sum_j p_j (even
// and odd keys summed apart, then added).
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

#include "layout.h"

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t MAX_DIM = 256;  // head dimensions up to this stay in registers' worth of stack

// The sums of four vectors' lanes, as the first four lanes of the result (a fixed order of additions).
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));  // a 128-bit lane: [a0 a1 a2 a3]
  const __m512 z = _mm512_add_ps(y, _mm512_shuffle_f32x4(y, y, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, _MM_SHUFFLE(2, 3, 0, 1))));
}

using Operands = splitinfer::AttentionOperands;

// exp(s - top) in place over a row's scores; returns 1 / their sum.
inline float softmax_in_place(float* scores, int64_t count, float top) {
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += LANES) {
    const __mmask16 m = count - t >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (count - t)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(m, scores + t);
    const __m512 p = _mm512_maskz_mov_ps(m, splitinfer::exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(scores + t, m, p);
    total = _mm512_add_ps(total, p);
  }
  return 1.f / _mm512_reduce_add_ps(total);
}

// One query row and H query heads of one key/value head (heads head0..head0 + H - 1), head_dim = 16 C: scores
// (row h of `scores`, `stride` apart), softmax, weighted values. Scores four keys at a time, values in two
// interleaved sums (even and odd keys); each key and value is loaded once for the H heads. A head's operations
// depend on its row's visible keys and their count alone, the same whatever H (tests/model/test_attention.py).
template <int C, int H>
void attend_heads(const Operands& o, int64_t row, int64_t head0, float* scores, int64_t stride) {
  const int64_t first = o.offsets[row], count = o.offsets[row + 1] - first;
  const int64_t g = head0 / (o.heads / o.kv_heads);
  const int64_t* idx = o.index + first;
  const float* keys = o.k + g * o.k_head;
  __m512 qv[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_loadu_ps(o.q + (head0 + h) * o.q_head + row * o.q_row + c * LANES);
  const __m128 scale4 = _mm_set1_ps(o.scale);
  __m128 top4[H];
  for (int h = 0; h < H; ++h) top4[h] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k0 = keys + idx[j] * o.k_row;
    const float* k1 = keys + idx[j + 1] * o.k_row;
    const float* k2 = keys + idx[j + 2] * o.k_row;
    const float* k3 = keys + idx[j + 3] * o.k_row;
    __m512 a[H][4];
    for (int c = 0; c < C; ++c) {
      const __m512 x0 = _mm512_loadu_ps(k0 + c * LANES), x1 = _mm512_loadu_ps(k1 + c * LANES);
      const __m512 x2 = _mm512_loadu_ps(k2 + c * LANES), x3 = _mm512_loadu_ps(k3 + c * LANES);
      for (int h = 0; h < H; ++h) {
        a[h][0] = c == 0 ? _mm512_mul_ps(qv[h][0], x0) : _mm512_fmadd_ps(qv[h][c], x0, a[h][0]);
        a[h][1] = c == 0 ? _mm512_mul_ps(qv[h][0], x1) : _mm512_fmadd_ps(qv[h][c], x1, a[h][1]);
        a[h][2] = c == 0 ? _mm512_mul_ps(qv[h][0], x2) : _mm512_fmadd_ps(qv[h][c], x2, a[h][2]);
        a[h][3] = c == 0 ? _mm512_mul_ps(qv[h][0], x3) : _mm512_fmadd_ps(qv[h][c], x3, a[h][3]);
      }
    }
    for (int h = 0; h < H; ++h) {
      const __m128 s = _mm_mul_ps(scale4, sum4(a[h][0], a[h][1], a[h][2], a[h][3]));
      _mm_storeu_ps(scores + h * stride + j, s);
      top4[h] = _mm_max_ps(top4[h], s);
    }
  }
  float top[H], inv[H];
  for (int h = 0; h < H; ++h) top[h] = std::max(std::max(top4[h][0], top4[h][1]), std::max(top4[h][2], top4[h][3]));
  for (int64_t t = j; t < count; ++t) {  // the last count % 4 keys
    const float* k0 = keys + idx[t] * o.k_row;
    for (int h = 0; h < H; ++h) {
      __m512 a0 = _mm512_mul_ps(qv[h][0], _mm512_loadu_ps(k0));
      for (int c = 1; c < C; ++c) a0 = _mm512_fmadd_ps(qv[h][c], _mm512_loadu_ps(k0 + c * LANES), a0);
      const float score = o.scale * _mm512_reduce_add_ps(a0);
      scores[h * stride + t] = score;
      top[h] = score > top[h] ? score : top[h];
    }
  }
  for (int h = 0; h < H; ++h) inv[h] = softmax_in_place(scores + h * stride, count, top[h]);
  const float* values = o.v + g * o.v_head;
  __m512 even[H][C], odd[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
  for (j = 0; j + 2 <= count; j += 2) {
    const float* v0 = values + idx[j] * o.v_row;
    const float* v1 = values + idx[j + 1] * o.v_row;
    for (int c = 0; c < C; ++c) {
      const __m512 x0 = _mm512_loadu_ps(v0 + c * LANES), x1 = _mm512_loadu_ps(v1 + c * LANES);
      for (int h = 0; h < H; ++h) {
        even[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * stride + j]), x0, even[h][c]);
        odd[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * stride + j + 1]), x1, odd[h][c]);
      }
    }
  }
  if (j < count) {
    const float* v0 = values + idx[j] * o.v_row;
    for (int c = 0; c < C; ++c) {
      const __m512 x0 = _mm512_loadu_ps(v0 + c * LANES);
      for (int h = 0; h < H; ++h) even[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[h * stride + j]), x0, even[h][c]);
    }
  }
  for (int h = 0; h < H; ++h) {
    float* out = o.out + (row * o.heads + head0 + h) * o.dim;
    const __m512 scale = _mm512_set1_ps(inv[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + c * LANES, _mm512_mul_ps(_mm512_add_ps(even[h][c], odd[h][c]), scale));
  }
}

using HeadsFn = void (*)(const Operands&, int64_t, int64_t, float*, int64_t);
constexpr int MAX_HEADS = 4;  // heads a pass (64-wide heads; 128-wide: two; others one)
constexpr HeadsFn HEADS_64[MAX_HEADS] = {attend_heads<4, 1>, attend_heads<4, 2>, attend_heads<4, 3>, attend_heads<4, 4>};
constexpr HeadsFn HEADS_128[2] = {attend_heads<8, 1>, attend_heads<8, 2>};
constexpr HeadsFn ONE_HEAD[MAX_DIM / LANES] = {
    attend_heads<1, 1>,  attend_heads<2, 1>,  attend_heads<3, 1>,  attend_heads<4, 1>,  attend_heads<5, 1>,  attend_heads<6, 1>,
    attend_heads<7, 1>,  attend_heads<8, 1>,  attend_heads<9, 1>,  attend_heads<10, 1>, attend_heads<11, 1>, attend_heads<12, 1>,
    attend_heads<13, 1>, attend_heads<14, 1>, attend_heads<15, 1>, attend_heads<16, 1>};

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
  const int64_t group = o.heads / o.kv_heads;
  const int64_t chunks = o.dim / LANES;
  const int64_t per_pass = chunks == 4 ? MAX_HEADS : chunks == 8 ? 2 : 1;  // heads sharing each key's loads
  const int64_t passes = (group + per_pass - 1) / per_pass, per_kv = rows * passes;
  at::parallel_for(0, o.kv_heads * per_kv, 4, [&](int64_t begin, int64_t end) {
    const int64_t stride = longest + LANES;
    std::vector<float> scores(per_pass * stride);
    for (int64_t t = begin; t < end; ++t) {  // key/value head outermost: its keys stay in cache for every row
      const int64_t g = t / per_kv, row = t % per_kv / passes, first = g * group + t % passes * per_pass;
      const int64_t heads = std::min(per_pass, g * group + group - first);
      if (chunks == 4) {
        HEADS_64[heads - 1](o, row, first, scores.data(), stride);
      } else if (chunks == 8) {
        HEADS_128[heads - 1](o, row, first, scores.data(), stride);
      } else {
        ONE_HEAD[chunks - 1](o, row, first, scores.data(), stride);
      }
    }
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
