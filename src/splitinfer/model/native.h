// What splitinfer's CPU kernels share (model/native.py builds them into one library): each .cpp file defines
// its op and the raw loop behind it; decoder_layer.cpp composes the loops into one call a decoder layer.
#pragma once

#include <cstdint>

namespace splitinfer {

// w4a8.cpp: x [M, K] float32 times a packed int4 weight [N / 16, K / 32, 320] -> y [M, n] float32.
void w4a8_product(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t n, float* y);

// w8a8.cpp: rows of x [M, K] (times smooth [K], where not null) quantized as model/formats.py's quantize_rows
// (scale[m] = max|x_m| / 127, at least FLT_MIN; round(x / scale) half to even), stored + 128 as bytes in a.
void quantize_rows_int8(const float* x, int64_t M, int64_t K, const float* smooth, uint8_t* a, float* scale);
constexpr int64_t W8A8_ROWS = 8;  // w8a8_product reads its rows in blocks of this many
// The rows w8a8_product's input holds for M real ones: M rounded up to whole blocks.
constexpr int64_t w8a8_padded_rows(int64_t M) { return (M + W8A8_ROWS - 1) / W8A8_ROWS * W8A8_ROWS; }
// w8a8.cpp: a [M rounded up to W8A8_ROWS, K] (quantize_rows_int8's bytes; padding rows 128) times a packed int8 weight
// [N / 64 rounded up, K / 4, 256] -> y [M, N] = float(sum) * scale[n] (* sx[m] where not null). prefetch > 0: a
// pass of up to four rows asks for the weight that many bytes ahead with prefetcht0 (scripts/bench_w8a8_stream.py).
void w8a8_product(const uint8_t* a, int64_t M, int64_t K, const int8_t* packed, const int32_t* sums, const float* scale,
                  const float* sx, int64_t N, float* y, int64_t prefetch = 0);
// w8a8.cpp: x [M, K] float32 rows (times smooth where not null) quantized per row, then their w8a8_product with the row
// scales applied: Int8Linear's product without its bias.
void w8a8_rows(const float* x, int64_t M, int64_t K, const float* smooth, const int8_t* packed, const int32_t* sums,
               const float* scale, int64_t N, float* y);

// rms_norm.cpp: rows of x [rows, dim] -> y = weight * (x / sqrt(mean(x^2) + eps)), one row at a time.
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

}  // namespace splitinfer
