// AVX2 element-wise ops. exp is ggml's vectorized expf (the ARM optimized-routines algorithm), so
// silu and softmax give llama.cpp's bits; attention dots sum as llama.cpp's CPU GEMM does.
#include <immintrin.h>

#include <cmath>

#include "attn_dot_rows.h"
#include "ops.h"
#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {

namespace {

// e^x for 8 floats: n = round(x / ln2), b = x - n ln2 (two-part ln2), e^b by a degree-5 polynomial,
// scaled by 2^n through the exponent bits, with the |n| > 126 cases handled apart (max error about
// 1.5 ulp; overflow gives inf, underflow 0).
inline __m256 exp_ps(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256 abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
    const __m256 c = _mm256_cmp_ps(abs_n, _mm256_set1_ps(126), _CMP_GT_OQ);
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(c)) return _mm256_fmadd_ps(j, k, k);
    // Some lane is near or past the float range: build 2^n from two factors so it cannot overflow early.
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32((int)0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256 d = _mm256_cmp_ps(abs_n, _mm256_set1_ps(192), _CMP_GT_OQ);
    const __m256 near = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
    const __m256 in_range = _mm256_blendv_ps(_mm256_fmadd_ps(k, j, k), near, c);
    return _mm256_blendv_ps(in_range, _mm256_mul_ps(s1, s1), d);
}

inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void silu_mul_avx2(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
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

// llama.cpp's table GELU, 8 at a time: round to f16 (nearest even, as F16C does), gather, multiply.
void gelu_mul_avx2(int64_t n, float* g, const float* u) {
    const float* table = gelu_table_f16();
    int64_t i = 0;
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 uv = _mm256_loadu_ps(u + i);
        const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        __m256 y = _mm256_mul_ps(_mm256_i32gather_ps(table, h, 4), uv);
        y = _mm256_blendv_ps(y, _mm256_mul_ps(x, uv), _mm256_cmp_ps(x, hi, _CMP_GE_OQ));
        y = _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LE_OQ), y);
        _mm256_storeu_ps(g + i, y);
    }
    for (; i < n; i++) {
        const float x = g[i];
        if (x <= -10.0f) g[i] = 0.0f;
        else if (x >= 10.0f) g[i] = x * u[i];
        else g[i] = table[fp32_to_fp16(x)] * u[i];
    }
}

double softmax_exp_avx2(int64_t n, float* y, const float* x, float max) {
    double sum = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max)));
        _mm256_storeu_ps(y + i, v);
        sum += hsum_ps(v);
    }
    for (; i < n; i++) {
        y[i] = std::exp(x[i] - max);
        sum += y[i];
    }
    return sum;
}

// R rows against the same y at once (y converted once for all of them); each row sums exactly as
// it would alone: attn_dot is this with R = 1.
//
// F32: one accumulator, 8 lanes at a time, horizontal sum at the end; a tail (n % 8) in double.
template <int R>
inline void dot_f32_rows(int64_t n, float* s, const float* const* x, const float* y) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 yv = _mm256_loadu_ps(y + i);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x[r] + i), yv, acc[r]);
    }
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) red[r] = hsum_ps(acc[r]);
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(x[r][k] * y[k]);
        s[r] = (float)sum;
    }
}

// F16: four accumulators over steps of 32, folded (0+2)+(1+3), summed with hadd, then a tail in
// double: ggml_vec_dot_f16's AVX2 order, which llama.cpp's attention follows.
template <int R>
inline void dot_f16_rows(int64_t n, float* s, const fp16_t* const* x, const fp16_t* y) {
    __m256 acc[R][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 4; j++) {
            const __m256 yv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(y + i + 8 * j)));
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x[r] + i + 8 * j)));
                acc[r][j] = _mm256_fmadd_ps(xv, yv, acc[r][j]);
            }
        }
    }
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256 a = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][2]), _mm256_add_ps(acc[r][1], acc[r][3]));
        const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        const __m128 t1 = _mm_hadd_ps(t0, t0);
        red[r] = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    }
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(fp16_to_fp32(x[r][k]) * fp16_to_fp32(y[k]));
        s[r] = (float)sum;
    }
}

void attn_dot_f32_avx2(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    dot_f32_rows<1>(n, s, &x, (const float*)b);
}

void attn_dot_f16_avx2(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    dot_f16_rows<1>(n, s, &x, (const fp16_t*)b);
}

}  // namespace

void fill_ops_avx2(KernelTable& t) {
    t.attn_dot[TYPE_F32] = attn_dot_f32_avx2;
    t.attn_dot[TYPE_F16] = attn_dot_f16_avx2;
    // 16 registers: 4 rows of F32 at once (4 accumulators), 2 of F16 (8).
    t.attn_dot_rows[TYPE_F32] = attn_dot_rows_by<float, 4, dot_f32_rows<4>, dot_f32_rows<1>>;
    t.attn_dot_rows[TYPE_F16] = attn_dot_rows_by<fp16_t, 2, dot_f16_rows<2>, dot_f16_rows<1>>;
    t.softmax_exp = softmax_exp_avx2;
    t.silu_mul = silu_mul_avx2;
    t.relu_mul = relu_mul_avx2;
    t.gelu_mul = gelu_mul_avx2;
}

}  // namespace optiml
