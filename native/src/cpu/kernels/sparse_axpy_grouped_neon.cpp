// aarch64 NEON kernels for grouped neuron-major rows (contract: kernels.h, axpy_group_fn): 32 dimensions
// per pass; each row's codes times its int8 coefficient added into int16 sums by widening
// multiply-accumulates (vmlal_s8: |q * c| <= 127 * 15, so sixteen rows fit an int16, 30480), widened into
// int32 every sixteen rows. The sums are exact and the final float steps the scalar reference's: the
// bits are the same.
#include "optiml/sparse.h"
#include "simd_neon.h"
#include "sparse_axpy_grouped_simd.h"

namespace optiml {
namespace {

constexpr int64_t kRowsPerWiden = 16;

template <bool MIN, typename S>
void one_group(int64_t n, float* y, size_t off, const GroupTerms& g, const GroupTerms*, int) {
    const void* const* w = g.w;
    const int8_t* q = g.q;
    const int64_t k = g.k;
    const int32_t q_sum = g.q_sum;
    const float s = g.s;
    const S* d = (const S*)g.d;
    const S* m = (const S*)g.m;
    const uint8x16_t mask = vdupq_n_u8(0x0F);
    const int32x4_t centre = vdupq_n_s32(MIN ? 0 : 8 * q_sum);
    const float32x4_t vs = vdupq_n_f32(s), vms = vdupq_n_f32(s * (float)q_sum);
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
        for (int c = 0; c < 8; c++) {
            const int64_t r = r0 + 4 * c;
            group_scale_into<F32x4, MIN, S>(y + r, t[c], d + r, MIN ? m + r : nullptr, centre, vs, vms);
        }
    }
}

}  // namespace

void fill_sparse_grouped_neon(KernelTable& t) {
    fill_axpy_group<one_group<false, fp16_t>, one_group<true, fp16_t>, one_group<true, float>>(t);
}

}  // namespace optiml
