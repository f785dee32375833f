// AVX-512 with VNNI (e.g. Cascade Lake, Ice Lake, Zen 4): the quant kernels of simd_common.h with
// vpdpbusd/vpdpwssd as their integer primitives (simd_x86.h; the same integer lanes as AVX2, so the
// same bits), 8-row tiles for the 32-element formats' batched product (32 vector registers), and a
// matrix-vector kernel for them that puts two rows side by side in a zmm.
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {
namespace {

// ---- 32-block quants, one activation row against 8 weight rows ---------------------------------
// Two rows share a zmm: 128-bit lanes hold [row A bytes 0..15, row B 0..15, A 16..31, B 16..31],
// against activations [x 0..15, x 0..15, x 16..31, x 16..31]; codes rebased to unsigned, the offset
// taken back out with a per-block correction. Each row's block sum is exact (integers), and the float
// steps are dot_rows8_32's (simd_q32.h), lane for lane: every row's value is its vec_dot, bit for bit.
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


// Lane r: the sum of row r's int32 lanes, from 4 zmm of row pairs (rows 2p, 2p+1 in p[p]).
inline __m256i reduce_pairs(const __m512i p[4]) {
    __m256i h[4];  // [row 2p's 4 partial sums | row 2p+1's]
    for (int k = 0; k < 4; k++) h[k] = _mm256_add_epi32(_mm512_castsi512_si256(p[k]), _mm512_extracti64x4_epi64(p[k], 1));
    const __m256i a = _mm256_hadd_epi32(h[0], h[1]);  // [r0 r0 r2 r2 | r1 r1 r3 r3]
    const __m256i b = _mm256_hadd_epi32(h[2], h[3]);  // [r4 r4 r6 r6 | r5 r5 r7 r7]
    const __m256i c = _mm256_hadd_epi32(a, b);        // [r0 r2 r4 r6 | r1 r3 r5 r7]
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

template <typename WBlock, bool FAR>
inline void dot_rows8_512(int64_t nb, float* s, const void* const* rows, const typename Q32<WBlock>::X* b) {
    const WBlock* a[8];
    for (int r = 0; r < 8; r++) a[r] = (const WBlock*)rows[r];
    __m256 acc = _mm256_setzero_ps();
    const __m512i offv = _mm512_set1_epi8((char)offset512<WBlock>());
    for (int64_t i = 0; i < nb; i++) {
        const __m512i xz = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)b[i].qs));
        const __m512i X = _mm512_shuffle_i64x2(xz, xz, _MM_SHUFFLE(1, 1, 0, 0));
        __m512i negcorr = _mm512_setzero_si512();
        if (offset512<WBlock>() != 0)
            negcorr = _mm512_sub_epi32(negcorr, _mm512_dpbusd_epi32(_mm512_setzero_si512(), offv, X));
        __m512i p[4];
        for (int k = 0; k < 4; k++) {
            _mm_prefetch((const char*)((const WBlock*)rows[2 * k + 8] + i), _MM_HINT_T1);
            _mm_prefetch((const char*)((const WBlock*)rows[2 * k + 9] + i), _MM_HINT_T1);
            if (FAR) {
                _mm_prefetch((const char*)((const WBlock*)rows[2 * k + 24] + i), _MM_HINT_T1);
                _mm_prefetch((const char*)((const WBlock*)rows[2 * k + 25] + i), _MM_HINT_T1);
            }
            p[k] = _mm512_dpbusd_epi32(negcorr, codes_pair(a[2 * k][i], a[2 * k + 1][i]), X);
        }
        acc = scale_rows8(a, i, b[i], reduce_pairs(p), acc);
    }
    _mm256_storeu_ps(s, acc);
}

template <typename WBlock>
struct Rows8x512 {
    template <bool FAR>
    static void run(int64_t nb, float* s, const void* const* rows, const typename Q32<WBlock>::X* b) {
        dot_rows8_512<WBlock, FAR>(nb, s, rows, b);
    }
};

}  // namespace

void fill_kernels_avx512vnni(KernelTable& t) {
    fill_quant_kernels(t);
    t.vec_dot_rows[TYPE_Q8_0] = vec_dot_rows_32<block_q8_0, Rows8x512<block_q8_0>>;
    t.vec_dot_rows[TYPE_Q4_0] = vec_dot_rows_32<block_q4_0, Rows8x512<block_q4_0>>;
    t.vec_dot_rows[TYPE_Q4_1] = vec_dot_rows_32<block_q4_1, Rows8x512<block_q4_1>>;
    t.vec_dot_rows[TYPE_Q5_0] = vec_dot_rows_32<block_q5_0, Rows8x512<block_q5_0>>;
    t.vec_dot_rows[TYPE_Q5_1] = vec_dot_rows_32<block_q5_1, Rows8x512<block_q5_1>>;
    t.gemm_rows16[TYPE_Q4_0] = gemm_rows16_packed<block_q4_0>;
    t.gemm_rows16[TYPE_Q4_1] = gemm_rows16_packed<block_q4_1>;
    t.gemm_rows16[TYPE_Q8_0] = gemm_rows16_packed<block_q8_0>;
    t.rows16_terms = rows16_terms_q32;
}

}  // namespace optiml
