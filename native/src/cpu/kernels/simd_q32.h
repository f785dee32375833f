// The 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 against Q8_0/Q8_1 activations): vec_dot
// (one row, one token) and the matrix-vector product (rows x 1); the batched product is in
// simd_gemm_q32.h.
//
// Per (row, token), each block's integer dot is summed exactly, converted to float and accumulated
// block after block as acc = fma(float(isum), d_w * d_x, acc) (then acc = fma(m_w, s_x, acc) for
// Q4_1/Q5_1). Every kernel of these formats, batched or not, runs exactly that, so a token's values do
// not depend on what else is in its batch. llama.cpp sums the same terms in another order (8 float
// lanes per row, added at the end), so results differ from its in the last bits.
#pragma once

#include "simd_x86.h"

namespace optiml {
namespace {

// A weight block's codes: unsigned bytes whose values are code - offset (Q4_0, Q5_0) or code
// (Q4_1, Q5_1, whose mins are added apart), or signed bytes (Q8_0). Signed values meet the activation
// as |q| . (x with q's sign), which keeps vpmaddubsw's u8 x s8 form and is exact for x in [-127, 127]
// (all Q8_0/Q8_1 conversion produces). The offset formats keep their unsigned codes and take the
// offset back out with a correction that depends on the activation block only ((q - off) . x =
// q . x - off * x summed), shared by every row.
template <class WBlock> struct Q32;
template <> struct Q32<block_q4_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 8;
    static constexpr bool has_min = false, is_signed = false;
    static __m256i codes(const block_q4_0& a) { return unpack_nibbles_16(a.qs); }
};
template <> struct Q32<block_q5_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 16;
    static constexpr bool has_min = false, is_signed = false;
    static __m256i codes(const block_q5_0& a) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
    }
};
template <> struct Q32<block_q4_1> {
    typedef block_q8_1 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = true, is_signed = false;
    static __m256i codes(const block_q4_1& a) { return unpack_nibbles_16(a.qs); }
};
template <> struct Q32<block_q5_1> {
    typedef block_q8_1 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = true, is_signed = false;
    static __m256i codes(const block_q5_1& a) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
    }
};
template <> struct Q32<block_q8_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = false, is_signed = true;
    static __m256i codes(const block_q8_0& a) { return load256(a.qs); }
};
// MXFP4: each nibble looked up (vpshufb, 16 entries) in the table of doubled E2M1 values plus 12, so the
// codes are unsigned (0..24) and the offset 12 comes back out as for Q4_0.
inline __m256i mxfp4_lut() {
    const __m128i t = _mm_loadu_si128((const __m128i*)kMxfp4Values);
    const __m128i u = _mm_add_epi8(t, _mm_set1_epi8(12));
    return _mm256_setr_m128i(u, u);
}
template <> struct Q32<block_mxfp4> {
    typedef block_q8_0 X;
    static constexpr int offset = 12;
    static constexpr bool has_min = false, is_signed = false;
    static __m256i codes(const block_mxfp4& a) { return _mm256_shuffle_epi8(mxfp4_lut(), unpack_nibbles_16(a.qs)); }
};

// IQ4_NL: each nibble looked up (vpshufb) in the table of its 16 signed levels; the values meet the activation
// signed, as Q8_0's (|v| <= 127).
inline __m256i iq4nl_lut() {
    const __m128i t = _mm_loadu_si128((const __m128i*)kIq4nlValues);
    return _mm256_setr_m128i(t, t);
}
template <> struct Q32<block_iq4_nl> {
    typedef block_q8_0 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = false, is_signed = true;
    static __m256i codes(const block_iq4_nl& a) { return _mm256_shuffle_epi8(iq4nl_lut(), unpack_nibbles_16(a.qs)); }
};

// A weight block's scale: its fp16 d, or MXFP4's E8M0 half-scale.
template <class WBlock> inline float scale_of(const WBlock& a) { return h2f(a.d); }
inline float scale_of(const block_mxfp4& a) { return e8m0_to_fp32_half(a.e); }
// e8m0_to_fp32_half of 8 int32 lanes of E8M0 bytes.
inline __m256 e8m0_half_ps(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i denormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, denormal, small));
}

