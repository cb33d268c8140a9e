// What splitinfer's CPU kernels share (kernels/build.py builds them into one library): the packing layout of
// the integer weights, which kernels/w4a8.py and kernels/w8a8.py read back from the built library
// (splitinfer::layout) rather than repeating it, and the raw loops each .cpp file defines for the others
// (decoder_layer.cpp composes them into one call a decoder layer).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace splitinfer {

// int4 (w4a8): a tile is W4A8_COLS output columns times W4A8_GROUP inputs: the columns' nibbles (two a byte),
// then their float16 scales, then their float16 minima. Packed weight: uint8 [N / 16, K / 32, 320].
constexpr int64_t W4A8_GROUP = 32;  // inputs a block (GGUF's Q4_1 and Q8_1)
constexpr int64_t W4A8_COLS = 16;   // output columns a tile: one vector of float32
constexpr int64_t W4A8_TILE_BYTES = W4A8_COLS * W4A8_GROUP / 2 + 2 * W4A8_COLS * 2;
// int8 (w8a8): a tile is W8A8_COLS output columns; W8A8_TILES tiles make a group (the last group padded with zero
// columns), stored in chunks of W8A8_DEPTH inputs: [group, chunk, tile, step, column, input], a step being four
// inputs. A tile's chunk is then 1 KB in one piece (an AMX weight tile), chunk c starts at step c * W8A8_CHUNK
// (byte c * W8A8_CHUNK * W8A8_GROUP_BYTES of the group), and the last chunk of K % 64 inputs holds fewer steps.
// Packed weight: int8 [N / 64 rounded up, K / 4, 256].
constexpr int64_t W8A8_COLS = 16;
constexpr int64_t W8A8_TILES = 4;
constexpr int64_t W8A8_GROUP_BYTES = W8A8_COLS * W8A8_TILES * 4;  // a step's bytes, all four tiles
constexpr int64_t W8A8_DEPTH = 64;                                 // inputs a chunk
constexpr int64_t W8A8_CHUNK = W8A8_DEPTH / 4;                     // steps a chunk

// w4a8.cpp: x [M, K] float32 times a packed int4 weight -> y [M, n] float32.
void w4a8_product(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t n, float* y);

// The int8 product's epilogue for 16 output columns, one definition for w8a8.cpp's VNNI loops and w8a8_amx.cpp's
// tiles (so both give the same bits): acc, the sums of the inputs' bytes (+ 128) times the weights, less 128 * the
// columns' weight sums, as float, times the columns' scales, then (sx not null) times the row's scale *sx.
inline void w8a8_epilogue(__m512i acc, const int32_t* column_sums, const float* scale, const float* sx, float* y) {
  const __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(column_sums), 7);
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, shift)), _mm512_loadu_ps(scale));
  _mm512_storeu_ps(y, sx == nullptr ? f : _mm512_mul_ps(f, _mm512_set1_ps(*sx)));
}

// w8a8.cpp: rows of x [M, K] (times smooth [K], where not null) quantized as model/formats.py's quantize_rows
// (scale[m] = max|x_m| / 127, at least FLT_MIN; round(x / scale) half to even), stored + 128 as bytes in a.
void quantize_rows_int8(const float* x, int64_t M, int64_t K, const float* smooth, uint8_t* a, float* scale);
constexpr int64_t W8A8_ROWS = 8;  // w8a8_product reads its rows in blocks of this many
// The rows w8a8_product's input holds for M real ones: M rounded up to whole blocks.
constexpr int64_t w8a8_padded_rows(int64_t M) { return (M + W8A8_ROWS - 1) / W8A8_ROWS * W8A8_ROWS; }
// w8a8.cpp: a [M rounded up to W8A8_ROWS, K] (quantize_rows_int8's bytes; padding rows 128) times a packed int8 weight
// -> y [M, N] = float(sum) * scale[n] (* sx[m] where not null). prefetch > 0 (an A/B knob): the VNNI loops even
// where AMX runs, a pass of up to four rows asking for the weight that many bytes ahead with prefetcht0 (measured
// slower: off by default).
void w8a8_product(const uint8_t* a, int64_t M, int64_t K, const int8_t* packed, const int32_t* sums, const float* scale,
                  const float* sx, int64_t N, float* y, int64_t prefetch = 0);
// w8a8.cpp: x [M, K] float32 rows (times smooth where not null) quantized per row, then their w8a8_product with the row
// scales applied: Int8Linear's product without its bias.
void w8a8_rows(const float* x, int64_t M, int64_t K, const float* smooth, const int8_t* packed, const int32_t* sums,
               const float* scale, int64_t N, float* y);

// w8a8_amx.cpp: whether w8a8_product runs on AMX tiles for an input of K (the CPU has AMX-INT8, Linux granted
// it, it is chosen, and K is whole chunks of 64), and that product (w8a8_product's operands and bits).
bool amx_runs(int64_t K);
void amx_product(const uint8_t* a, int64_t M, int64_t K, const int8_t* packed, const int32_t* sums, const float* scale,
                 const float* sx, int64_t N, float* y);

// rms_norm.cpp: rows of x [rows, dim] -> y = weight * (x / sqrt(mean(x^2) + eps)), each row's bits its own.
void rms_norm_rows(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* y);

// rows_attention.cpp: query row i attends to keys index[offsets[i] : offsets[i + 1]] (slots of key/value).
struct AttentionOperands {
  const float *q, *k, *v;
  int64_t q_head, q_row, k_head, k_row, v_head, v_row;  // strides, in floats
  const int64_t *index, *offsets;
  int64_t heads, kv_heads, dim;
  float scale;
  float* out;  // [rows, heads, dim]
};
// Checks that every row sees at least one key and every slot is below `slots`; returns the longest list.
int64_t check_visible(const int64_t* index, int64_t index_numel, const int64_t* offsets, int64_t rows, int64_t slots);
void attend_rows(const AttentionOperands& o, int64_t rows, int64_t longest);

// exp(x) for x <= 0 (scores or logits minus their maximum), 16 lanes: 2^n * p(r) with x = n ln2 + r (Cody-Waite:
// ln 2 in a part exact in float and the rest), p of degree 7; x is clamped at -87.33654, whose exp is float's
// smallest normal. The one exp of the kernels: attention's softmax (rows_attention.cpp) and Token Recycling's
// probabilities (row_top.cpp).
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

}  // namespace splitinfer
