// aarch64 NEON kernels for the column-sparse down projection (contract: kernels.h, axpy_fn). Up to
// four neurons per pass over y: y is loaded and stored once per four rows read, and each element
// still gets one fused multiply-add (vfmaq_f32, like the reference's std::fma) per neuron in list
// order, so the bits equal the scalar reference.
#include <arm_neon.h>

#include <cmath>
#include <cstring>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

inline float h2f(fp16_t h) {
    __fp16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

// Rows i0 .. i0+3 (fewer at the end of the list) at byte offset off; returns how many.
template <typename T>
inline int rows_at(const void* const* w, size_t off, int64_t i0, int64_t k, const T** x) {
    int c = 0;
    for (; c < 4 && i0 + c < k; c++) x[c] = (const T*)((const uint8_t*)w[i0 + c] + off);
    return c;
}

// One pass of M Q8_0 rows over y (nb blocks); the next pass's rows (n_nxt) are prefetched block by
// block in step: the rows are scattered and each thread reads only its slice of them, too short a
// stream for the hardware prefetcher to get going on its own.
template <int M>
void q8_0_pass(int64_t nb, float* y, const block_q8_0* const* b, const float* a, const block_q8_0* const* nxt,
               int n_nxt) {
    for (int64_t j = 0; j < nb; j++) {
        for (int m = 0; m < n_nxt; m++) __builtin_prefetch(nxt[m] + j, 0, 3);
        float* yj = y + j * OPTIML_QK8_0;
        float32x4_t v[8];
        for (int c = 0; c < 8; c++) v[c] = vld1q_f32(yj + 4 * c);
        for (int m = 0; m < M; m++) {
            const block_q8_0& blk = b[m][j];
            const float s = a[m] * h2f(blk.d);
            for (int h = 0; h < 2; h++) {  // 16 int8 -> 4 x 4 floats
                const int8x16_t q = vld1q_s8(blk.qs + 16 * h);
                const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_high_s8(q);
                float32x4_t* o = v + 4 * h;
                o[0] = vfmaq_n_f32(o[0], vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), s);
                o[1] = vfmaq_n_f32(o[1], vcvtq_f32_s32(vmovl_high_s16(lo)), s);
                o[2] = vfmaq_n_f32(o[2], vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), s);
                o[3] = vfmaq_n_f32(o[3], vcvtq_f32_s32(vmovl_high_s16(hi)), s);
            }
        }
        for (int c = 0; c < 8; c++) vst1q_f32(yj + 4 * c, v[c]);
    }
}

void axpy_q8_0_neon(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const int64_t nb = n / OPTIML_QK8_0;
    const block_q8_0* b[4];
    const block_q8_0* nxt[4];
    int cur = rows_at(w, off, 0, k, b);
    for (int64_t i = 0; i < k; i += 4) {
        const int n_nxt = rows_at(w, off, i + 4, k, nxt);
        switch (cur) {
            case 4: q8_0_pass<4>(nb, y, b, a + i, nxt, n_nxt); break;
            case 3: q8_0_pass<3>(nb, y, b, a + i, nxt, n_nxt); break;
            case 2: q8_0_pass<2>(nb, y, b, a + i, nxt, n_nxt); break;
            default: q8_0_pass<1>(nb, y, b, a + i, nxt, n_nxt); break;
        }
        for (int m = 0; m < n_nxt; m++) b[m] = nxt[m];
        cur = n_nxt;
    }
}

// Float rows: T is float or fp16_t.
inline float32x4_t load4(const float* x) { return vld1q_f32(x); }
inline float32x4_t load4(const fp16_t* x) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x))); }
inline float load1(const float* x) { return *x; }
inline float load1(const fp16_t* x) { return h2f(*x); }

template <typename T, int M>
void float_pass(int64_t n, float* y, const T* const* x, const float* a) {
    int64_t r = 0;
    for (; r + 4 <= n; r += 4) {
        float32x4_t v = vld1q_f32(y + r);
        for (int m = 0; m < M; m++) v = vfmaq_n_f32(v, load4(x[m] + r), a[m]);
        vst1q_f32(y + r, v);
    }
    for (; r < n; r++)  // only at the very end of y (slices are 32-aligned)
        for (int m = 0; m < M; m++) y[r] = std::fma(a[m], load1(x[m] + r), y[r]);
}

