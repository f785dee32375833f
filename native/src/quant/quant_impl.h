// Internal declarations shared by the scalar block-format code in native/src/quant/.
// One function per format and direction, ggml style: plain loops over the block structs of
// optiml/ggml_types.h. n is always a whole number of blocks (callers check).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optiml/ggml_types.h"

namespace optiml {
namespace quant {

// Returns v unchanged, but the compiler can no longer see where it came from. Used where a product
// must be rounded to float before an addition: without it, a compiler targeting an FMA machine
// (aarch64 always, x86 with -mfma) may fuse `a*b + c` into one rounding, and the bytes would then
// differ from gguf-py's numpy code, which rounds the product first.
static inline float fp_barrier(float v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    __asm__("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    volatile float t = v;
    v = t;
#endif
    return v;
}

// Round to nearest, ties to even (what llama.cpp's nearest_int does with the 1.5*2^23 trick).
// Valid for |v| <= 2^22; the barrier keeps `nearest_int(a*b)` from turning into an FMA.
static inline int nearest_int(float v) {
    float t = fp_barrier(v) + 12582912.f;
    int32_t i;
    std::memcpy(&i, &t, 4);
    return (i & 0x007fffff) - 0x00400000;
}

// 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (12 packed bytes, llama.cpp layout).
static inline void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// Unpacks the 16 signed 6-bit scales of a Q3_K block (stored biased by 32) into sc[0..16).
void q3_K_scales(const uint8_t* packed, int8_t* sc);

// q3_K_scales a 32-bit word at a time, for the SIMD kernels: byte j of aux is scale j, still biased by 32.
// Scale j's low 4 bits are the low (j < 8) or high nibble of byte j % 8, its top 2 bits are bits
// 2 (j / 4), 2 (j / 4) + 1 of byte 8 + j % 4.
static inline void q3_K_scale_bytes(const uint8_t* packed, uint32_t aux[4]) {
    std::memcpy(aux, packed, 12);
    const uint32_t tmp = aux[2];
    const uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
}

// ---- float formats (quant_float.cpp) -------------------------------------------------------
void copy_row_f32(const float* x, void* y, int64_t n);
void quantize_row_f16(const float* x, void* y, int64_t n);
void quantize_row_bf16(const float* x, void* y, int64_t n);
void dequantize_row_f32(const void* x, float* y, int64_t n);
void dequantize_row_f16(const void* x, float* y, int64_t n);
void dequantize_row_bf16(const void* x, float* y, int64_t n);

// ---- 32-element formats (quant_legacy.cpp) -------------------------------------------------
void quantize_row_q4_0(const float* x, void* y, int64_t n);
void quantize_row_q4_1(const float* x, void* y, int64_t n);
void quantize_row_q5_0(const float* x, void* y, int64_t n);
void quantize_row_q5_1(const float* x, void* y, int64_t n);
void quantize_row_q8_0(const float* x, void* y, int64_t n);  // also the Q8_0 activation format
void quantize_row_q8_1(const float* x, void* y, int64_t n);  // the reference rule (roundf, 1/d)
// Activation converters: llama.cpp x86 runtime rule (id = 127/amax, ties to even).
void activation_row_q8_0(const float* x, void* y, int64_t n);
void activation_row_q8_1(const float* x, void* y, int64_t n);
void dequantize_row_q4_0(const void* x, float* y, int64_t n);
void dequantize_row_q4_1(const void* x, float* y, int64_t n);
void dequantize_row_q5_0(const void* x, float* y, int64_t n);
void dequantize_row_q5_1(const void* x, float* y, int64_t n);
void dequantize_row_q8_0(const void* x, float* y, int64_t n);
void dequantize_row_q8_1(const void* x, float* y, int64_t n);

// ---- MXFP4 (quant_mxfp4.cpp) ----------------------------------------------------------------
void quantize_row_mxfp4(const float* x, void* y, int64_t n);
void dequantize_row_mxfp4(const void* x, float* y, int64_t n);

// ---- IQ4_NL, IQ4_XS (quant_iq4.cpp) ----------------------------------------------------------------------
void dequantize_row_iq4_nl(const void* x, float* y, int64_t n);
void dequantize_row_iq4_xs(const void* x, float* y, int64_t n);
void quantize_row_iq4_nl(const float* x, void* y, int64_t n);
void quantize_row_iq4_xs(const float* x, void* y, int64_t n);

// ---- 256-element k-quants (quant_kquants.cpp) ----------------------------------------------
void quantize_row_q2_K(const float* x, void* y, int64_t n);
void quantize_row_q3_K(const float* x, void* y, int64_t n);
void quantize_row_q4_K(const float* x, void* y, int64_t n);
void quantize_row_q5_K(const float* x, void* y, int64_t n);
void quantize_row_q6_K(const float* x, void* y, int64_t n);
void quantize_row_q8_K(const float* x, void* y, int64_t n);  // activations for the k-quants
void dequantize_row_q2_K(const void* x, float* y, int64_t n);
void dequantize_row_q3_K(const void* x, float* y, int64_t n);
void dequantize_row_q4_K(const void* x, float* y, int64_t n);
void dequantize_row_q5_K(const void* x, float* y, int64_t n);
void dequantize_row_q6_K(const void* x, float* y, int64_t n);
void dequantize_row_q8_K(const void* x, float* y, int64_t n);

}  // namespace quant
}  // namespace optiml
