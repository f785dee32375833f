#include "ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "optiml/kernels.h"
#include "optiml/rope_yarn.h"

namespace optiml {

void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps) {
    double sum = 0;  // double, as ggml does: n can be large and x^2 spans many magnitudes
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    const float scale = (float)(1.0 / std::sqrt(sum / (double)n + (double)eps));
    if (w) {
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale;
    }
}

void rope_cos_sin(int64_t pos, int64_t n_rot, float freq_base, float freq_scale, const float* freq_factors,
                  float* cos, float* sin, const RopeYarnRange& yarn) {
    // Float, with the angle advanced by one multiplication per pair, exactly as ggml computes it:
    // activations are quantized to 8 bits downstream, so even last-bit differences here can change
    // which token wins a close call, and matching llama.cpp's text is the goal.
    const float theta_scale = std::pow(freq_base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (int64_t i = 0; i < n_rot / 2; i++) {
        const float extrap = freq_factors ? theta / freq_factors[i] : theta;
        const float t = rope_yarn_angle(extrap, freq_scale, i, yarn.ext_factor, yarn.low, yarn.high);
        cos[i] = std::cos(t) * yarn.mscale;
        sin[i] = std::sin(t) * yarn.mscale;
        theta *= theta_scale;
    }
}

void rope(float* x, int64_t n_rot, const float* cos, const float* sin, bool neox) {
    const int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        float* a = neox ? &x[i] : &x[2 * i];
        float* b = neox ? &x[i + half] : &x[2 * i + 1];
        const float x0 = *a, x1 = *b;
        *a = x0 * cos[i] - x1 * sin[i];
        *b = x0 * sin[i] + x1 * cos[i];
    }
}

float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
    return 0.5f * x * (1.0f + std::tanh(sqrt_2_over_pi * x * (1.0f + 0.044715f * x * x)));
}

const float* gelu_table_f16() {
    static const std::vector<float> table = [] {
        std::vector<float> t(1 << 16);
        for (uint32_t i = 0; i < (1u << 16); i++)
            t[i] = fp16_to_fp32(fp32_to_fp16(gelu_tanh(fp16_to_fp32((fp16_t)i))));
        return t;
    }();
    return table.data();
}

namespace {
void gelu_mul_scalar(int64_t n, float* g, const float* u) {
    const float* table = gelu_table_f16();
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        if (x <= -10.0f) g[i] = 0.0f;
        else if (x >= 10.0f) g[i] = x * u[i];
        else g[i] = table[fp32_to_fp16(x)] * u[i];
    }
}
void gelu_exact_mul_scalar(int64_t n, float* g, const float* u) {
    for (int64_t i = 0; i < n; i++) g[i] = gelu_tanh(g[i]) * u[i];
}
void silu_mul_scalar(int64_t n, float* g, const float* u) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
void relu_mul_scalar(int64_t n, float* g, const float* u) {
    for (int64_t i = 0; i < n; i++) g[i] = (g[i] > 0 ? g[i] : 0.0f) * u[i];
}
double softmax_exp_scalar(int64_t n, float* y, const float* x, float max) {
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        y[i] = std::exp(x[i] - max);
        sum += y[i];
    }
    return sum;
}

void attn_dot_f32_scalar(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    const float* y = (const float*)b;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * y[i]);
    *s = (float)sum;
}

void attn_dot_f16_scalar(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    const fp16_t* y = (const fp16_t*)b;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(fp16_to_fp32(x[i]) * fp16_to_fp32(y[i]));
    *s = (float)sum;
}
}  // namespace

void fill_ops_scalar(KernelTable& t) {
    t.softmax_exp = softmax_exp_scalar;
    t.attn_dot[TYPE_F32] = attn_dot_f32_scalar;
    t.attn_dot[TYPE_F16] = attn_dot_f16_scalar;
    t.silu_mul = silu_mul_scalar;
    t.relu_mul = relu_mul_scalar;
    t.gelu_mul = gelu_mul_scalar;
    t.gelu_exact_mul = gelu_exact_mul_scalar;
}

}  // namespace optiml
