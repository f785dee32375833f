// aarch64 NEON kernels. Int8 dots use vdotq_s32 when the CPU build has dot-product instructions
// (__ARM_FEATURE_DOTPROD), else widening multiplies (vmull_s8 + pairwise accumulate); both give the
// exact integer block sums, so results differ from scalar only by float summation order.
// Activation conversions are bit-identical to the scalar reference (vrndaq = roundf, vrndnq =
// nearbyintf, fp16 scales through the same fp32_to_fp16).
#include <arm_neon.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

inline float h2f(fp16_t h) { return fp16_to_fp32(h); }

// acc += 4-wide sums of a*b (int8 x int8 -> int32).
inline int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// ---- float types -----------------------------------------------------------------------------
void vec_dot_f32(int64_t n, float* s, const void* w, const void* x) {
    const float* a = (const float*)w;
    const float* b = (const float*)x;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
        acc1 = vfmaq_f32(acc1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
        acc2 = vfmaq_f32(acc2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
        acc3 = vfmaq_f32(acc3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
    }
    for (; i + 4 <= n; i += 4) acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3)));
    for (; i < n; i++) sum += a[i] * b[i];
    *s = sum;
}

inline float32x4_t load_f16x4(const fp16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

void vec_dot_f16(int64_t n, float* s, const void* w, const void* x) {
    const fp16_t* a = (const fp16_t*)w;
    const fp16_t* b = (const fp16_t*)x;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = vfmaq_f32(acc0, load_f16x4(a + i), load_f16x4(b + i));
        acc1 = vfmaq_f32(acc1, load_f16x4(a + i + 4), load_f16x4(b + i + 4));
        acc2 = vfmaq_f32(acc2, load_f16x4(a + i + 8), load_f16x4(b + i + 8));
        acc3 = vfmaq_f32(acc3, load_f16x4(a + i + 12), load_f16x4(b + i + 12));
    }
    for (; i + 4 <= n; i += 4) acc0 = vfmaq_f32(acc0, load_f16x4(a + i), load_f16x4(b + i));
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3)));
    for (; i < n; i++) sum += h2f(a[i]) * h2f(b[i]);
    *s = sum;
}

// ---- 32-element block quants -------------------------------------------------------------------
void vec_dot_q8_0(int64_t n, float* s, const void* w, const void* x) {
    const block_q8_0* a = (const block_q8_0*)w;
    const block_q8_0* b = (const block_q8_0*)x;
    const int64_t nb = n / 32;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        int32x4_t p0 = dot_s8(vdupq_n_s32(0), vld1q_s8(a[i].qs), vld1q_s8(b[i].qs));
        p0 = dot_s8(p0, vld1q_s8(a[i].qs + 16), vld1q_s8(b[i].qs + 16));
        int32x4_t p1 = dot_s8(vdupq_n_s32(0), vld1q_s8(a[i + 1].qs), vld1q_s8(b[i + 1].qs));
        p1 = dot_s8(p1, vld1q_s8(a[i + 1].qs + 16), vld1q_s8(b[i + 1].qs + 16));
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), h2f(a[i].d) * h2f(b[i].d));
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(p1), h2f(a[i + 1].d) * h2f(b[i + 1].d));
    }
    for (; i < nb; i++) {
        int32x4_t p0 = dot_s8(vdupq_n_s32(0), vld1q_s8(a[i].qs), vld1q_s8(b[i].qs));
        p0 = dot_s8(p0, vld1q_s8(a[i].qs + 16), vld1q_s8(b[i].qs + 16));
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), h2f(a[i].d) * h2f(b[i].d));
    }
    *s = vaddvq_f32(vaddq_f32(acc0, acc1));
}

// Low nibbles are elements 0..15, high nibbles 16..31; `off` is subtracted (8 for Q4_0, 0 for Q4_1).
inline int32x4_t q4_block_dot(const uint8_t* qs, const int8_t* q8, int8x16_t off) {
    const uint8x16_t v = vld1q_u8(qs);
    const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), off);
    const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), off);
    return dot_s8(dot_s8(vdupq_n_s32(0), lo, vld1q_s8(q8)), hi, vld1q_s8(q8 + 16));
}