inline float min_of(const block_q4_1& a) { return h2f(a.m); }
inline float min_of(const block_q5_1& a) { return h2f(a.m); }
template <class WBlock> inline float min_of(const WBlock&) { return 0.0f; }
// Lane r of the result: the sum of p[r]'s 8 lanes (exact: integers).
inline __m256i reduce8_epi32(const __m256i p[8]) {
    const __m256i a0 = _mm256_hadd_epi32(p[0], p[1]), a1 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i a2 = _mm256_hadd_epi32(p[4], p[5]), a3 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// Block i's integer dot of one row against the activation block (xv its bytes, base the per-token
// correction of offset formats' unsigned codes), as 8 int32 lanes.
template <class WBlock>
inline __m256i block_lanes(const WBlock& a, __m256i xv, __m256i base) {
    const __m256i v = Q32<WBlock>::codes(a);
    return Q32<WBlock>::is_signed ? dot_u8s8(base, _mm256_sign_epi8(v, v), _mm256_sign_epi8(xv, v)) : dot_u8s8(base, v, xv);
}
template <class WBlock>
inline __m256i block_base(__m256i xv) {
    typedef Q32<WBlock> Q;
    if (Q::offset == 0) return _mm256_setzero_si256();
    const __m256i z = _mm256_setzero_si256();
    return _mm256_sub_epi32(z, dot_u8s8(z, _mm256_set1_epi8((char)Q::offset), xv));
}
// An activation block's s = d * sum(q) (Q8_1; 0 for Q8_0, which pairs with formats without mins).
inline fp16_t sum_of(const block_q8_1& b) { return b.s; }
inline fp16_t sum_of(const block_q8_0&) { return 0; }
template <class XBlock> inline float sum_scale(const XBlock& b) { return h2f(sum_of(b)); }

// The 32-element formats' dot product, one row against one token. Per block the integer dot is
// summed exactly, then acc = fma(float(isum), d_w * d_x, acc), and for Q4_1/Q5_1 acc = fma(m_w, s_x,
// acc), block after block: the arithmetic of every lane of the batched product (simd_gemm_q32.h), so
// a token gets the same bits alone (this, and the matrix-vector kernel below) or in a batch. (llama.cpp
// instead keeps 8 float lanes per row and sums them at the end; the two differ in the last bits.)
template <class WBlock>
inline float dot_row_32(int64_t nb, const WBlock* a, const typename Q32<WBlock>::X* b) {
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const __m256i xv = load256(b[i].qs);
        const int isum = hsum_epi32(block_lanes(a[i], xv, block_base<WBlock>(xv)));
        acc = std::fma((float)isum, scale_of(a[i]) * h2f(b[i].d), acc);
        if constexpr (Q32<WBlock>::has_min) acc = std::fma(min_of(a[i]), sum_scale(b[i]), acc);
    }
    return acc;
}

template <class WBlock>
void vec_dot_32(int64_t n, float* s, const void* w, const void* x) {
    *s = dot_row_32<WBlock>(n / 32, (const WBlock*)w, (const typename Q32<WBlock>::X*)x);
}

// Block i's scales (and mins; zero for formats without) of 8 rows as floats, lane r: row a[r]. Every
// format's block begins with its fp16 scale (then the min, where it has one): a 16-byte load per row
// and three rounds of interleaving gather them (a word inserted per row cost twice the instructions).
template <class WBlock>
inline void scales_rows8(const WBlock* const* a, int64_t i, __m256& d, __m256& m) {
    static_assert(sizeof(WBlock) >= 16, "a block holds 16 bytes from its start");
    __m128i h[8];
    for (int r = 0; r < 8; r++) h[r] = _mm_loadu_si128((const __m128i*)&a[r][i]);
    // Words: (d, m) of rows 0,1 | 2,3 | ... -> d0..d3 m0..m3 | d4..d7 m4..m7 -> d0..d7 and m0..m7.
    const __m128i u01 = _mm_unpacklo_epi16(h[0], h[1]), u23 = _mm_unpacklo_epi16(h[2], h[3]);
    const __m128i u45 = _mm_unpacklo_epi16(h[4], h[5]), u67 = _mm_unpacklo_epi16(h[6], h[7]);
    const __m128i w03 = _mm_unpacklo_epi32(u01, u23), w47 = _mm_unpacklo_epi32(u45, u67);
    d = _mm256_cvtph_ps(_mm_unpacklo_epi64(w03, w47));
    m = Q32<WBlock>::has_min ? _mm256_cvtph_ps(_mm_unpackhi_epi64(w03, w47)) : _mm256_setzero_ps();
}

