// AVX-512 element-wise ops and attention dots: simd_ops.h on 16-lane vectors. exp is the one ggml's
// AVX-512 build uses (scalef instead of exponent-bit arithmetic, so its last bits differ from the AVX2
// version), and the F16 dots sum in ggml's 512-bit order, whole 16-element chunks of the tail included.
#include "simd_x86.h"
#include "simd_ops.h"

namespace optiml {
namespace {

// e^x for 16 floats as ggml's AVX-512 build computes it: the AVX2 version's range reduction, 1 folded
// into the polynomial, the result scaled by 2^n with vscalefps (its last bits differ), inf or 0 past
// the float range.
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

struct OpsAVX512 : F32x16 {
    static V exp(V x) { return exp_ps(x); }
    static V gelu_lookup(const float* table, V x) {
        return _mm512_i32gather_ps(_mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)), table, 4);
    }
    // 32 registers: 4 rows at once (16 accumulators for F16).
    static constexpr int kF32Rows = 4, kF16Rows = 4;
    static constexpr bool kF16Chunks = true;
};

}  // namespace

void fill_ops_avx512(KernelTable& t) { fill_ops<OpsAVX512>(t); }

}  // namespace optiml
