// aarch64 NEON element-wise ops. exp is ggml's vectorized expf (the ARM optimized-routines
// algorithm, the same steps as ops_avx2.cpp's), so silu and softmax follow llama.cpp's NEON build;
// attention dots sum in ggml_vec_dot_f16's NEON order (fp32 accumulation: 4 accumulators of 4
// lanes over steps of 16). The gelu and relu products are bit-identical to the scalar reference.
#include <arm_neon.h>

#include <cmath>
#include <cstring>

#include "ops.h"
#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

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

void silu_mul_neon(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    const float32x4_t one = vdupq_n_f32(1.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t s = vdivq_f32(x, vaddq_f32(one, exp_ps(vnegq_f32(x))));
        vst1q_f32(g + i, vmulq_f32(s, vld1q_f32(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void relu_mul_neon(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vmaxq_f32(vld1q_f32(g + i), vdupq_n_f32(0.0f));
        vst1q_f32(g + i, vmulq_f32(x, vld1q_f32(u + i)));
    }
    for (; i < n; i++) g[i] = (g[i] > 0 ? g[i] : 0.0f) * u[i];
}

// llama.cpp's table GELU: round to f16 (nearest even, the hardware conversion), look up, multiply.
// NEON has no gather, so the four lookups are scalar loads.
void gelu_mul_neon(int64_t n, float* g, const float* u) {
    const float* table = gelu_table_f16();
    int64_t i = 0;
    const float32x4_t lo = vdupq_n_f32(-10.0f), hi = vdupq_n_f32(10.0f);
    for (; i + 4 <= n; i += 4) {
        const float32x4_t x = vld1q_f32(g + i);
        const float32x4_t uv = vld1q_f32(u + i);
        uint16_t h[4];
        vst1_u16(h, vreinterpret_u16_f16(vcvt_f16_f32(x)));
        const float t[4] = {table[h[0]], table[h[1]], table[h[2]], table[h[3]]};
        float32x4_t y = vmulq_f32(vld1q_f32(t), uv);
        y = vbslq_f32(vcgeq_f32(x, hi), vmulq_f32(x, uv), y);
        y = vbslq_f32(vcleq_f32(x, lo), vdupq_n_f32(0.0f), y);
        vst1q_f32(g + i, y);
    }
    for (; i < n; i++) {
        const float x = g[i];
        if (x <= -10.0f) g[i] = 0.0f;
        else if (x >= 10.0f) g[i] = x * u[i];
        else g[i] = table[fp32_to_fp16(x)] * u[i];
    }
}

// ggml_vec_soft_max_f32's NEON loop: four at a time, each group's sum added in double.
double softmax_exp_neon(int64_t n, float* y, const float* x, float max) {
    double sum = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t v = exp_ps(vsubq_f32(vld1q_f32(x + i), vdupq_n_f32(max)));
        vst1q_f32(y + i, v);
        sum += (double)vaddvq_f32(v);
    }
    for (; i < n; i++) {
        y[i] = std::exp(x[i] - max);
        sum += y[i];
    }
    return sum;
}

// One accumulator, 4 lanes at a time, horizontal sum at the end; a tail (n % 4) in double.
void attn_dot_f32_neon(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    const float* y = (const float*)b;
    float32x4_t acc = vdupq_n_f32(0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) acc = vfmaq_f32(acc, vld1q_f32(x + i), vld1q_f32(y + i));
    double sum = vaddvq_f32(acc);
    for (; i < n; i++) sum += (double)(x[i] * y[i]);
    *s = (float)sum;
}

inline float32x4_t load_f16x4(const fp16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }

// Four accumulators over steps of 16, folded (0+2)+(1+3), summed across lanes, then a tail in
// double: ggml_vec_dot_f16's order on NEON without fp16 vector arithmetic.
void attn_dot_f16_neon(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    const fp16_t* y = (const fp16_t*)b;
    float32x4_t acc[4] = {vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0), vdupq_n_f32(0)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; j++) acc[j] = vfmaq_f32(acc[j], load_f16x4(x + i + 4 * j), load_f16x4(y + i + 4 * j));
    acc[0] = vaddq_f32(acc[0], acc[2]);
    acc[1] = vaddq_f32(acc[1], acc[3]);
    double sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
    for (; i < n; i++) sum += (double)(fp16_to_fp32(x[i]) * fp16_to_fp32(y[i]));
    *s = (float)sum;
}

}  // namespace

void fill_ops_neon(KernelTable& t) {
    t.attn_dot[TYPE_F32] = attn_dot_f32_neon;
    t.attn_dot[TYPE_F16] = attn_dot_f16_neon;
    t.softmax_exp = softmax_exp_neon;
    t.silu_mul = silu_mul_neon;
    t.relu_mul = relu_mul_neon;
    t.gelu_mul = gelu_mul_neon;
    // gelu_exact_mul stays scalar (tanh has no vector form here), as on x86.
}

}  // namespace optiml
