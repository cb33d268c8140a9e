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

// A pass: one query row and H query heads of one key/value head (heads head0..head0 + H - 1), head_dim = 16 C,
// taken over the row's visible keys a span at a time (attend_rows shares each span of keys among every pass of
// its key/value head while they are in cache). Scores four keys at a time, values in two interleaved sums (even
// and odd keys); each key and value is loaded once for the H heads. A head's operations depend on its row's
// visible keys and their count alone, in the same order whatever H and however the keys are spanned
// (tests/model/test_attention.py).
struct Pass {
  int64_t row, head0;
  float* scores;  // [H, stride]: the row's scores, then its probabilities
  float* top4;    // [H, 4]: the running maxima of the four-key groups' scores
  float* sums;    // [H, 2, 16 C]: the even and odd keys' weighted values
  float inv[4];   // 1 / the probabilities' sum, a head
};

// Scores of the row's keys [j0, j1) that fall in whole groups of four (j0 a multiple of four).
template <int C, int H>
void score_span(const Operands& o, Pass& p, int64_t stride, int64_t j0, int64_t j1) {
  const int64_t first = o.offsets[p.row], count = o.offsets[p.row + 1] - first, end = std::min(j1, count / 4 * 4);
  if (j0 >= end) return;
  const int64_t g = p.head0 / (o.heads / o.kv_heads);
  const int64_t* idx = o.index + first;
  const float* keys = o.k + g * o.k_head;
  __m512 qv[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) qv[h][c] = _mm512_loadu_ps(o.q + (p.head0 + h) * o.q_head + p.row * o.q_row + c * LANES);
  const __m128 scale4 = _mm_set1_ps(o.scale);
  __m128 top4[H];
  for (int h = 0; h < H; ++h) top4[h] = _mm_loadu_ps(p.top4 + 4 * h);
  for (int64_t j = j0; j < end; j += 4) {
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
      _mm_storeu_ps(p.scores + h * stride + j, s);
      top4[h] = _mm_max_ps(top4[h], s);
    }
  }
  for (int h = 0; h < H; ++h) _mm_storeu_ps(p.top4 + 4 * h, top4[h]);
}

// After every span's groups of four: the last count % 4 keys' scores, then the softmax.
template <int C, int H>
void score_rest(const Operands& o, Pass& p, int64_t stride) {
  const int64_t first = o.offsets[p.row], count = o.offsets[p.row + 1] - first;
  const float* keys = o.k + p.head0 / (o.heads / o.kv_heads) * o.k_head;
  for (int h = 0; h < H; ++h) {
    const float* q = o.q + (p.head0 + h) * o.q_head + p.row * o.q_row;
    const float* t4 = p.top4 + 4 * h;
    float top = std::max(std::max(t4[0], t4[1]), std::max(t4[2], t4[3]));
    for (int64_t t = count / 4 * 4; t < count; ++t) {
      const float* k0 = keys + o.index[first + t] * o.k_row;
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k0));
      for (int c = 1; c < C; ++c) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * LANES), _mm512_loadu_ps(k0 + c * LANES), a0);
      const float score = o.scale * _mm512_reduce_add_ps(a0);
      p.scores[h * stride + t] = score;
      top = score > top ? score : top;
    }
    p.inv[h] = softmax_in_place(p.scores + h * stride, count, top);
  }
}

// Lanes c0 * 16 .. (c0 + B) * 16 of the row's keys [j0, end) (j0 even) weighted into the even and odd sums; the
// last key of an odd count goes to the even sums. B chunks at a time keep the sums in registers (2 H B of them).
template <int C, int H, int B>
void weigh_lanes(const Operands& o, Pass& p, int64_t stride, int64_t j0, int64_t end, int c0) {
  const int64_t* idx = o.index + o.offsets[p.row];
  const float* values = o.v + p.head0 / (o.heads / o.kv_heads) * o.v_head + c0 * LANES;
  float* sums = p.sums + c0 * LANES;
  __m512 even[H][B], odd[H][B];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < B; ++c) {
      even[h][c] = _mm512_loadu_ps(sums + (2 * h) * C * LANES + c * LANES);
      odd[h][c] = _mm512_loadu_ps(sums + (2 * h + 1) * C * LANES + c * LANES);
    }
  int64_t j = j0;
  for (; j + 2 <= end; j += 2) {
    const float* v0 = values + idx[j] * o.v_row;
    const float* v1 = values + idx[j + 1] * o.v_row;
    for (int c = 0; c < B; ++c) {
      const __m512 x0 = _mm512_loadu_ps(v0 + c * LANES), x1 = _mm512_loadu_ps(v1 + c * LANES);
      for (int h = 0; h < H; ++h) {
        even[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p.scores[h * stride + j]), x0, even[h][c]);
        odd[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p.scores[h * stride + j + 1]), x1, odd[h][c]);
      }
    }
  }
  if (j < end) {  // end == count, odd
    const float* v0 = values + idx[j] * o.v_row;
    for (int c = 0; c < B; ++c) {
      const __m512 x0 = _mm512_loadu_ps(v0 + c * LANES);
      for (int h = 0; h < H; ++h) even[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p.scores[h * stride + j]), x0, even[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < B; ++c) {
      _mm512_storeu_ps(sums + (2 * h) * C * LANES + c * LANES, even[h][c]);
      _mm512_storeu_ps(sums + (2 * h + 1) * C * LANES + c * LANES, odd[h][c]);
    }
}

// Chunks of 16 lanes weighed at a time: the largest divisor of C up to 8 / H (16 sums in registers at most).
constexpr int lanes_a_group(int C, int H) {
  int b = 8 / H > 1 ? 8 / H : 1;
  while (C % b != 0) --b;
  return b;
}

// The row's keys [j0, j1) weighted into its sums, a few lanes at a time (each lane's sums are its own: the same
// bits whatever the grouping of lanes).
template <int C, int H>
void weigh_span(const Operands& o, Pass& p, int64_t stride, int64_t j0, int64_t j1) {
  const int64_t end = std::min(j1, o.offsets[p.row + 1] - o.offsets[p.row]);
  constexpr int B = lanes_a_group(C, H);
  for (int c0 = 0; j0 < end && c0 < C; c0 += B) weigh_lanes<C, H, B>(o, p, stride, j0, end, c0);
}

template <int C, int H>
void finish(const Operands& o, const Pass& p) {
  for (int h = 0; h < H; ++h) {
    float* out = o.out + (p.row * o.heads + p.head0 + h) * o.dim;
    const float* even = p.sums + (2 * h) * C * LANES;
    const float* odd = p.sums + (2 * h + 1) * C * LANES;
    const __m512 scale = _mm512_set1_ps(p.inv[h]);
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(out + c * LANES, _mm512_mul_ps(_mm512_add_ps(_mm512_loadu_ps(even + c * LANES),
                                                                    _mm512_loadu_ps(odd + c * LANES)), scale));
    }
  }
}

