// int8 weights (one float32 scale an output row) times activations already quantized to int8 per row, on
// AVX512-VNNI: splitinfer::w8a8_mm(xq, packed, column_sums, scale) -> float32 [M, N].
//
// The operands are model/formats.py's Int8Linear's: xq holds the row's integers (-127..127, as float32),
// scale the weight's row scales. vpdpbusd multiplies unsigned by signed bytes, so the inputs are shifted
// to xq + 128 and 128 * sum_k W[n, k] taken back off: the int32 sum is exact. The epilogue is
// float(sum) * scale[n], what torch._int_mm and FBGEMM's product give (the caller multiplies by the row's
// own scale), so the three kernels give the same bits and every row its own (tests/kernels/test_w8a8.py).
//
// Four rows share each load of four 16-column tiles (16 accumulators; fewer rows are padded to four); five and six
// rows, one pass of six (`six`, 24 accumulators; 24 dot products a step where two passes of eight take 32, and
// one read of the stream: notes/bench/step-int8-rows); seven and eight rows share each load of two tiles (`pair`), the group's other two tiles then
// coming from the cache. Two passes of four rows over each group instead (the second from L2) were no faster in whole
// steps, alternating with this kernel (notes/bench/w8a8-eight, `splitinfer bench step-ab`).
// One pass (up to four rows) leaves the stream to the hardware prefetchers: asking for it 16 KB ahead with
// prefetcht0 made one to four rows 1.17-1.29x slower (a cloud step's 104 products at one row 5.04 ms against
// 4.23, notes/bench/w8a8-prefetch). Where several passes read a group, each asks for its share of the next
// group into L2 (`Ahead`): when only the first pass went to memory, memory idled while the others computed
// (the cloud's int8 products at eight rows took ~1.2x longer; into L1 instead, ~1.4x: the next group evicted
// the tiles still being read).
// Figures against FBGEMM on one core: notes/bench/w8a8-kernel (`splitinfer bench kernels --kernel w8a8`).
//
// The packed weight (kernels/w8a8.py packs it) is int8 [G, K / 4, 256]: G groups of four tiles of 16 output
// columns (N / 64 rounded up; zero tiles after the real ones), one stream a group, in chunks of 64 inputs, each
// chunk the four tiles' 16 steps in turn (layout.h); at step j (inputs 4j..4j+3) a tile's 64 bytes hold column
// c's four bytes at 4c, the signed operand of one vpdpbusd, and the next tile's are a chunk's steps x 64 bytes on.
// Where the CPU has AMX-INT8, w8a8_amx.cpp multiplies instead (w8a8_product's first line).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "layout.h"

