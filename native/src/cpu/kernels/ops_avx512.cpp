// AVX-512 element-wise ops: 16 lanes, the exp that ggml's AVX-512 build uses (scalef instead of
// exponent-bit arithmetic, so its last bits differ from the AVX2 version), and attention dots summed
// in ggml's 512-bit order.
#include <immintrin.h>

#include <cmath>

#include "attn_dot_rows.h"
#include "ops.h"
#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

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

// R rows against the same y at once (y converted once for all of them); each row sums exactly as
// it would alone: attn_dot is this with R = 1.
//
// F32: one accumulator, 16 lanes at a time, reduced, then a tail in double.
template <int R>
inline void dot_f32_rows(int64_t n, float* s, const float* const* x, const float* y) {
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 yv = _mm512_loadu_ps(y + i);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x[r] + i), yv, acc[r]);
    }
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) red[r] = _mm512_reduce_add_ps(acc[r]);
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(x[r][k] * y[k]);
        s[r] = (float)sum;
    }
}

// F16: four accumulators over steps of 64, folded (0+2)+(1+3), then a tail in double:
// ggml_vec_dot_f16's order, which llama.cpp's attention follows, except that whole 16-element chunks
// of the tail go through the vector unit too (ggml takes them one by one). The attention's windows
// are multiples of 32, so a window of 32 mod 64 (every V dot of a context under 32) ran its last 32
// elements scalar: 15% of a 7B-shaped model's attention per decode step at such contexts.
template <int R>
inline void step_f16(__m512* acc, const fp16_t* const* x, const fp16_t* y, int64_t i) {
    const __m512 yv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(y + i)));
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x[r] + i))), yv, acc[r]);
}

template <int R>
inline void dot_f16_rows(int64_t n, float* s, const fp16_t* const* x, const fp16_t* y) {
    // Accumulator j of row r: a<j>[r] (four arrays with constant indices stay in registers).
    __m512 a0[R], a1[R], a2[R], a3[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        step_f16<R>(a0, x, y, i);
        step_f16<R>(a1, x, y, i + 16);
        step_f16<R>(a2, x, y, i + 32);
        step_f16<R>(a3, x, y, i + 48);
    }
    // The whole 16-element chunks left (at most 3) into accumulators 0, 1, 2 in turn.
    if (i + 16 <= n) step_f16<R>(a0, x, y, i), i += 16;
    if (i + 16 <= n) step_f16<R>(a1, x, y, i), i += 16;
    if (i + 16 <= n) step_f16<R>(a2, x, y, i), i += 16;
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        red[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0[r], a2[r]), _mm512_add_ps(a1[r], a3[r])));
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(fp16_to_fp32(x[r][k]) * fp16_to_fp32(y[k]));
        s[r] = (float)sum;
    }
}

void attn_dot_f32_avx512(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    dot_f32_rows<1>(n, s, &x, (const float*)b);
}

void attn_dot_f16_avx512(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    dot_f16_rows<1>(n, s, &x, (const fp16_t*)b);
}

}  // namespace

void fill_ops_avx512(KernelTable& t) {
    t.attn_dot[TYPE_F32] = attn_dot_f32_avx512;
    t.attn_dot[TYPE_F16] = attn_dot_f16_avx512;
    // 32 registers: 4 rows at once (16 accumulators for F16).
    t.attn_dot_rows[TYPE_F32] = attn_dot_rows_by<float, 4, dot_f32_rows<4>, dot_f32_rows<1>>;
    t.attn_dot_rows[TYPE_F16] = attn_dot_rows_by<fp16_t, 4, dot_f16_rows<4>, dot_f16_rows<1>>;
    t.softmax_exp = softmax_exp_avx512;
    t.silu_mul = silu_mul_avx512;
    t.gelu_mul = gelu_mul_avx512;
}

}  // namespace optiml