// One pass's four stages for a head width and heads a pass.
struct Stages {
  void (*score)(const Operands&, Pass&, int64_t, int64_t, int64_t);
  void (*rest)(const Operands&, Pass&, int64_t);
  void (*weigh)(const Operands&, Pass&, int64_t, int64_t, int64_t);
  void (*done)(const Operands&, const Pass&);
};

template <int C, int H>
constexpr Stages stages() {
  return {score_span<C, H>, score_rest<C, H>, weigh_span<C, H>, finish<C, H>};
}

constexpr int MAX_HEADS = 4;  // heads a pass (64-wide heads; 128-wide: two; others one)
constexpr Stages HEADS_64[MAX_HEADS] = {stages<4, 1>(), stages<4, 2>(), stages<4, 3>(), stages<4, 4>()};
constexpr Stages HEADS_128[2] = {stages<8, 1>(), stages<8, 2>()};
constexpr Stages ONE_HEAD[MAX_DIM / LANES] = {
    stages<1, 1>(),  stages<2, 1>(),  stages<3, 1>(),  stages<4, 1>(),  stages<5, 1>(),  stages<6, 1>(),
    stages<7, 1>(),  stages<8, 1>(),  stages<9, 1>(),  stages<10, 1>(), stages<11, 1>(), stages<12, 1>(),
    stages<13, 1>(), stages<14, 1>(), stages<15, 1>(), stages<16, 1>()};
// Keys a span: 64 keys and their values, 128 wide, are 32 KB each, so a span stays in L1/L2 while every pass
// of its key/value head reads it (a multiple of four, so spans keep the groups of four and the pairs).
constexpr int64_t SPAN = 64;

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
  const int64_t passes = (group + per_pass - 1) / per_pass;
  // Work items: a key/value head and a block of its rows, enough blocks that every thread has one.
  const int64_t blocks = std::min(rows, std::max<int64_t>(1, (at::get_num_threads() + o.kv_heads - 1) / o.kv_heads));
  at::parallel_for(0, o.kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t stride = longest + LANES;
    std::vector<Pass> work;
    std::vector<float> scores, top4, sums;
    for (int64_t t = begin; t < end; ++t) {  // key/value head outermost: its keys stay in cache for every row
      const int64_t g = t / blocks, b = t % blocks, row0 = b * rows / blocks, row1 = (b + 1) * rows / blocks;
      const int64_t n = (row1 - row0) * passes;
      scores.resize(n * per_pass * stride);
      top4.assign(n * per_pass * 4, -std::numeric_limits<float>::infinity());
      sums.assign(n * per_pass * 2 * o.dim, 0.f);
      work.clear();
      std::vector<const Stages*> kinds;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = row0 + i / passes, head0 = g * group + i % passes * per_pass;
        const int64_t heads = std::min(per_pass, g * group + group - head0);
        work.push_back(Pass{row, head0, scores.data() + i * per_pass * stride, top4.data() + i * per_pass * 4,
                            sums.data() + i * per_pass * 2 * o.dim, {}});
        kinds.push_back(chunks == 4 ? &HEADS_64[heads - 1] : chunks == 8 ? &HEADS_128[heads - 1] : &ONE_HEAD[chunks - 1]);
      }
      for (int64_t j0 = 0; j0 < longest; j0 += SPAN)
        for (int64_t i = 0; i < n; ++i) kinds[i]->score(o, work[i], stride, j0, j0 + SPAN);
      for (int64_t i = 0; i < n; ++i) kinds[i]->rest(o, work[i], stride);
      for (int64_t j0 = 0; j0 < longest; j0 += SPAN)
        for (int64_t i = 0; i < n; ++i) kinds[i]->weigh(o, work[i], stride, j0, j0 + SPAN);
      for (int64_t i = 0; i < n; ++i) kinds[i]->done(o, work[i]);
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