namespace {

constexpr int64_t COLS = splitinfer::W8A8_COLS;
constexpr int ROWS = 4;       // rows sharing a pass over a group of tiles
constexpr int TILES = splitinfer::W8A8_TILES;
constexpr int SIX = 6;        // rows of one pass over a group's four tiles, for five and six rows
constexpr int64_t CHUNK = splitinfer::W8A8_CHUNK;  // steps (four inputs) a chunk of the packed weight
constexpr int WIDE = splitinfer::W8A8_ROWS;  // rows sharing a pass over two tiles of a group, from five rows

// The epilogue of one accumulator: row r, tile c of the group; rows and tiles past the real ones are padding.
inline void finish(__m512i acc, int r, int c, const int32_t* sums, const float* scale, const float* sx, float* y,
                   int64_t ldy, int rows, int tiles) {
  if (r >= rows || c >= tiles) return;
  splitinfer::w8a8_epilogue(acc, sums + c * COLS, scale + c * COLS, sx == nullptr ? nullptr : sx + r, y + r * ldy + c * COLS);
}

inline __m512i broadcast4(const uint8_t* p) {
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_set1_epi32(four);
}

// The part of the next group's stream that one of the `passes` passes over a group asks for, spread over the
// pass's K / 4 steps: with several passes over a group, a pass that finds its tiles cached would leave memory
// idle, so each pass asks for an equal share of the next group (the group's stream is K cache lines long).
struct Ahead {
  const int8_t* next = nullptr;  // the next group's stream, or nullptr (the last group)
  int64_t first = 0, count = 0;  // its lines this pass asks for
  void at(int64_t j, int64_t steps) const {
    if (next == nullptr) return;
    for (int64_t line = first + j * count / steps; line < first + (j + 1) * count / steps; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
    }
  }
};

// The four tiles' weights of step j (t: the step's bytes in tile 0, ts: the distance to the next tile's).
#define SPLITINFER_LOAD4                                                                  \
  const __m512i w0 = _mm512_loadu_si512(t), w1 = _mm512_loadu_si512(t + ts);              \
  const __m512i w2 = _mm512_loadu_si512(t + 2 * ts), w3 = _mm512_loadu_si512(t + 3 * ts);

// Row r's four inputs of step j times the four tiles, into row r's accumulators c<r>0..c<r>3.
#define SPLITINFER_ROW4(r)                                     \
  {                                                            \
    const __m512i x = broadcast4(a + r * K + 4 * j);           \
    c##r##0 = _mm512_dpbusd_epi32(c##r##0, x, w0);             \
    c##r##1 = _mm512_dpbusd_epi32(c##r##1, x, w1);             \
    c##r##2 = _mm512_dpbusd_epi32(c##r##2, x, w2);             \
    c##r##3 = _mm512_dpbusd_epi32(c##r##3, x, w3);             \
  }

// Four rows (a: [4, K] shifted bytes, padded) times four tiles (w: the group's first tile; tiles padded) ->
// the real `rows` x `tiles` of y. Sixteen named accumulators: in an array GCC moved or spilled them.
void group(const int8_t* w, int64_t K, const uint8_t* a, const int32_t* sums, const float* scale, const float* sx,
           float* y, int64_t ldy, int rows, int tiles, Ahead ahead, int64_t prefetch) {
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  __m512i c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  for (int64_t j0 = 0; j0 < K / 4; j0 += CHUNK) {  // layout.h's chunks; ts: one tile's bytes in this chunk
    const int64_t steps = std::min(CHUNK, K / 4 - j0), ts = steps * 64;
    for (int64_t j = j0; j < j0 + steps; ++j) {
      const int8_t* t = w + j0 * 64 * TILES + (j - j0) * 64;
      for (int line = 0; prefetch > 0 && line < TILES; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(t + prefetch + ts * line), _MM_HINT_T0);
      }
      ahead.at(j, K / 4);
      SPLITINFER_LOAD4
      SPLITINFER_ROW4(0) SPLITINFER_ROW4(1) SPLITINFER_ROW4(2) SPLITINFER_ROW4(3)
    }
  }
  const __m512i acc[ROWS][TILES] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}};
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < TILES; ++c) finish(acc[r][c], r, c, sums, scale, sx, y, ldy, rows, tiles);
}

// Six rows (a: [6, K], padded) times four tiles in one pass: 24 accumulators, four weights and a broadcast
// fill 29 of the 32 registers. Five and six rows then read the stream once, at 24 dot products a step
// rather than the 32 of two passes of eight rows.
void six(const int8_t* w, int64_t K, const uint8_t* a, const int32_t* sums, const float* scale, const float* sx,
         float* y, int64_t ldy, int rows, int tiles, Ahead ahead) {
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;
  __m512i c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;
  __m512i c40 = c00, c41 = c00, c42 = c00, c43 = c00, c50 = c00, c51 = c00, c52 = c00, c53 = c00;
  for (int64_t j0 = 0; j0 < K / 4; j0 += CHUNK) {  // layout.h's chunks; ts: one tile's bytes in this chunk
    const int64_t steps = std::min(CHUNK, K / 4 - j0), ts = steps * 64;
    for (int64_t j = j0; j < j0 + steps; ++j) {
      const int8_t* t = w + j0 * 64 * TILES + (j - j0) * 64;
      ahead.at(j, K / 4);
      SPLITINFER_LOAD4
      SPLITINFER_ROW4(0) SPLITINFER_ROW4(1) SPLITINFER_ROW4(2) SPLITINFER_ROW4(3) SPLITINFER_ROW4(4) SPLITINFER_ROW4(5)
    }
  }
  const __m512i acc[SIX][TILES] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23},
                                   {c30, c31, c32, c33}, {c40, c41, c42, c43}, {c50, c51, c52, c53}};
  for (int r = 0; r < SIX; ++r)
    for (int c = 0; c < TILES; ++c) finish(acc[r][c], r, c, sums, scale, sx, y, ldy, rows, tiles);
}

