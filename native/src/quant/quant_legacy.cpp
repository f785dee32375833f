// The 32-element block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (weights) and Q8_1 (activations).
//
// Quantization reproduces gguf-py's numpy code (which itself mirrors llama.cpp's *_ref functions)
// operation by operation in float32, so the bytes are identical: the same scale formula, the same
// reciprocal, products rounded before the offset is added (fp_barrier), truncation for the 4/5-bit
// codes and round-half-away-from-zero for the 8-bit ones.
#include "quant_impl.h"

namespace optiml {
namespace quant {

namespace {

// The value of largest magnitude in x[0..n), keeping its sign; the first one wins ties.
inline float signed_absmax(const float* x, int n) {
    // Starting from x[0] (not 0.0f) keeps the sign of a zero block's first element, as numpy's
    // argmax does: d = -0.0/-8 = +0.0 and the stored fp16 bytes then match gguf-py.
    float amax = std::fabs(x[0]), max = x[0];
    for (int j = 1; j < n; j++) {
        if (std::fabs(x[j]) > amax) {
            amax = std::fabs(x[j]);
            max = x[j];
        }
    }
    return max;
}

inline void min_max(const float* x, int n, float* mn, float* mx) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

// trunc(t) clipped to [0, hi]; NaN (from a non-finite block) becomes 0 instead of undefined behaviour.
inline uint8_t trunc_code(float t, int hi) {
    if (!(t >= 0.0f)) return 0;
    if (t >= (float)hi) return (uint8_t)hi;
    return (uint8_t)(int)t;
}

// Q8_0/Q8_1 codes: d = amax/127, q = round-half-away(x/d). Returns d (float32, before fp16).
inline float q8_codes(const float* x, int8_t* qs) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) qs[j] = (int8_t)std::round(x[j] * id);
    return d;
}

}  // namespace

void quantize_row_q4_0(const float* x, void* vy, int64_t n) {
    block_q4_0* y = (block_q4_0*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        // d maps the signed extreme to code 0 (value -8*d): one more negative level is used.
        const float d = signed_absmax(x, 32) / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < 16; j++) {
            const uint8_t q0 = trunc_code(fp_barrier(x[j] * id) + 8.5f, 15);
            const uint8_t q1 = trunc_code(fp_barrier(x[j + 16] * id) + 8.5f, 15);
            y[i].qs[j] = q0 | (uint8_t)(q1 << 4);
        }
    }
}

void quantize_row_q4_1(const float* x, void* vy, int64_t n) {
    block_q4_1* y = (block_q4_1*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float mn, mx;
        min_max(x, 32, &mn, &mx);
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(mn);
        for (int j = 0; j < 16; j++) {
            const uint8_t q0 = trunc_code(fp_barrier((x[j] - mn) * id) + 0.5f, 15);
            const uint8_t q1 = trunc_code(fp_barrier((x[j + 16] - mn) * id) + 0.5f, 15);
            y[i].qs[j] = q0 | (uint8_t)(q1 << 4);
        }
    }
}

void quantize_row_q5_0(const float* x, void* vy, int64_t n) {
    block_q5_0* y = (block_q5_0*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        const float d = signed_absmax(x, 32) / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t q0 = trunc_code(fp_barrier(x[j] * id) + 16.5f, 31);
            const uint8_t q1 = trunc_code(fp_barrier(x[j + 16] * id) + 16.5f, 31);
            y[i].qs[j] = (q0 & 0x0F) | (uint8_t)((q1 & 0x0F) << 4);
            qh |= (uint32_t)(q0 >> 4) << j;  // bit 4 of element j goes to bit j of qh
            qh |= (uint32_t)(q1 >> 4) << (j + 16);
        }
        std::memcpy(y[i].qh, &qh, 4);
    }
}

