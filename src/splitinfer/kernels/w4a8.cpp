// int4 weights (Q4_1 groups of 32: w = d * q + m) times activations quantized to int8 per group of 32
// (Q8_1: x = dx * qx, sx = dx * sum(qx)), on AVX512-VNNI: splitinfer::w4a8_mm(x, packed, n) -> y float32.
//
// For one block of 32 inputs, one output column and one row:
//   sum_i w_i x_i  ~  d * dx * sum_i q_i qx_i  +  m * sx
// The integer sum is exact (vpdpbusd: unsigned nibbles times signed int8, summed in int32); the float epilogue
// runs per block in a fixed order. A row's instructions do not depend on which other rows share the call,
// so every row gets the same bits whether it is alone or one of 64 (tests/kernels/test_w4a8.py checks it).
//
// The packed weight (kernels/w4a8.py packs it) is [N / 16, K / 32, 320] bytes: for 16 output columns and one
// block, four 64-byte vectors of nibbles, then the 16 scales and 16 minima as float16 (GGUF keeps them so).
// Vector j holds, in the 4 bytes of column c, inputs 4j..4j+3 in the low nibbles and 16+4j..16+4j+3 in the
// high ones, so one AND (one shift and AND) gives the unsigned operand of vpdpbusd for four inputs of
// sixteen columns, against a broadcast of four int8 inputs of one row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "layout.h"

namespace {

constexpr int64_t QK = splitinfer::W4A8_GROUP;
constexpr int64_t COLS = splitinfer::W4A8_COLS;
constexpr int64_t NIBBLE_BYTES = COLS * QK / 2;
constexpr int64_t TILE_BYTES = splitinfer::W4A8_TILE_BYTES;
constexpr int MAX_ROWS = 8;                   // rows sharing one pass over a tile's weights

// x [M, K] -> int8 blocks: dx = max|x| / 127, qx = round-half-even(x * 127 / max|x|), sx = dx * sum(qx).
void quantize_blocks(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t B = K / QK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const float* p = x + m * K + b * QK;
      const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + b * QK), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * K + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
      const float d = amax / 127.f;
      dx[m * B + b] = d;
      sx[m * B + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
    }
  }
}

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// R rows of y (stride n) times the 16 columns of one tile, over all K / 32 blocks.
template <int R>
void tile_rows(const uint8_t* w, int64_t B, const int8_t* xq, const float* dx, const float* sx, int64_t K,
               float* y, int64_t n) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* t = w + b * TILE_BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * TILE_BYTES), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * TILE_BYTES + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * TILE_BYTES + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * TILE_BYTES + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(t + 4 * TILE_BYTES + 256), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(t + 64 * j);
      lo[j] = _mm512_and_si512(packed, low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + NIBBLE_BYTES)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + NIBBLE_BYTES + 32)));
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = xq + r * K + b * QK;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = _mm512_dpbusd_epi32(s0, lo[j], broadcast4(xr + 4 * j));
        s1 = _mm512_dpbusd_epi32(s1, hi[j], broadcast4(xr + 16 + 4 * j));
      }
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), _mm512_set1_ps(dx[r * B + b]));
      acc[r] = _mm512_fmadd_ps(f, d, acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[r * B + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, const float*, const float*, int64_t, float*, int64_t);
constexpr TileFn TILES[MAX_ROWS] = {tile_rows<1>, tile_rows<2>, tile_rows<3>, tile_rows<4>,
                                    tile_rows<5>, tile_rows<6>, tile_rows<7>, tile_rows<8>};

}  // namespace

namespace splitinfer {

void w4a8_product(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t n, float* y) {
  const int64_t B = K / QK, T = n / COLS;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> scales;
  xq.resize(M * K);
  scales.resize(2 * M * B);
  float* dx = scales.data();
  float* sx = dx + M * B;
  quantize_blocks(x, M, K, xq.data(), dx, sx);
  const int8_t* q = xq.data();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int64_t rows = std::min<int64_t>(MAX_ROWS, M - m0);
        TILES[rows - 1](w + t * B * TILE_BYTES, B, q + m0 * K, dx + m0 * B, sx + m0 * B, K, y + m0 * n + t * COLS, n);
      }
    }
  });
}

}  // namespace splitinfer

namespace {

at::Tensor w4a8_mm(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "w4a8_mm: x must be a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "w4a8_mm: packed must be the contiguous uint8 [N/16, K/32, 320] that kernels/w4a8.py packs");
  const int64_t M = x.size(0), K = x.size(1), B = K / QK, T = n / COLS;
  TORCH_CHECK(K % QK == 0 && n % COLS == 0 && packed.size(0) == T && packed.size(1) == B &&
                  packed.size(2) == TILE_BYTES,
              "w4a8_mm: x [", M, ", ", K, "] does not match packed ", packed.sizes(), " for n = ", n);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options());
  splitinfer::w4a8_product(xc.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) { m.def("w4a8_mm(Tensor x, Tensor packed, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) { m.impl("w4a8_mm", &w4a8_mm); }