// MXFP4's: the 8 rows' E8M0 bytes gathered into one word by the integer unit (the vector unit is the
// kernel's bottleneck: inserting them lane by lane cost it a tenth), then converted; no mins.
inline void scales_rows8(const block_mxfp4* const* a, int64_t i, __m256& d, __m256& m) {
    uint64_t e = 0;
    for (int r = 0; r < 8; r++) e |= (uint64_t)a[r][i].e << (8 * r);
    d = e8m0_half_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e)));
    m = _mm256_setzero_ps();
}

// Block i's float steps for 8 rows side by side (lane r: row a[r]), isum their exact block sums with
// token block x: dot_row_32's arithmetic in each lane.
template <class WBlock>
inline __m256 scale_rows8(const WBlock* const* a, int64_t i, const typename Q32<WBlock>::X& x, __m256i isum,
                          __m256 acc) {
    __m256 d, m;
    scales_rows8(a, i, d, m);
    const __m256 scale = _mm256_mul_ps(d, _mm256_cvtph_ps(_mm_set1_epi16((short)x.d)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
    if constexpr (Q32<WBlock>::has_min) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(sum_scale(x)), acc);
    return acc;
}

// 8 rows against one token, the rows side by side in the lanes of one float accumulator (each lane
// runs dot_row_32's arithmetic). ahead[r] is read in step a pass later, and with FAR so is far[r] three
// passes later: several rows read in step are short interleaved streams that the hardware prefetcher
// follows poorly.
template <class WBlock, bool FAR>
inline void dot_rows8_32(int64_t nb, float* s, const void* const* rows, const typename Q32<WBlock>::X* b) {
    const WBlock* a[8];
    for (int r = 0; r < 8; r++) a[r] = (const WBlock*)rows[r];
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i xv = load256(b[i].qs);
        const __m256i base = block_base<WBlock>(xv);
        __m256i p[8];
        for (int r = 0; r < 8; r++) {
            _mm_prefetch((const char*)((const WBlock*)rows[r + 8] + i), _MM_HINT_T1);
            if (FAR) _mm_prefetch((const char*)((const WBlock*)rows[r + 24] + i), _MM_HINT_T1);
            p[r] = block_lanes(a[r][i], xv, base);
        }
        acc = scale_rows8(a, i, b[i], reduce8_epi32(p), acc);
    }
    _mm256_storeu_ps(s, acc);
}

// The 256-bit 8-row kernel, as vec_dot_rows_32's Rows8 (kernels_avx512vnni.cpp has a 512-bit one).
template <class WBlock>
struct Rows8x256 {
    template <bool FAR>
    static void run(int64_t nb, float* s, const void* const* rows, const typename Q32<WBlock>::X* b) {
        dot_rows8_32<WBlock, FAR>(nb, s, rows, b);
    }
};

// Matrix-vector product (vec_dot_rows_fn): rows 8 at a time, the last ones one by one; every row's
// value is its vec_dot, bit for bit. Short rows (the predictors' n_ff x rank matrices, output layers)
// also fetch the rows three passes ahead: a pass of 8 is too little lead for the memory latency.
template <class WBlock, class Rows8 = Rows8x256<WBlock>>
void vec_dot_rows_32(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    typedef typename Q32<WBlock>::X XBlock;
    const int64_t nb = n / 32;
    const XBlock* b = (const XBlock*)x;
    int64_t r = 0;
    if ((size_t)nb * sizeof(WBlock) < 1024)
        for (; r + 8 <= n_rows; r += 8) Rows8::template run<true>(nb, s + r, rows + r, b);
    for (; r + 8 <= n_rows; r += 8) Rows8::template run<false>(nb, s + r, rows + r, b);
    for (; r < n_rows; r++) s[r] = dot_row_32<WBlock>(nb, (const WBlock*)rows[r], b);
}

}  // namespace
}  // namespace optiml
