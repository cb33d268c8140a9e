// RMS norm in one pass a row: splitinfer::rms_norm(x, weight, eps) -> weight * (x / sqrt(mean(x^2) + eps)).
//
// PyTorch's CPU `rms_norm` is a composite of seven tensor calls (~30 us a call at one row of 576, two a
// decoder layer: 1.6 ms of a 9.4 ms int4 cloud step). Here one loop a row: the squares summed in 16 lanes
// and reduced in a fixed order, then x * r * weight as transformers orders it. A row's bits depend on that
// row alone. Its rounding is not transformers' (their mean sums in another order), so model/fused.py uses
// it only in layers whose products are integer, where bits are the format's own, never transformers'.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "layout.h"

namespace splitinfer {

void rms_norm_rows(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* y) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / dim), [&](int64_t r0, int64_t r1) {  // a row's bits its own
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = _mm512_loadu_ps(xr + d);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float mean = _mm512_reduce_add_ps(acc) / static_cast<float>(dim);
      const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xr + d), scale);
        _mm512_storeu_ps(y + r * dim + d, _mm512_mul_ps(_mm512_loadu_ps(w + d), v));
      }
    }
  });
}

}  // namespace splitinfer

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t dim = weight.numel();
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == dim && dim % 16 == 0,
              "rms_norm: float32 CPU input [..., D] and weight [D], D a multiple of 16; got ", x.sizes(), " and ",
              weight.sizes());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  splitinfer::rms_norm_rows(xc.data_ptr<float>(), xc.numel() / dim, dim, weight.data_ptr<float>(),
                            static_cast<float>(eps), y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("rms_norm", &rms_norm); }