void vec_dot_q4_0(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_0* a = (const block_q4_0*)w;
    const block_q8_0* b = (const block_q8_0*)x;
    const int64_t nb = n / 32;
    const int8x16_t off = vdupq_n_s8(8);
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const int32x4_t p0 = q4_block_dot(a[i].qs, b[i].qs, off);
        const int32x4_t p1 = q4_block_dot(a[i + 1].qs, b[i + 1].qs, off);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), h2f(a[i].d) * h2f(b[i].d));
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(p1), h2f(a[i + 1].d) * h2f(b[i + 1].d));
    }
    for (; i < nb; i++)
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(q4_block_dot(a[i].qs, b[i].qs, off)), h2f(a[i].d) * h2f(b[i].d));
    *s = vaddvq_f32(vaddq_f32(acc0, acc1));
}

// Q4_1: d_w*d_x*sum(q_w*q_x) + m_w*s_x.
void vec_dot_q4_1(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_1* a = (const block_q4_1*)w;
    const block_q8_1* b = (const block_q8_1*)x;
    const int64_t nb = n / 32;
    const int8x16_t off = vdupq_n_s8(0);
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0;
    float summs = 0;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const int32x4_t p0 = q4_block_dot(a[i].qs, b[i].qs, off);
        const int32x4_t p1 = q4_block_dot(a[i + 1].qs, b[i + 1].qs, off);
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(p0), h2f(a[i].d) * h2f(b[i].d));
        acc1 = vfmaq_n_f32(acc1, vcvtq_f32_s32(p1), h2f(a[i + 1].d) * h2f(b[i + 1].d));
        summs += h2f(a[i].m) * h2f(b[i].s) + h2f(a[i + 1].m) * h2f(b[i + 1].s);
    }
    for (; i < nb; i++) {
        acc0 = vfmaq_n_f32(acc0, vcvtq_f32_s32(q4_block_dot(a[i].qs, b[i].qs, off)), h2f(a[i].d) * h2f(b[i].d));
        summs += h2f(a[i].m) * h2f(b[i].s);
    }
    *s = vaddvq_f32(vaddq_f32(acc0, acc1)) + summs;
}

// ---- k-quants ----------------------------------------------------------------------------------
inline void unpack_scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        mn[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

inline int mins_dot_bsums(const uint8_t* mn, const int16_t* bsums) {
    int s = 0;
    for (int j = 0; j < 8; j++) s += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return s;
}

// Dot of 32 unsigned-but-small q bytes (as two 16-byte vectors) with 32 q8 values.
inline int dot32(int8x16_t q0, int8x16_t q1, const int8_t* q8) {
    return vaddvq_s32(dot_s8(dot_s8(vdupq_n_s32(0), q0, vld1q_s8(q8)), q1, vld1q_s8(q8 + 16)));
}

void vec_dot_q4_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_K* a = (const block_q4_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t sc[8], mn[8];
        unpack_scales_mins_k4(a[i].scales, sc, mn);
        const float d = b[i].d * h2f(a[i].d);
        const float dmin = b[i].d * h2f(a[i].dmin);
        int isum = 0;
        for (int j = 0; j < 4; j++) {
            const uint8x16_t v0 = vld1q_u8(a[i].qs + 32 * j), v1 = vld1q_u8(a[i].qs + 32 * j + 16);
            const int8_t* q8 = b[i].qs + 64 * j;
            isum += sc[2 * j] * dot32(vreinterpretq_s8_u8(vandq_u8(v0, m4)), vreinterpretq_s8_u8(vandq_u8(v1, m4)), q8);
            isum += sc[2 * j + 1] * dot32(vreinterpretq_s8_u8(vshrq_n_u8(v0, 4)), vreinterpretq_s8_u8(vshrq_n_u8(v1, 4)), q8 + 32);
        }
        sum += d * (float)isum - dmin * (float)mins_dot_bsums(mn, b[i].bsums);
    }
    *s = sum;
}

