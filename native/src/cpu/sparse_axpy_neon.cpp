// aarch64 NEON kernels for the column-sparse down projection (contract: kernels.h, axpy_fn).
// One neuron per pass, 4 lanes at a time; vfmaq_f32 is a fused multiply-add like the scalar
// reference's std::fma, so the bits equal the reference. (Written for aarch64; not run on x86 CI.)
#include <arm_neon.h>

#include <cmath>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

void axpy_f32_neon(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const float* x = (const float*)((const uint8_t*)w[i] + off);
        const float32x4_t s = vdupq_n_f32(a[i]);
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) vst1q_f32(y + r, vfmaq_f32(vld1q_f32(y + r), s, vld1q_f32(x + r)));
        for (; r < n; r++) y[r] = std::fma(a[i], x[r], y[r]);
    }
}

void axpy_f16_neon(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const fp16_t* x = (const fp16_t*)((const uint8_t*)w[i] + off);
        const float32x4_t s = vdupq_n_f32(a[i]);
        int64_t r = 0;
        for (; r + 4 <= n; r += 4) {
            const float32x4_t v = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(x + r)));
            vst1q_f32(y + r, vfmaq_f32(vld1q_f32(y + r), s, v));
        }
        for (; r < n; r++) y[r] = std::fma(a[i], fp16_to_fp32(x[r]), y[r]);
    }
}

void axpy_q8_0_neon(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const block_q8_0* b = (const block_q8_0*)((const uint8_t*)w[i] + off);
        for (int64_t j = 0; j < n / OPTIML_QK8_0; j++) {
            const float32x4_t s = vdupq_n_f32(a[i] * fp16_to_fp32(b[j].d));
            float* yj = y + j * OPTIML_QK8_0;
            for (int h = 0; h < 2; h++) {  // 16 int8 -> 4 x 4 floats
                const int8x16_t q = vld1q_s8(b[j].qs + 16 * h);
                const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
                const int32x4_t v[4] = {vmovl_s16(vget_low_s16(lo)), vmovl_s16(vget_high_s16(lo)),
                                        vmovl_s16(vget_low_s16(hi)), vmovl_s16(vget_high_s16(hi))};
                for (int c = 0; c < 4; c++) {
                    float* p = yj + 16 * h + 4 * c;
                    vst1q_f32(p, vfmaq_f32(vld1q_f32(p), s, vcvtq_f32_s32(v[c])));
                }
            }
        }
    }
}

}  // namespace

void fill_sparse_neon(KernelTable& t) {
    t.axpy[TYPE_F32] = axpy_f32_neon;
    t.axpy[TYPE_F16] = axpy_f16_neon;
    t.axpy[TYPE_Q8_0] = axpy_q8_0_neon;
}

}  // namespace optiml
