// The k likeliest next tokens of each logits row with their softmax probabilities, in two passes a row:
// splitinfer::row_top(logits [R, V] float32, k) -> (ids int64 [R, k], probs float32 [R, k]).
//
// Token Recycling (decoding/sources.py) keeps the top 8 successors of every row the LM head computes. In
// PyTorch that is softmax over the whole vocabulary and then topk: full passes over [R, 49152] and a
// probability row written and read back, about a millisecond a tree step of ~11 rows on one core.
//
// Pass 1 reads the row once against a threshold, the k-th largest value so far: a 16-float vector with no
// lane above it (nearly all of them once the list has filled) costs a compare; the few lanes above it are
// inserted into a sorted list of k. The list's head is the row's maximum. Pass 2 sums exp(x - max) in 16
// lanes with a polynomial exp; only the k kept values are divided by that sum. Ties keep the lower index
// first (the scan goes up the indices and only a value strictly above the threshold displaces one), so
// ids[:, 0] is torch.argmax's. Unlike topk over the probabilities, the order is the logits' also where
// probabilities underflow to 0. NaN logits crash nothing, but what they give is unspecified.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "layout.h"

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t MAX_K = 64;

// exp(x) for x <= 0 (layout.h's polynomial); lanes below -87.5 (including -inf and NaN) give 0: against the
// maximum's exp(0) = 1 they are below float's resolution of the sum anyway.
inline __m512 exp_le0(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.5f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, splitinfer::exp_nonpositive(x));
}

// A sorted list of the k largest (value, index) pairs seen, values descending, equal values by index.
struct TopList {
  float value[MAX_K];
  int64_t index[MAX_K];
  int64_t k, count = 0;

  float threshold() const { return value[k - 1]; }

  // Indices arrive in increasing order, so an equal value goes after those already in the list.
  void insert(float v, int64_t i) {
    int64_t p = count < k ? count++ : k - 1;
    for (; p > 0 && value[p - 1] < v; --p) {
      value[p] = value[p - 1];
      index[p] = index[p - 1];
    }
    value[p] = v;
    index[p] = i;
  }

  // The lanes of `m` (of the vector at x[base]) above the threshold, lowest lane first.
  void offer(const float* x, int64_t base, __mmask16 m) {
    for (uint32_t bits = m; bits; bits &= bits - 1) {
      const int64_t i = base + __builtin_ctz(bits);
      if (count < k || x[i] > threshold()) insert(x[i], i);
    }
  }
};

void top_of_row(const float* x, int64_t V, int64_t k, int64_t* ids, float* probs) {
  TopList top;
  top.k = k;
  const int64_t whole = V / LANES * LANES;
  const __mmask16 tail = static_cast<__mmask16>((1u << (V - whole)) - 1);
  // Pass 1. The first k values fill the list whatever they are (-inf included); then only lanes above it
  // (the first loop ends with the list full or the row's whole vectors done).
  int64_t j = 0;
  for (; j < whole && top.count < k; j += LANES) top.offer(x, j, 0xFFFF);
  for (; j + 4 * LANES <= whole; j += 4 * LANES) {
    const __m512 t = _mm512_set1_ps(top.threshold());
    const __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), t, _CMP_GT_OQ);
    const __mmask16 m1 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + LANES), t, _CMP_GT_OQ);
    const __mmask16 m2 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 2 * LANES), t, _CMP_GT_OQ);
    const __mmask16 m3 = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j + 3 * LANES), t, _CMP_GT_OQ);
    if (static_cast<uint16_t>(m0 | m1 | m2 | m3) == 0) continue;
    top.offer(x, j, m0);  // in index order: each offer sees the threshold the earlier ones left
    top.offer(x, j + LANES, m1);
    top.offer(x, j + 2 * LANES, m2);
    top.offer(x, j + 3 * LANES, m3);
  }
  for (; j < whole; j += LANES) {
    top.offer(x, j, _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(top.threshold()), _CMP_GT_OQ));
  }
  if (tail) top.offer(x, whole, tail);  // offer checks each lane against the threshold itself

  // Pass 2: sum of exp(x - max), four accumulators added in a fixed order.
  const float top_value = top.value[0];
  const __m512 mx = _mm512_set1_ps(top_value);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  j = 0;
  for (; j + 4 * LANES <= whole; j += 4 * LANES) {
    a0 = _mm512_add_ps(a0, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(x + j), mx)));
    a1 = _mm512_add_ps(a1, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(x + j + LANES), mx)));
    a2 = _mm512_add_ps(a2, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(x + j + 2 * LANES), mx)));
    a3 = _mm512_add_ps(a3, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(x + j + 3 * LANES), mx)));
  }
  for (; j < whole; j += LANES) a0 = _mm512_add_ps(a0, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(x + j), mx)));
  if (tail) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), tail, x + whole);
    a1 = _mm512_add_ps(a1, exp_le0(_mm512_sub_ps(v, mx)));
  }
  const double sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = top.index[i];
    probs[i] = static_cast<float>(std::exp(static_cast<double>(top.value[i] - top_value)) / sum);
  }
}

std::tuple<at::Tensor, at::Tensor> row_top(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu() &&
                  logits.stride(1) == 1,
              "row_top: logits must be float32 [rows, vocab] on the CPU with contiguous rows; got ",
              logits.scalar_type(), " ", logits.sizes(), " on ", logits.device());
  const int64_t rows = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= MAX_K && k <= V, "row_top: k must be 1..", MAX_K, " and at most the vocabulary (",
              V, "); got ", k);
  at::Tensor ids = at::empty({rows, k}, logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty({rows, k}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  int64_t* id = ids.data_ptr<int64_t>();
  float* p = probs.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) top_of_row(x + r * stride, V, k, id + r * k, p + r * k);
  });
  return {ids, probs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) { m.def("row_top(Tensor logits, int k) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("row_top", &row_top); }