void vec_dot_q5_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q5_K* a = (const block_q5_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t sc[8], mn[8];
        unpack_scales_mins_k4(a[i].scales, sc, mn);
        const float d = b[i].d * h2f(a[i].d);
        const float dmin = b[i].d * h2f(a[i].dmin);
        // qh byte l carries the fifth bit of element l of sub-block j in bit j.
        uint8x16_t h0 = vld1q_u8(a[i].qh), h1 = vld1q_u8(a[i].qh + 16);
        int isum = 0;
        for (int j = 0; j < 4; j++) {
            const uint8x16_t v0 = vld1q_u8(a[i].qs + 32 * j), v1 = vld1q_u8(a[i].qs + 32 * j + 16);
            const int8_t* q8 = b[i].qs + 64 * j;
            const uint8x16_t lo0 = vorrq_u8(vandq_u8(v0, m4), vshlq_n_u8(vandq_u8(h0, one), 4));
            const uint8x16_t lo1 = vorrq_u8(vandq_u8(v1, m4), vshlq_n_u8(vandq_u8(h1, one), 4));
            const uint8x16_t hi0 = vorrq_u8(vshrq_n_u8(v0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h0, 1), one), 4));
            const uint8x16_t hi1 = vorrq_u8(vshrq_n_u8(v1, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h1, 1), one), 4));
            h0 = vshrq_n_u8(h0, 2);
            h1 = vshrq_n_u8(h1, 2);
            isum += sc[2 * j] * dot32(vreinterpretq_s8_u8(lo0), vreinterpretq_s8_u8(lo1), q8);
            isum += sc[2 * j + 1] * dot32(vreinterpretq_s8_u8(hi0), vreinterpretq_s8_u8(hi1), q8 + 32);
        }
        sum += d * (float)isum - dmin * (float)mins_dot_bsums(mn, b[i].bsums);
    }
    *s = sum;
}

// Q6_K: q in 0..63 (value q - 32), one signed scale per 16 elements; the -32 goes through bsums.
void vec_dot_q6_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q6_K* a = (const block_q6_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = b[i].d * h2f(a[i].d);
        const int8_t* sc = a[i].scales;
        int offs = 0;
        for (int g = 0; g < 16; g++) offs += sc[g] * b[i].bsums[g];
        int isum = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t* ql = a[i].ql + 64 * h;
            const uint8_t* qh = a[i].qh + 32 * h;
            const int8_t* q8 = b[i].qs + 128 * h;
            const int8_t* s8 = sc + 8 * h;
            for (int c = 0; c < 2; c++) {  // 16 elements per vector, each a scale group of its own
                const uint8x16_t l0 = vld1q_u8(ql + 16 * c), l1 = vld1q_u8(ql + 32 + 16 * c);
                const uint8x16_t hb = vld1q_u8(qh + 16 * c);
                const uint8x16_t q0 = vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4));
                const uint8x16_t q1 = vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4));
                const uint8x16_t q2 = vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4));
                const uint8x16_t q3 = vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4));
                const int8_t* xc = q8 + 16 * c;
                isum += s8[c + 0] * vaddvq_s32(dot_s8(vdupq_n_s32(0), vreinterpretq_s8_u8(q0), vld1q_s8(xc)));
                isum += s8[c + 2] * vaddvq_s32(dot_s8(vdupq_n_s32(0), vreinterpretq_s8_u8(q1), vld1q_s8(xc + 32)));
                isum += s8[c + 4] * vaddvq_s32(dot_s8(vdupq_n_s32(0), vreinterpretq_s8_u8(q2), vld1q_s8(xc + 64)));
                isum += s8[c + 6] * vaddvq_s32(dot_s8(vdupq_n_s32(0), vreinterpretq_s8_u8(q3), vld1q_s8(xc + 96)));
            }
        }
        sum += d * (float)(isum - 32 * offs);
    }
    *s = sum;
}

