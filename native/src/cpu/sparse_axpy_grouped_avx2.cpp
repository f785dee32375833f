// AVX2 kernels for grouped neuron-major rows (contract: kernels.h, axpy_group_fn): the codes are summed
// with the int8 coefficients in integers, two neurons per vpmaddubsw.
//
// A pair of neurons' 16 code bytes of a 32-dimension chunk are interleaved (byte b of neuron i, then of
// neuron j, for each b); the low nibbles are then codes of dimensions 0-15 in pairs, the high nibbles
// those of dimensions 16-31, and vpmaddubsw with (q_i, q_j) repeated gives per dimension
// q_i * c_i + q_j * c_j in an int16, in dimension order. |q| <= 127 and c <= 15: a pair adds at most
// 3810, so eight pairs fit an int16 (30480) before they are widened into int32 sums. The sums are
// exact, and the final float steps are the scalar reference's: the bits are the same.
#include <immintrin.h>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/sparse.h"

namespace optiml {
namespace {

inline __m256 scales8(const fp16_t* s) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)); }
inline __m256 scales8(const float* s) { return _mm256_loadu_ps(s); }

// Prefetch distances, in dimensions (kernels.h): a row's codes 256 bytes ahead, its group's scales 4 or
// 8 KiB.
constexpr int kPrefetchAhead = kGroupPrefetchDims / 2;
constexpr int kPairsPerWiden = 8;    // pairs summed in int16 before widening: 8 * 3810 < 32768

// The 32 codes of one chunk of rows x and z, interleaved: lo = dimensions 0-15, hi = 16-31, each as
// (code of x, code of z) byte pairs in dimension order.
__attribute__((always_inline)) inline void pair_codes(const uint8_t* x, const uint8_t* z, __m256i* lo, __m256i* hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i bx = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)x));
    const __m256i bz = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)z));
    // Lane 0: bytes 0-7 of x and z interleaved; lane 1: bytes 8-15.
    const __m256i v = _mm256_blend_epi32(_mm256_unpacklo_epi8(bx, bz), _mm256_unpackhi_epi8(bx, bz), 0xF0);
    *lo = _mm256_and_si256(v, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}

// Adds the 16 int16 sums of a (dimension order) to two vectors of 8 int32 sums.
__attribute__((always_inline)) inline void widen_add(__m256i a, __m256i* t) {
    t[0] = _mm256_add_epi32(t[0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a)));
    t[1] = _mm256_add_epi32(t[1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a, 1)));
}

// C chunks of 32 dimensions from r0; S: the scales' type (fp16 or float).
template <bool MIN, typename S, int C>
__attribute__((always_inline)) inline void pass(int64_t r0, float* y, const void* const* w, size_t off,
                                                const int8_t* q, int64_t k, int32_t q_sum, float s, const S* d,
                                                const S* m) {
    __m256i t[4 * C];  // int32 sums: dimensions 8j .. 8j + 7 of the pass
#pragma GCC unroll 8
    for (int j = 0; j < 4 * C; j++) t[j] = _mm256_setzero_si256();
    const size_t o = off + (size_t)r0 / 2;
    // The scales are a stream of their own, read once per pass: prefetched like the rows.
#pragma GCC unroll 8
    for (int l = 0; l < (int)sizeof(S) * C / 2; l++) {
        _mm_prefetch((const char*)(d + r0 + kGroupScalePrefetchDims) + 64 * l, _MM_HINT_T0);
        if (MIN) _mm_prefetch((const char*)(m + r0 + kGroupScalePrefetchDims) + 64 * l, _MM_HINT_T0);
    }
    for (int64_t i0 = 0; i0 < k; i0 += 2 * kPairsPerWiden) {
        const int64_t i1 = i0 + 2 * kPairsPerWiden < k ? i0 + 2 * kPairsPerWiden : k;
        __m256i acc[2 * C];  // int16 sums: dimensions 0-15 and 16-31 of each chunk
#pragma GCC unroll 4
        for (int j = 0; j < 2 * C; j++) acc[j] = _mm256_setzero_si256();
        for (int64_t i = i0; i < i1; i += 2) {
            // An odd last row is paired with itself at coefficient 0.
            const bool two = i + 1 < i1;
            const uint8_t* x = (const uint8_t*)w[i] + o;
            const uint8_t* z = two ? (const uint8_t*)w[i + 1] + o : x;
            const int8_t qz = two ? q[i + 1] : 0;
            const __m256i qq = _mm256_set1_epi16((int16_t)(uint16_t)((uint8_t)q[i] | (uint16_t)(uint8_t)qz << 8));
            // Each row is read 32 bytes a pass, a dozen rows at once: too many short streams for the
            // hardware prefetcher, so ask for the line several passes ahead.
            _mm_prefetch((const char*)x + kPrefetchAhead, _MM_HINT_T0);
            _mm_prefetch((const char*)z + kPrefetchAhead, _MM_HINT_T0);
#pragma GCC unroll 2
            for (int c = 0; c < C; c++) {
                __m256i lo, hi;
                pair_codes(x + 16 * c, z + 16 * c, &lo, &hi);
                acc[2 * c] = _mm256_add_epi16(acc[2 * c], _mm256_maddubs_epi16(lo, qq));
                acc[2 * c + 1] = _mm256_add_epi16(acc[2 * c + 1], _mm256_maddubs_epi16(hi, qq));
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 2 * C; j++) widen_add(acc[j], t + 2 * j);
    }
    const __m256i centre = _mm256_set1_epi32(MIN ? 0 : 8 * q_sum);
    const __m256 vs = _mm256_set1_ps(s);
    const __m256 ms = _mm256_set1_ps(s * (float)q_sum);
#pragma GCC unroll 8
    for (int j = 0; j < 4 * C; j++) {
        const int64_t r = r0 + 8 * j;
        const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(t[j], centre));
        __m256 out = _mm256_fmadd_ps(_mm256_mul_ps(scales8(d + r), vs), v, _mm256_loadu_ps(y + r));
        if (MIN) out = _mm256_fmadd_ps(scales8(m + r), ms, out);
        _mm256_storeu_ps(y + r, out);
    }
}

template <bool MIN, typename S>
void axpy_group_avx2(int64_t n, float* y, const void* const* w, size_t off, const int8_t* q, int64_t k, int32_t q_sum,
                     float s, const void* dv, const void* mv) {
    const S* d = (const S*)dv;
    const S* m = (const S*)mv;
    int64_t r0 = 0;
    for (; r0 + 64 <= n; r0 += 64) pass<MIN, S, 2>(r0, y, w, off, q, k, q_sum, s, d, m);
    if (r0 < n) pass<MIN, S, 1>(r0, y, w, off, q, k, q_sum, s, d, m);
}

}  // namespace

void fill_sparse_grouped_avx2(KernelTable& t) {
    t.axpy_group[TYPE_Q4_0] = axpy_group_avx2<false, fp16_t>;
    t.axpy_group[TYPE_Q4_1] = axpy_group_avx2<true, fp16_t>;
    t.axpy_group[TYPE_Q4_K] = axpy_group_avx2<true, float>;
}

}  // namespace optiml
