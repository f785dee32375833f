// AVX-512 element-wise ops: 16 lanes, the exp that ggml's AVX-512 build uses (scalef instead of
// exponent-bit arithmetic, so its last bits differ from the AVX2 version), and attention dots summed
// in ggml's 512-bit order.
#include <immintrin.h>

#include <cmath>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/ops.h"

namespace optiml {

namespace {

inline __m512 exp_ps(__m512 x) {
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 u = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    const __m512 res = _mm512_scalef_ps(j, n);
    if (_mm512_kortestz(d, d)) return res;
    // |n| > 192: far outside the float range, inf or 0 by sign.
    const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                            _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
    return _mm512_mask_blend_ps(d, res, alt);
}

void silu_mul_avx512(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// llama.cpp's table GELU, 16 at a time (the same lookups as the scalar and AVX2 versions).
void gelu_mul_avx512(int64_t n, float* g, const float* u) {
    const float* table = gelu_table_f16();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 uv = _mm512_loadu_ps(u + i);
        const __m512i h = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        __m512 y = _mm512_mul_ps(_mm512_i32gather_ps(h, table, 4), uv);
        y = _mm512_mask_mul_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(10.0f), _CMP_GE_OQ), x, uv);
        y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-10.0f), _CMP_LE_OQ), _mm512_setzero_ps());
        _mm512_storeu_ps(g + i, y);
    }
    for (; i < n; i++) {
        const float x = g[i];
        if (x <= -10.0f) g[i] = 0.0f;
        else if (x >= 10.0f) g[i] = x * u[i];
        else g[i] = table[fp32_to_fp16(x)] * u[i];
    }
}

double softmax_exp_avx512(int64_t n, float* y, const float* x, float max) {
    double sum = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(max)));
        _mm512_storeu_ps(y + i, v);
        sum += _mm512_reduce_add_ps(v);
    }
    for (; i < n; i++) {
        y[i] = std::exp(x[i] - max);
        sum += y[i];
    }
    return sum;
}

void attn_dot_f32_avx512(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    const float* y = (const float*)b;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
    double sum = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) sum += (double)(x[i] * y[i]);
    *s = (float)sum;
}

// Four accumulators over steps of 64, folded (0+2)+(1+3), then a tail in double: ggml_vec_dot_f16's
// order, which llama.cpp's attention follows, except that whole 16-element chunks of the tail go
// through the vector unit too (ggml takes them one by one). The attention's windows are multiples
// of 32, so a window of 32 mod 64 (every V dot of a context under 32) ran its last 32 elements
// scalar: 15% of a 7B-shaped model's attention per decode step at such contexts.
void attn_dot_f16_avx512(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    const fp16_t* y = (const fp16_t*)b;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    auto step = [&](int64_t i, int j) {
        const __m512 xv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i)));
        const __m512 yv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(y + i)));
        acc[j] = _mm512_fmadd_ps(xv, yv, acc[j]);
    };
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int j = 0; j < 4; j++) step(i + 16 * j, j);
    for (int j = 0; i + 16 <= n; i += 16, j++) step(i, j);
    acc[0] = _mm512_add_ps(acc[0], acc[2]);
    acc[1] = _mm512_add_ps(acc[1], acc[3]);
    acc[0] = _mm512_add_ps(acc[0], acc[1]);
    double sum = _mm512_reduce_add_ps(acc[0]);
    for (; i < n; i++) sum += (double)(fp16_to_fp32(x[i]) * fp16_to_fp32(y[i]));
    *s = (float)sum;
}

}  // namespace

void fill_ops_avx512(KernelTable& t) {
    t.attn_dot[TYPE_F32] = attn_dot_f32_avx512;
    t.attn_dot[TYPE_F16] = attn_dot_f16_avx512;
    t.softmax_exp = softmax_exp_avx512;
    t.silu_mul = silu_mul_avx512;
    t.gelu_mul = gelu_mul_avx512;
}

}  // namespace optiml
