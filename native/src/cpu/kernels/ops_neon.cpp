// aarch64 NEON element-wise ops and attention dots: simd_ops.h on 4-lane vectors. exp is ggml's
// vectorized expf (the ARM optimized-routines algorithm, the same steps as ops_avx2.cpp's), so silu and
// softmax follow llama.cpp's NEON build; attention dots sum in ggml_vec_dot_f16's NEON order (fp32
// accumulation: 4 accumulators of 4 lanes over steps of 16). The gelu products are bit-identical to the
// scalar reference, and so are the relu ones but for NaN (vmaxq keeps it, the reference gives 0).
#include "simd_neon.h"
#include "simd_ops.h"

namespace optiml {
namespace {

// e^x for 4 floats: n = round(x / ln2), b = x - n ln2 (two-part ln2), e^b by a degree-5 polynomial,
// scaled by 2^n through the exponent bits, with the |n| > 126 cases handled apart (max error about
// 1.5 ulp; overflow gives inf, underflow 0).
inline float32x4_t exp_ps(float32x4_t x) {
    const float32x4_t r = vdupq_n_f32(0x1.8p23f);
    const float32x4_t z = vfmaq_f32(r, x, vdupq_n_f32(0x1.715476p+0f));
    const float32x4_t n = vsubq_f32(z, r);
    const float32x4_t b = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(0x1.62e4p-1f)), n, vdupq_n_f32(0x1.7f7d1cp-20f));
    const uint32x4_t e = vshlq_n_u32(vreinterpretq_u32_f32(z), 23);
    const float32x4_t k = vreinterpretq_f32_u32(vaddq_u32(e, vreinterpretq_u32_f32(vdupq_n_f32(1))));
    const uint32x4_t c = vcagtq_f32(n, vdupq_n_f32(126));
    const float32x4_t u = vmulq_f32(b, b);
    const float32x4_t j = vfmaq_f32(
        vmulq_f32(vdupq_n_f32(0x1.ffffecp-1f), b),
        vfmaq_f32(vfmaq_f32(vdupq_n_f32(0x1.fffdb6p-2f), vdupq_n_f32(0x1.555e66p-3f), b),
                  vfmaq_f32(vdupq_n_f32(0x1.573e2ep-5f), vdupq_n_f32(0x1.0e4020p-7f), b), u),
        u);
    if (vmaxvq_u32(c) == 0) return vfmaq_f32(k, j, k);
    // Some lane is near or past the float range: build 2^n from two factors so it cannot overflow early.
    const uint32x4_t g = vandq_u32(vclezq_f32(n), vdupq_n_u32(0x82000000u));
    const float32x4_t s1 = vreinterpretq_f32_u32(vaddq_u32(g, vdupq_n_u32(0x7f000000u)));
    const float32x4_t s2 = vreinterpretq_f32_u32(vsubq_u32(e, g));
    const uint32x4_t d = vcagtq_f32(n, vdupq_n_f32(192));
    return vbslq_f32(d, vmulq_f32(s1, s1), vbslq_f32(c, vmulq_f32(vfmaq_f32(s2, s2, j), s1), vfmaq_f32(k, k, j)));
}

struct OpsNEON : F32x4 {
    static V exp(V x) { return exp_ps(x); }
    // Round to f16 (nearest even, the hardware conversion); NEON has no gather, so four scalar loads.
    static V gelu_lookup(const float* table, V x) {
        uint16_t h[4];
        vst1_u16(h, vreinterpret_u16_f16(vcvt_f16_f32(x)));
        const float t[4] = {table[h[0]], table[h[1]], table[h[2]], table[h[3]]};
        return vld1q_f32(t);
    }
    // 32 registers: 4 rows of F32 at once, 2 of F16 (8 accumulators).
    static constexpr int kF32Rows = 4, kF16Rows = 2;
    static constexpr bool kF16Chunks = false;
};

}  // namespace

void fill_ops_neon(KernelTable& t) { fill_ops<OpsNEON>(t); }

}  // namespace optiml