#define SPLITINFER_DOT2(r)                                         \
  {                                                                \
    const __m512i x = broadcast4(a + r * K + 4 * j);               \
    d##r##0 = _mm512_dpbusd_epi32(d##r##0, x, w0);                 \
    d##r##1 = _mm512_dpbusd_epi32(d##r##1, x, w1);                 \
  }

// Eight rows (a: [8, K], padded) times tiles c0 and c0 + 1 of a group. With four rows a pass, eight rows read
// the weight twice and the passes alternate between waiting on memory and on the dot products; this way the
// second pair of tiles comes from the cache, while `ahead` brings the next group in.
void pair(const int8_t* w, int64_t K, const uint8_t* a, const int32_t* sums, const float* scale, const float* sx,
          float* y, int64_t ldy, int rows, int tiles, int c0, Ahead ahead) {
  __m512i d00 = _mm512_setzero_si512(), d01 = d00, d10 = d00, d11 = d00, d20 = d00, d21 = d00, d30 = d00, d31 = d00;
  __m512i d40 = d00, d41 = d00, d50 = d00, d51 = d00, d60 = d00, d61 = d00, d70 = d00, d71 = d00;
  for (int64_t j0 = 0; j0 < K / 4; j0 += CHUNK) {  // layout.h's chunks; ts: one tile's bytes in this chunk
    const int64_t steps = std::min(CHUNK, K / 4 - j0), ts = steps * 64;
    for (int64_t j = j0; j < j0 + steps; ++j) {
      const int8_t* t = w + j0 * 64 * TILES + (j - j0) * 64;
      ahead.at(j, K / 4);
      const __m512i w0 = _mm512_loadu_si512(t + c0 * ts), w1 = _mm512_loadu_si512(t + (c0 + 1) * ts);
      SPLITINFER_DOT2(0) SPLITINFER_DOT2(1) SPLITINFER_DOT2(2) SPLITINFER_DOT2(3)
      SPLITINFER_DOT2(4) SPLITINFER_DOT2(5) SPLITINFER_DOT2(6) SPLITINFER_DOT2(7)
    }
  }
  const __m512i acc[WIDE][2] = {{d00, d01}, {d10, d11}, {d20, d21}, {d30, d31},
                                {d40, d41}, {d50, d51}, {d60, d61}, {d70, d71}};
  for (int r = 0; r < WIDE; ++r)
    for (int c = 0; c < 2; ++c) finish(acc[r][c], r, c0 + c, sums, scale, sx, y, ldy, rows, tiles);
}

// One row of quantize_rows_int8.
void quantize_row(const float* row, int64_t K, const float* smooth, uint8_t* out, float* scale) {
  thread_local std::vector<float> smoothed;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K % 16)) - 1);
  if (smooth != nullptr) {  // x * smooth, the product formats.py's Int8Linear quantizes
    smoothed.resize(K);
    for (int64_t i = 0; i < K; ++i) smoothed[i] = row[i] * smooth[i];
    row = smoothed.data();
  }
  __m512 top = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
  if (i < K) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row + i)));
  const float s = std::max(_mm512_reduce_max_ps(top) / 127.0f, std::numeric_limits<float>::min());
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i shift = _mm512_set1_epi32(128);
  for (i = 0; i < K; i += 16) {  // round(x / s) half to even, as torch.round; then + 128
    const __mmask16 live = K - i >= 16 ? static_cast<__mmask16>(0xFFFF) : tail;
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(live, row + i), sv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm512_mask_cvtepi32_storeu_epi8(out + i, live, _mm512_add_epi32(_mm512_cvtps_epi32(q), shift));
  }
}

}  // namespace

