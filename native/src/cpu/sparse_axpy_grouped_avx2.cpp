// AVX2 kernels for grouped neuron-major rows (contract: kernels.h, axpy_group_fn). Two 32-dimension
// chunks per pass keep eight independent fma chains in flight; each element still gets one fma per
// neuron in list order, then one per scale, so the bits equal the scalar reference's.
#include <immintrin.h>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/sparse.h"

namespace optiml {
namespace {

// The 32 codes of one chunk as four vectors of 8 floats: dimensions 0-7, 8-15 (low nibbles) and
// 16-23, 24-31 (high nibbles); without a minimum (Q4_0) the codes are centred (minus 8).
template <bool MIN>
__attribute__((always_inline)) inline void codes(const uint8_t* q, __m256* c) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128((const __m128i*)q);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if (MIN) {
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const __m128i eight = _mm_set1_epi8(8);
        lo = _mm_sub_epi8(lo, eight);
        hi = _mm_sub_epi8(hi, eight);
        c[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        c[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        c[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        c[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
}

inline __m256 scales8(const fp16_t* s) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)); }
inline __m256 scales8(const float* s) { return _mm256_loadu_ps(s); }

constexpr int kPrefetchAhead = 256;  // bytes: 8 passes of 2 chunks

// C chunks of 32 dimensions from r0; S: the scales' type (fp16 or float).
template <bool MIN, typename S, int C>
__attribute__((always_inline)) inline void pass(int64_t r0, float* y, const void* const* w, size_t off, const float* a, int64_t k, const S* d,
                 const S* m, float a_sum) {
    __m256 acc[4 * C];
#pragma GCC unroll 8
    for (int j = 0; j < 4 * C; j++) acc[j] = _mm256_setzero_ps();
    const size_t o = off + (size_t)r0 / 2;
    for (int64_t i = 0; i < k; i++) {
        const __m256 va = _mm256_set1_ps(a[i]);
        const uint8_t* q = (const uint8_t*)w[i] + o;
        // Each row is read 32 bytes a pass, a dozen rows at once: too many short streams for the
        // hardware prefetcher, so ask for the line several passes ahead.
        _mm_prefetch((const char*)q + kPrefetchAhead, _MM_HINT_T0);
#pragma GCC unroll 2
        for (int c = 0; c < C; c++) {
            __m256 v[4];
            codes<MIN>(q + 16 * c, v);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[4 * c + j] = _mm256_fmadd_ps(va, v[j], acc[4 * c + j]);
        }
    }
    const __m256 vs = _mm256_set1_ps(a_sum);
#pragma GCC unroll 8
    for (int j = 0; j < 4 * C; j++) {
        const int64_t r = r0 + 8 * j;
        __m256 v = _mm256_fmadd_ps(scales8(d + r), acc[j], _mm256_loadu_ps(y + r));
        if (MIN) v = _mm256_fmadd_ps(scales8(m + r), vs, v);
        _mm256_storeu_ps(y + r, v);
    }
}

template <bool MIN, typename S>
void axpy_group_avx2(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k, const void* dv,
                     const void* mv, float a_sum) {
    const S* d = (const S*)dv;
    const S* m = (const S*)mv;
    int64_t r0 = 0;
    for (; r0 + 64 <= n; r0 += 64) pass<MIN, S, 2>(r0, y, w, off, a, k, d, m, a_sum);
    if (r0 < n) pass<MIN, S, 1>(r0, y, w, off, a, k, d, m, a_sum);
}

}  // namespace

void fill_sparse_grouped_avx2(KernelTable& t) {
    t.axpy_group[TYPE_Q4_0] = axpy_group_avx2<false, fp16_t>;
    t.axpy_group[TYPE_Q4_1] = axpy_group_avx2<true, fp16_t>;
    t.axpy_group[TYPE_Q4_K] = axpy_group_avx2<true, float>;
}

}  // namespace optiml
