// AVX-512 with VNNI (e.g. Cascade Lake, Ice Lake, Zen 4): the quant kernels of simd_common.h with
// vpdpbusd/vpdpwssd as their integer primitives (simd_x86.h; the same integer lanes as AVX2, so the
// same bits), and a matrix-vector kernel for the 32-element formats that puts two rows side by side
// in a zmm. 512-bit versions of the 32-element tiles (two blocks per zmm) were tried and measured no
// faster than the 256-bit ones on Zen 4, and they summed blocks in a different order from llama.cpp
// (which runs its 256-bit kernels on AVX-512 machines too), so the 256-bit bodies are used.
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {
namespace {

// ---- 32-block quants, one activation row against 8 weight rows ---------------------------------
// Two rows share a zmm: 128-bit lanes hold [row A bytes 0..15, row B 0..15, A 16..31, B 16..31],
// against activations [x 0..15, x 0..15, x 16..31, x 16..31]. Every int32 lane is the same 4-byte
// group sum that the 256-bit kernel forms for that row (codes rebased to unsigned, the offset taken
// back out with a per-block correction), scaled and accumulated by the same per-lane fma, and the
// final horizontal sum of each row takes its two 128-bit halves in hsum_ps's order: each row's
// result is vec_dot's, bit for bit.
inline __m512i nibble_pair(const uint8_t* qa, const uint8_t* qb) {
    const __m256i t = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)qa)),
                                              _mm_loadu_si128((const __m128i*)qb), 1);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}
// Bit i of qh sets 0x10 in byte i of its row (lane layout above).
inline __m512i add_high_bits(__m512i q, const uint8_t* qha, const uint8_t* qhb) {
    uint32_t ha, hb;
    std::memcpy(&ha, qha, 4);
    std::memcpy(&hb, qhb, 4);
    const __mmask64 k = (uint64_t)(ha & 0xFFFF) | ((uint64_t)(hb & 0xFFFF) << 16) | ((uint64_t)(ha >> 16) << 32) |
                        ((uint64_t)(hb >> 16) << 48);
    return _mm512_mask_blend_epi8(k, q, _mm512_or_si512(q, _mm512_set1_epi8(0x10)));
}
inline __m512i codes_pair(const block_q4_0& a, const block_q4_0& b) { return nibble_pair(a.qs, b.qs); }
inline __m512i codes_pair(const block_q4_1& a, const block_q4_1& b) { return nibble_pair(a.qs, b.qs); }
inline __m512i codes_pair(const block_q5_0& a, const block_q5_0& b) {
    return add_high_bits(nibble_pair(a.qs, b.qs), a.qh, b.qh);
}
inline __m512i codes_pair(const block_q5_1& a, const block_q5_1& b) {
    return add_high_bits(nibble_pair(a.qs, b.qs), a.qh, b.qh);
}
// Q8_0: signed codes + 128 (xor 0x80), offset 128.
inline __m512i codes_pair(const block_q8_0& a, const block_q8_0& b) {
    const __m512i za = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a.qs));
    const __m512i zb = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b.qs));
    const __m512i q = _mm512_permutex2var_epi64(za, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), zb);
    return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
}
template <typename WBlock> constexpr int offset512() { return Q32<WBlock>::offset; }
template <> constexpr int offset512<block_q8_0>() { return 128; }