namespace splitinfer {

// Rows on the threads torch runs (each row's bits its own): at sixteen rows of a 7B layer's inputs, one thread took
// about a millisecond a step.
void quantize_rows_int8(const float* x, int64_t M, int64_t K, const float* smooth, uint8_t* a, float* scale) {
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, K, smooth, a + m * K, scale + m);
  });
}

void w8a8_product(const uint8_t* a, int64_t M, int64_t K, const int8_t* w, const int32_t* sums, const float* scale,
                  const float* sx, int64_t N, float* y, int64_t prefetch) {
  if (prefetch == 0 && amx_runs(K)) return amx_product(a, M, K, w, sums, scale, sx, N, y);
  const int64_t real_tiles = N / COLS, groups = (real_tiles + TILES - 1) / TILES;
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t t = g * TILES;
      const int tiles = static_cast<int>(std::min<int64_t>(TILES, real_tiles - t));
      const int8_t* stream = w + t * K * COLS;
      if (M <= ROWS) {  // one pass, the hardware prefetchers streaming the groups
        group(stream, K, a, sums + t * COLS, scale + t * COLS, sx, y + t * COLS, N, static_cast<int>(M), tiles, {},
              prefetch);
        continue;
      }
      const int64_t blocks = M / WIDE, rest = M % WIDE;  // passes: two a block of eight, one or two for the rest
      // (one for five or six rows)
      const int64_t passes = blocks * ((tiles + 1) / 2) + (rest == 0 ? 0 : rest > SIX ? (tiles + 1) / 2 : 1);
      const int8_t* next = g + 1 < g1 ? stream + TILES * K * COLS : nullptr;
      int64_t pass = 0;  // this pass's share of the next group: lines [pass * K / passes, (pass + 1) * K / passes)
      const auto share = [&] { return Ahead{next, pass * K / passes, (pass + 1) * K / passes - pass * K / passes}; };
      for (int64_t m = 0; m < M;) {
        const float* row_scale = sx == nullptr ? nullptr : sx + m;
        const int rows = static_cast<int>(std::min<int64_t>(M - m, WIDE));
        float* out = y + m * N + t * COLS;
        if (rows > SIX) {
          for (int c0 = 0; c0 < tiles; c0 += 2, ++pass) {
            pair(stream, K, a + m * K, sums + t * COLS, scale + t * COLS, row_scale, out, N, rows, tiles, c0, share());
          }
        } else if (rows > ROWS) {
          six(stream, K, a + m * K, sums + t * COLS, scale + t * COLS, row_scale, out, N, rows, tiles, share());
          ++pass;
        } else {
          group(stream, K, a + m * K, sums + t * COLS, scale + t * COLS, row_scale, out, N, rows, tiles, share(),
                prefetch);
          ++pass;
        }
        m += rows;
      }
    }
  });
}

void w8a8_rows(const float* x, int64_t M, int64_t K, const float* smooth, const int8_t* packed, const int32_t* sums,
               const float* scale, int64_t N, float* y) {
  thread_local std::vector<uint8_t> a;
  thread_local std::vector<float> sx;
  a.resize(w8a8_padded_rows(M) * K);
  std::fill(a.begin() + M * K, a.end(), 128);  // the kernel reads whole blocks: padding rows of zeros
  sx.resize(M);
  quantize_rows_int8(x, M, K, smooth, a.data(), sx.data());
  w8a8_product(a.data(), M, K, packed, sums, scale, sx.data(), N, y);
}

}  // namespace splitinfer