// ---- activation conversion -----------------------------------------------------------------------
// One 32-block of activations as the scalar activation_row_q8_0: id = 127/amax, ties to even (vcvtnq).
inline float quantize_block_q8(const float* x, int8_t* qs, int* qsum) {
    float32x4_t v[8];
    float32x4_t mx = vdupq_n_f32(0);
    for (int k = 0; k < 8; k++) {
        v[k] = vld1q_f32(x + 4 * k);
        mx = vmaxq_f32(mx, vabsq_f32(v[k]));
    }
    const float amax = vmaxvq_f32(mx);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32x4_t sum = vdupq_n_s32(0);
    for (int k = 0; k < 8; k += 2) {
        const int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(v[k], id));
        const int32x4_t i1 = vcvtnq_s32_f32(vmulq_n_f32(v[k + 1], id));
        sum = vaddq_s32(sum, vaddq_s32(i0, i1));
        const int16x8_t s16 = vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1));
        vst1_s8(qs + 4 * k, vqmovn_s16(s16));
    }
    if (qsum) *qsum = vaddvq_s32(sum);
    return d;
}

void from_float_q8_0(const float* x, void* y, int64_t n) {
    block_q8_0* out = (block_q8_0*)y;
    for (int64_t i = 0; i < n / 32; i++) out[i].d = fp32_to_fp16(quantize_block_q8(x + 32 * i, out[i].qs, nullptr));
}

void from_float_q8_1(const float* x, void* y, int64_t n) {
    block_q8_1* out = (block_q8_1*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        int qsum;
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, &qsum);
        out[i].d = fp32_to_fp16(d);
        out[i].s = fp32_to_fp16(d * (float)qsum);
    }
}

// Q8_K: scale from the first element of largest magnitude; q = nearbyint (vrndnq), clamped to 127.
void from_float_q8_K(const float* x, void* y, int64_t n) {
    block_q8_K* out = (block_q8_K*)y;
    for (int64_t i = 0; i < n / OPTIML_QK_K; i++) {
        const float* xb = x + OPTIML_QK_K * i;
        float32x4_t mx = vdupq_n_f32(0);
        for (int k = 0; k < OPTIML_QK_K; k += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + k)));
        const float amax = vmaxvq_f32(mx);
        if (amax == 0.0f) {
            std::memset(&out[i], 0, sizeof(block_q8_K));
            continue;
        }
        float max = 0;
        for (int k = 0; k < OPTIML_QK_K; k++)
            if (std::fabs(xb[k]) == amax) { max = xb[k]; break; }
        const float iscale = -127.f / max;
        const int32x4_t lim = vdupq_n_s32(127);
        for (int k = 0; k < OPTIML_QK_K; k += 16) {
            int32x4_t q[4];
            for (int t = 0; t < 4; t++)
                q[t] = vminq_s32(vcvtq_s32_f32(vrndnq_f32(vmulq_n_f32(vld1q_f32(xb + k + 4 * t), iscale))), lim);
            const int16x8_t a16 = vcombine_s16(vqmovn_s32(q[0]), vqmovn_s32(q[1]));
            const int16x8_t b16 = vcombine_s16(vqmovn_s32(q[2]), vqmovn_s32(q[3]));
            vst1q_s8(out[i].qs + k, vcombine_s8(vqmovn_s16(a16), vqmovn_s16(b16)));
            out[i].bsums[k / 16] = (int16_t)(vaddvq_s16(a16) + vaddvq_s16(b16));
        }
        out[i].d = 1 / iscale;
    }
}

}  // namespace

void fill_kernels_neon(KernelTable& t) {
    t.vec_dot[TYPE_F32] = vec_dot_f32;
    t.vec_dot[TYPE_F16] = vec_dot_f16;
    t.vec_dot[TYPE_Q4_0] = vec_dot_q4_0;
    t.vec_dot[TYPE_Q4_1] = vec_dot_q4_1;
    t.vec_dot[TYPE_Q8_0] = vec_dot_q8_0;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K;
    t.from_float[TYPE_Q8_0] = from_float_q8_0;
    t.from_float[TYPE_Q8_1] = from_float_q8_1;
    t.from_float[TYPE_Q8_K] = from_float_q8_K;
}

}  // namespace optiml