void quantize_row_q5_1(const float* x, void* vy, int64_t n) {
    block_q5_1* y = (block_q5_1*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float mn, mx;
        min_max(x, 32, &mn, &mx);
        const float d = (mx - mn) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(mn);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            const uint8_t q0 = trunc_code(fp_barrier((x[j] - mn) * id) + 0.5f, 31);
            const uint8_t q1 = trunc_code(fp_barrier((x[j + 16] - mn) * id) + 0.5f, 31);
            y[i].qs[j] = (q0 & 0x0F) | (uint8_t)((q1 & 0x0F) << 4);
            qh |= (uint32_t)(q0 >> 4) << j;
            qh |= (uint32_t)(q1 >> 4) << (j + 16);
        }
        std::memcpy(y[i].qh, &qh, 4);
    }
}

void quantize_row_q8_0(const float* x, void* vy, int64_t n) {
    block_q8_0* y = (block_q8_0*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) y[i].d = fp32_to_fp16(q8_codes(x, y[i].qs));
}

// Q8_1 with a given code rule: Q8_0's codes plus s = d * sum(q) (the float32 d, as llama.cpp does).
template <float (*codes)(const float*, int8_t*)>
void q8_1_row(const float* x, void* vy, int64_t n) {
    block_q8_1* y = (block_q8_1*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        const float d = codes(x, y[i].qs);
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += y[i].qs[j];
        y[i].d = fp32_to_fp16(d);
        y[i].s = fp32_to_fp16(d * (float)sum);
    }
}

void quantize_row_q8_1(const float* x, void* vy, int64_t n) { q8_1_row<q8_codes>(x, vy, n); }

// Activations (the vec_dot types of Q4_0..Q8_0) are converted the way llama.cpp's x86 runtime does,
// not like the reference above: id = 127/amax and ties to even. Activation rounding decides close
// calls downstream, and llama.cpp's text is the yardstick.
inline float q8_activation_codes(const float* x, int8_t* qs) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(x[j]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) qs[j] = (int8_t)std::nearbyint(x[j] * id);
    return amax / 127.0f;
}

void activation_row_q8_0(const float* x, void* vy, int64_t n) {
    block_q8_0* y = (block_q8_0*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) y[i].d = fp32_to_fp16(q8_activation_codes(x, y[i].qs));
}

void activation_row_q8_1(const float* x, void* vy, int64_t n) { q8_1_row<q8_activation_codes>(x, vy, n); }

// Dequantization: every product below is exact in float32 (an 11-bit fp16 mantissa times a code
// of at most 6 bits), so the only rounding is the final "+ m" and the result is bit-identical to
// gguf-py and ggml whatever the order of evaluation.

void dequantize_row_q4_0(const void* vx, float* y, int64_t n) {
    const block_q4_0* x = (const block_q4_0*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((x[i].qs[j] & 0x0F) - 8) * d;
            y[j + 16] = (float)((x[i].qs[j] >> 4) - 8) * d;
        }
    }
}

void dequantize_row_q4_1(const void* vx, float* y, int64_t n) {
    const block_q4_1* x = (const block_q4_1*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(x[i].qs[j] & 0x0F) + m;
            y[j + 16] = d * (float)(x[i].qs[j] >> 4) + m;
        }
    }
}

void dequantize_row_q5_0(const void* vx, float* y, int64_t n) {
    const block_q5_0* x = (const block_q5_0*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        uint32_t qh;
        std::memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            const int q0 = (x[i].qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int q1 = (x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = (float)(q0 - 16) * d;
            y[j + 16] = (float)(q1 - 16) * d;
        }
    }
}

void dequantize_row_q5_1(const void* vx, float* y, int64_t n) {
    const block_q5_1* x = (const block_q5_1*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
        uint32_t qh;
        std::memcpy(&qh, x[i].qh, 4);
        for (int j = 0; j < 16; j++) {
            const int q0 = (x[i].qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int q1 = (x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (float)q0 + m;
            y[j + 16] = d * (float)q1 + m;
        }
    }
}

void dequantize_row_q8_0(const void* vx, float* y, int64_t n) {
    const block_q8_0* x = (const block_q8_0*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)x[i].qs[j] * d;
    }
}

void dequantize_row_q8_1(const void* vx, float* y, int64_t n) {
    const block_q8_1* x = (const block_q8_1*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 32; j++) y[j] = (float)x[i].qs[j] * d;
    }
}

}  // namespace quant
}  // namespace optiml