namespace {

at::Tensor w8a8_mm(const at::Tensor& xq, const at::Tensor& packed, const at::Tensor& sums, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& row_scale, int64_t prefetch) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kFloat && xq.device().is_cpu(),
              "w8a8_mm: xq must be a 2-D float32 CPU tensor of integers in -127..127");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.size(2) == 64 * TILES,
              "w8a8_mm: packed must be the contiguous int8 [G, K/4, 256] that kernels/w8a8.py packs");
  const int64_t M = xq.size(0), K = xq.size(1), T = packed.size(0) * TILES, N = sums.numel(), real_tiles = N / COLS;
  TORCH_CHECK(packed.size(1) * 4 == K, "w8a8_mm: xq [", M, ", ", K, "] does not match packed ", packed.sizes());
  TORCH_CHECK(N % COLS == 0 && T == (real_tiles + TILES - 1) / TILES * TILES && sums.scalar_type() == at::kInt &&
                  sums.is_contiguous() && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "w8a8_mm: column sums (int32) and scales (float32) must have an entry for each of the ", N,
              " columns packed in ", packed.sizes());
  const float* sx = nullptr;
  at::Tensor rs;
  if (row_scale.has_value()) {
    rs = row_scale->contiguous();
    TORCH_CHECK(rs.scalar_type() == at::kFloat && rs.numel() == M, "w8a8_mm: row_scale must be float32 [", M, "]");
    sx = rs.data_ptr<float>();
  }
  const at::Tensor xc = xq.contiguous();
  std::vector<uint8_t> a(splitinfer::w8a8_padded_rows(M) * K, 128);  // padding rows: inputs of zero
  const float* x = xc.data_ptr<float>();
  for (int64_t i = 0; i < M * K; ++i) a[i] = static_cast<uint8_t>(static_cast<int32_t>(x[i]) + 128);
  at::Tensor y = at::empty({M, N}, xq.options());
  splitinfer::w8a8_product(a.data(), M, K, packed.data_ptr<int8_t>(), sums.data_ptr<int32_t>(), scale.data_ptr<float>(),
                           sx, N, y.data_ptr<float>(), prefetch);
  return y;
}

// y = x W^T (+ bias) as formats.py's Int8Linear.forward computes it on this kernel, in one call: x [M, K] float32
// (times smooth [K] where given) quantized per row (quantize_rows_int8: quantize_rows' bits), the product with the
// row scales in its epilogue, then the bias added. What the LM head and a draft head's readout run a step.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sums, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& smooth, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "w8a8_linear: x must be a 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = sums.numel();
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) * 4 == K && packed.size(2) == 64 * TILES && N % COLS == 0 &&
                  packed.size(0) == (N / COLS + TILES - 1) / TILES && sums.scalar_type() == at::kInt &&
                  sums.is_contiguous() && scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "w8a8_linear: x [", M, ", ", K, "] does not fit the packed weight ", packed.sizes(), " of ", N, " columns");
  const auto floats = [&](const c10::optional<at::Tensor>& t, int64_t size, const char* name) -> const float* {
    if (!t.has_value()) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == size, "w8a8_linear: ", name,
                " must be float32 [", size, "]");
    return t->data_ptr<float>();
  };
  const float* smoothing = floats(smooth, K, "smooth");
  const float* b = floats(bias, N, "bias");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  float* out = y.data_ptr<float>();
  splitinfer::w8a8_rows(xc.data_ptr<float>(), M, K, smoothing, packed.data_ptr<int8_t>(), sums.data_ptr<int32_t>(),
                        scale.data_ptr<float>(), N, out);
  for (int64_t m = 0; b != nullptr && m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) out[m * N + n] += b[n];
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitinfer, m) {
  m.def("w8a8_mm(Tensor xq, Tensor packed, Tensor column_sums, Tensor scale, Tensor? row_scale=None, int prefetch=0) "
        "-> Tensor");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor column_sums, Tensor scale, Tensor? smooth=None, Tensor? bias=None) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(splitinfer, CPU, m) {
  m.impl("w8a8_mm", &w8a8_mm);
  m.impl("w8a8_linear", &w8a8_linear);
}

