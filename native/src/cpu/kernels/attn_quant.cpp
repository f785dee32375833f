// Attention over a quantized KV cache (Q8_0, Q4_0): the reference kernels, and the helpers attention.cpp
// calls. Keys are rows like any weight row, so their dots with the query (converted to Q8_0) are the
// matmul's vec_dot; values are rows too (a block spans 32 dimensions of one position, see KVLayerView),
// so their weighted sum adds dequantized rows: attn_mad.
#include <algorithm>
#include <cmath>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

// y[d] = sum_r w[r] * row_r[d]: per block one scale w[r] * d, then a multiply-add per value. Rows of
// weight 0 (masked positions) are skipped: their values may be anything a truncated sequence left.
void attn_mad_q8_0_scalar(int64_t n, float* y, const void* rows, size_t stride, const float* w, int64_t n_rows) {
    for (int64_t i = 0; i < n; i++) y[i] = 0.0f;
    const uint8_t* base = (const uint8_t*)rows;
    for (int64_t r = 0; r < n_rows; r++) {
        if (w[r] == 0.0f) continue;
        const block_q8_0* x = (const block_q8_0*)(base + (size_t)r * stride);
        for (int64_t b = 0; b < n / 32; b++) {
            const float s = w[r] * fp16_to_fp32(x[b].d);
            for (int j = 0; j < 32; j++) y[b * 32 + j] += s * (float)x[b].qs[j];
        }
    }
}

void attn_mad_q4_0_scalar(int64_t n, float* y, const void* rows, size_t stride, const float* w, int64_t n_rows) {
    for (int64_t i = 0; i < n; i++) y[i] = 0.0f;
    const uint8_t* base = (const uint8_t*)rows;
    for (int64_t r = 0; r < n_rows; r++) {
        if (w[r] == 0.0f) continue;
        const block_q4_0* x = (const block_q4_0*)(base + (size_t)r * stride);
        for (int64_t b = 0; b < n / 32; b++) {
            const float s = w[r] * fp16_to_fp32(x[b].d);
            for (int j = 0; j < 16; j++) {  // ggml's order: low nibbles are values 0..15, high ones 16..31
                y[b * 32 + j] += s * (float)((x[b].qs[j] & 0x0F) - 8);
                y[b * 32 + j + 16] += s * (float)((x[b].qs[j] >> 4) - 8);
            }
        }
    }
}

// Q4_0 has no activation conversion in the tables (it is a weight type); its reference quantization is
// llama.cpp's quantize_row_q4_0_ref, which is what llama.cpp's CPU writes into a q4_0 cache.
void q4_0_from_float(const float* x, void* y, int64_t n) { quantize_row(TYPE_Q4_0, x, y, n); }

}  // namespace

from_float_fn kv_from_float(const KernelTable& kt, int32_t type) {
    if (type == TYPE_Q4_0) return q4_0_from_float;
    return kt.from_float[type];  // F16, F32 and Q8_0 (llama.cpp's CPU quantize_row_q8_0: as activations)
}

void kv_quant_dots(const KernelTable& kt, int32_t type, int64_t n, float* s, const void* rows, size_t stride,
                   const void* y, int64_t n_rows, const void** ptrs) {
    const uint8_t* base = (const uint8_t*)rows;
    if (kt.vec_dot_rows[type] && n_rows > 0) {
        // The many-row kernel shares the query's blocks across rows; it prefetches kRowsAhead pointers past
        // the end, which repeat the last row.
        for (int64_t r = 0; r < n_rows + kRowsAhead; r++)
            ptrs[r] = base + (size_t)std::min<int64_t>(r, n_rows - 1) * stride;
        kt.vec_dot_rows[type](n, s, ptrs, y, n_rows);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) kt.vec_dot[type](n, &s[r], base + (size_t)r * stride, y);
}

int64_t kv_rotation_block(int32_t type, int64_t head_dim, bool values) {
    if (type != TYPE_Q8_0 && type != TYPE_Q4_0) return 0;
    if (head_dim % 64) return 0;
    if (values) return 64;  // llama.cpp rotates values in 64-wide stripes (smaller seemed better for V)
    int64_t b = 64;
    while (head_dim % (2 * b) == 0) b *= 2;
    return b;
}

void kv_rotate(float* x, int64_t n, int64_t block) {
    const float norm = 1.0f / std::sqrt((float)block);
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        float* v = x + b0;
        // The fast Walsh-Hadamard transform: log2(block) rounds of butterflies, Sylvester's order (the
        // matrix ggml_gen_hadamard builds), then 1/sqrt(block): orthonormal and its own inverse.
        for (int64_t h = 1; h < block; h *= 2)
            for (int64_t i = 0; i < block; i += 2 * h)
                for (int64_t j = i; j < i + h; j++) {
                    const float a = v[j], c = v[j + h];
                    v[j] = a + c;
                    v[j + h] = a - c;
                }
        for (int64_t j = 0; j < block; j++) v[j] *= norm;
    }
}

void fill_attn_quant_scalar(KernelTable& t) {
    t.attn_mad[TYPE_Q8_0] = attn_mad_q8_0_scalar;
    t.attn_mad[TYPE_Q4_0] = attn_mad_q4_0_scalar;
}

}  // namespace optiml