template <typename T>
void axpy_float_neon(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const T* x[4];
    for (int64_t i = 0; i < k; i += 4) {
        switch (rows_at(w, off, i, k, x)) {
            case 4: float_pass<T, 4>(n, y, x, a + i); break;
            case 3: float_pass<T, 3>(n, y, x, a + i); break;
            case 2: float_pass<T, 2>(n, y, x, a + i); break;
            default: float_pass<T, 1>(n, y, x, a + i); break;
        }
    }
}

// Grouped rows (kernels.h, axpy_group_fn): 32 dimensions per pass; each row's codes times its int8
// coefficient added into int16 sums by widening multiply-accumulates (vmlal_s8: |q * c| <= 127 * 15,
// so sixteen rows fit an int16, 30480), widened into int32 every sixteen rows. The sums are exact and
// the final float steps the scalar reference's: the bits are the same.
inline float32x4_t scales4(const fp16_t* s) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s))); }
inline float32x4_t scales4(const float* s) { return vld1q_f32(s); }

constexpr int64_t kRowsPerWiden = 16;

template <bool MIN, typename S>
void axpy_one_group_neon(int64_t n, float* y, size_t off, const GroupTerms& g) {
    const void* const* w = g.w;
    const int8_t* q = g.q;
    const int64_t k = g.k;
    const int32_t q_sum = g.q_sum;
    const float s = g.s;
    const S* d = (const S*)g.d;
    const S* m = (const S*)g.m;
    const uint8x16_t mask = vdupq_n_u8(0x0F);
    const int32x4_t centre = vdupq_n_s32(MIN ? 0 : 8 * q_sum);
    const float ms = s * (float)q_sum;
    for (int64_t r0 = 0; r0 < n; r0 += 32) {
        int32x4_t t[8];  // dimensions 4c .. 4c + 3
        for (int c = 0; c < 8; c++) t[c] = vdupq_n_s32(0);
        for (int64_t i0 = 0; i0 < k; i0 += kRowsPerWiden) {
            const int64_t i1 = i0 + kRowsPerWiden < k ? i0 + kRowsPerWiden : k;
            int16x8_t acc[4];  // dimensions 0-7, 8-15, 16-23, 24-31
            for (int c = 0; c < 4; c++) acc[c] = vdupq_n_s16(0);
            for (int64_t i = i0; i < i1; i++) {
                const uint8x16_t raw = vld1q_u8((const uint8_t*)w[i] + off + r0 / 2);
                // Codes 0..15 read as int8 are the same numbers.
                const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, mask));
                const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
                const int8x8_t qi = vdup_n_s8(q[i]);
                acc[0] = vmlal_s8(acc[0], vget_low_s8(lo), qi);
                acc[1] = vmlal_s8(acc[1], vget_high_s8(lo), qi);
                acc[2] = vmlal_s8(acc[2], vget_low_s8(hi), qi);
                acc[3] = vmlal_s8(acc[3], vget_high_s8(hi), qi);
            }
            for (int c = 0; c < 4; c++) {
                t[2 * c] = vaddw_s16(t[2 * c], vget_low_s16(acc[c]));
                t[2 * c + 1] = vaddw_high_s16(t[2 * c + 1], acc[c]);
            }
        }
        const float32x4_t vs = vdupq_n_f32(s);
        for (int c = 0; c < 8; c++) {
            const int64_t r = r0 + 4 * c;
            const float32x4_t v = vcvtq_f32_s32(vsubq_s32(t[c], centre));
            float32x4_t out = vfmaq_f32(vld1q_f32(y + r), vmulq_f32(scales4(d + r), vs), v);
            if (MIN) out = vfmaq_n_f32(out, scales4(m + r), ms);
            vst1q_f32(y + r, out);
        }
    }
}

template <bool MIN, typename S>
void axpy_group_neon(int64_t n, float* y, size_t off, const GroupTerms* groups, int n_groups) {
    for (int g = 0; g < n_groups; g++) axpy_one_group_neon<MIN, S>(n, y, off, groups[g]);
}

}  // namespace

void fill_sparse_neon(KernelTable& t) {
    t.axpy_group[TYPE_Q4_0] = axpy_group_neon<false, fp16_t>;
    t.axpy_group[TYPE_Q4_1] = axpy_group_neon<true, fp16_t>;
    t.axpy_group[TYPE_Q4_K] = axpy_group_neon<true, float>;
    t.axpy[TYPE_F32] = axpy_float_neon<float>;
    t.axpy[TYPE_F16] = axpy_float_neon<fp16_t>;
    t.axpy[TYPE_Q8_0] = axpy_q8_0_neon;
}

}  // namespace optiml
