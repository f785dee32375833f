// AVX2 element-wise ops: a vectorized exp for silu (the FFN activation runs on every neuron of
// every layer for every token, so a scalar expf per element would cost as much as a small matmul).
#include <immintrin.h>

#include <cmath>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {

namespace {

// e^x for 8 floats: x = k ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (relative error
// ~2e-7, a couple of ulp), 2^k built in the exponent bits. Inputs are clamped to the float range.
inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x - k ln2, with ln2 split in two parts so the subtraction stays exact.
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

void silu_mul_avx2(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void relu_mul_avx2(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_max_ps(_mm256_loadu_ps(g + i), _mm256_setzero_ps());
        _mm256_storeu_ps(g + i, _mm256_mul_ps(x, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = (g[i] > 0 ? g[i] : 0.0f) * u[i];
}

void axpy_f32_avx2(int64_t n, float a, const void* x, float* y) {
    const float* xf = (const float*)x;
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(xf + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * xf[i];
}

void axpy_f16_avx2(int64_t n, float a, const void* x, float* y) {
    const fp16_t* xh = (const fp16_t*)x;
    const __m256 av = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(xh + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] += a * fp16_to_fp32(xh[i]);
}

}  // namespace

void fill_ops_avx2(KernelTable& t) {
    t.axpy[TYPE_F32] = axpy_f32_avx2;
    t.axpy[TYPE_F16] = axpy_f16_avx2;
    t.silu_mul = silu_mul_avx2;
    t.relu_mul = relu_mul_avx2;
}

}  // namespace optiml
