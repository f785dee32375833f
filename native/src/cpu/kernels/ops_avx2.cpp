// AVX2 element-wise ops and attention dots: simd_ops.h on 8-lane vectors. exp is ggml's vectorized expf
// (the ARM optimized-routines algorithm), so silu and softmax give llama.cpp's bits; the F16 dots sum
// as ggml_vec_dot_f16's AVX2 build does.
#include "simd_x86.h"
#include "simd_ops.h"

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

struct OpsAVX2 : F32x8 {
    static V exp(V x) { return exp_ps(x); }
    // Round to f16 (nearest even, as F16C does) and gather.
    static V gelu_lookup(const float* table, V x) {
        return _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)), 4);
    }
    // 16 registers: 4 rows of F32 at once (4 accumulators), 2 of F16 (8).
    static constexpr int kF32Rows = 4, kF16Rows = 2;
    static constexpr bool kF16Chunks = false;
};

}  // namespace

void fill_ops_avx2(KernelTable& t) { fill_ops<OpsAVX2>(t); }

}  // namespace optiml
