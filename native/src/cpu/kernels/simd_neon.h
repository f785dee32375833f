// aarch64 NEON building blocks: the float vector type F32x4, the twin of simd_x86.h's F32x8 and F32x16,
// that the kernels written once for every instruction set (simd_ops.h, sparse_axpy_simd.h) are
// instantiated with, and the scalar fp16 conversion.
#pragma once

#pragma GCC diagnostic ignored "-Wunused-function"

#include <arm_neon.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

// fp16 -> fp32 by the hardware conversion (exact, like fp16_to_fp32).
inline float h2f(fp16_t h) {
    __fp16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

struct F32x4 {
    typedef float32x4_t V;
    typedef uint32x4_t M;  // all-ones lanes where a comparison holds
    typedef int32x4_t VI;  // N int32
    static constexpr int N = 4;
    static V zero() { return vdupq_n_f32(0.0f); }
    static V set1(float x) { return vdupq_n_f32(x); }
    static V load_f32(const float* p) { return vld1q_f32(p); }
    static V load_f16(const fp16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
    static V load_bf16(const bf16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
    // 32 int8 codes (a Q8_0 block) as floats: two 16-byte loads widened in halves, q[c] = codes 4c .. 4c + 3.
    static void load_q8x32(const int8_t* p, V q[8]) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int8x16_t v = vld1q_s8(p + 16 * h);
            const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
            q[4 * h] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
            q[4 * h + 1] = vcvtq_f32_s32(vmovl_high_s16(lo));
            q[4 * h + 2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
            q[4 * h + 3] = vcvtq_f32_s32(vmovl_high_s16(hi));
        }
    }
    static void store(float* p, V v) { vst1q_f32(p, v); }
    static VI set1_i32(int32_t x) { return vdupq_n_s32(x); }
    static VI sub_i32(VI a, VI b) { return vsubq_s32(a, b); }
    static V i32_to_f32(VI v) { return vcvtq_f32_s32(v); }
    static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }  // a * b + c, rounded once
    static V add(V a, V b) { return vaddq_f32(a, b); }
    static V sub(V a, V b) { return vsubq_f32(a, b); }
    static V mul(V a, V b) { return vmulq_f32(a, b); }
    static V div(V a, V b) { return vdivq_f32(a, b); }
    static V neg(V a) { return vnegq_f32(a); }
    static V max0(V a) { return vmaxq_f32(a, vdupq_n_f32(0.0f)); }  // NaN stays NaN (fmax), unlike x86
    static M ge(V a, V b) { return vcgeq_f32(a, b); }
    static M le(V a, V b) { return vcleq_f32(a, b); }
    static V select(M m, V a, V b) { return vbslq_f32(m, a, b); }  // m ? a : b
    static float hsum(V v) { return vaddvq_f32(v); }
    static float hsum_ggml(V v) { return vaddvq_f32(v); }  // GGML_F32x4_REDUCE's last step
    static void hsum_ggml8(const V* v, float* out) {
        for (int i = 0; i < 8; i++) out[i] = hsum_ggml(v[i]);
    }
    static void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
    // The NEON kernels were measured with the near prefetch alone: the far one is left out.
    static void prefetch_l2(const void*) {}
};

}  // namespace
}  // namespace optiml

#include "simd_elem.h"