inline float hsum_half(__m128 lo, __m128 hi) {
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

template <typename WBlock, bool FAR>
inline void dot_rows8_512(int64_t nb, float* s, const void* const* rows, const typename Q32<WBlock>::X* b) {
    const WBlock* a[8];
    const WBlock* ahead[8];  // the next 8 rows, prefetched in step
    const WBlock* far[8];    // and, when rows are short (FAR), the 8 two passes after those
    for (int r = 0; r < 8; r++) {
        a[r] = (const WBlock*)rows[r];
        ahead[r] = (const WBlock*)rows[r + 8];
        far[r] = (const WBlock*)rows[r + 24];
    }
    __m512 acc[4];
    for (int p = 0; p < 4; p++) acc[p] = _mm512_setzero_ps();
    __m256 minsv = _mm256_setzero_ps();
    __m512i idx[4];
    for (int p = 0; p < 4; p++)
        idx[p] = _mm512_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p, 2 * p,
                                   2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
    const __m512i offv = _mm512_set1_epi8((char)offset512<WBlock>());
    for (int64_t i = 0; i < nb; i++) {
        const __m512i xz = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b[i].qs));
        const __m512i X = _mm512_shuffle_i64x2(xz, xz, _MM_SHUFFLE(1, 1, 0, 0));
        __m512i negcorr = _mm512_setzero_si512();
        if (offset512<WBlock>() != 0)
            negcorr = _mm512_sub_epi32(negcorr, _mm512_dpbusd_epi32(_mm512_setzero_si512(), offv, X));
        const __m128i dh = _mm_setr_epi16((short)a[0][i].d, (short)a[1][i].d, (short)a[2][i].d, (short)a[3][i].d,
                                          (short)a[4][i].d, (short)a[5][i].d, (short)a[6][i].d, (short)a[7][i].d);
        const __m512 d8 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtph_ps(dh), _mm256_set1_ps(h2f(b[i].d))));
        if constexpr (Q32<WBlock>::has_min) {
            const __m128i mh = _mm_setr_epi16((short)a[0][i].m, (short)a[1][i].m, (short)a[2][i].m, (short)a[3][i].m,
                                              (short)a[4][i].m, (short)a[5][i].m, (short)a[6][i].m, (short)a[7][i].m);
            minsv = _mm256_fmadd_ps(_mm256_cvtph_ps(mh), _mm256_set1_ps(h2f(b[i].s)), minsv);
        }
        for (int p = 0; p < 4; p++) {
            _mm_prefetch((const char*)&ahead[2 * p][i], _MM_HINT_T1);
            _mm_prefetch((const char*)&ahead[2 * p + 1][i], _MM_HINT_T1);
            if (FAR) {
                _mm_prefetch((const char*)&far[2 * p][i], _MM_HINT_T1);
                _mm_prefetch((const char*)&far[2 * p + 1][i], _MM_HINT_T1);
            }
            const __m512i q = codes_pair(a[2 * p][i], a[2 * p + 1][i]);
            const __m512i pi = _mm512_dpbusd_epi32(negcorr, q, X);
            acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx[p], d8), _mm512_cvtepi32_ps(pi), acc[p]);
        }
    }
    float mins[8];
    _mm256_storeu_ps(mins, minsv);
    for (int p = 0; p < 4; p++) {
        s[2 * p] = hsum_half(_mm512_extractf32x4_ps(acc[p], 0), _mm512_extractf32x4_ps(acc[p], 2)) + mins[2 * p];
        s[2 * p + 1] = hsum_half(_mm512_extractf32x4_ps(acc[p], 1), _mm512_extractf32x4_ps(acc[p], 3)) + mins[2 * p + 1];
    }
}

template <typename WBlock>
void vec_dot_rows_512(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    int64_t r = 0;
    // Short rows (the predictors' n_ff x rank matrices): a pass of 8 is too little lead for the memory
    // latency, so the rows three passes ahead are fetched too.
    const bool short_rows = (size_t)(n / 32) * sizeof(WBlock) < 1024;
    if (short_rows)
        for (; r + 8 <= n_rows; r += 8)
            dot_rows8_512<WBlock, true>(n / 32, s + r, rows + r, (const typename Q32<WBlock>::X*)x);
    for (; r + 8 <= n_rows; r += 8)
        dot_rows8_512<WBlock, false>(n / 32, s + r, rows + r, (const typename Q32<WBlock>::X*)x);
    if (r < n_rows) vec_dot_rows_32<WBlock>(n, s + r, rows + r, x, n_rows - r);
}

}  // namespace

void fill_kernels_avx512vnni(KernelTable& t) {
    fill_quant_kernels(t);
    t.vec_dot_rows[TYPE_Q8_0] = vec_dot_rows_512<block_q8_0>;
    t.vec_dot_rows[TYPE_Q4_0] = vec_dot_rows_512<block_q4_0>;
    t.vec_dot_rows[TYPE_Q4_1] = vec_dot_rows_512<block_q4_1>;
    t.vec_dot_rows[TYPE_Q5_0] = vec_dot_rows_512<block_q5_0>;
    t.vec_dot_rows[TYPE_Q5_1] = vec_dot_rows_512<block_q5_1>;
}

}  // namespace optiml
