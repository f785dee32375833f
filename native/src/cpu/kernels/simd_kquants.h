// The k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K against Q8_K activations): one tile kernel that serves
// vec_dot (1 x 1), the matrix-vector product (rows x 1) and the batched product (rows x tokens).
//
// Every format is brought to one shape per 256-element super-block:
//   * 8 chunks of 32 unsigned codes, chunk c meeting activation bytes 32c .. 32c+31;
//   * 16 int16 scales, one per group of 16 elements (s16, laid out for chunk_scales);
//   * 16 int16 correction coefficients (c16), met with the activation's 16 group sums (bsums): the
//     mins of Q2_K/Q4_K/Q5_K (scaled by dmin), or the code offset times the scale for Q3_K (4 * sc)
//     and Q6_K (32 * sc), taken out of the integer sum.
// Arithmetic, per (row, token), super-block after super-block: the super-block's exact integer totals
//     isum = sum_e scale(e) * code_e * x_e   and   corr = c16 . bsums,
// then one float chain:
//     acc = fma(float(isum - corr), d_w * d_x, acc)                                  (Q3_K, Q6_K)
//     acc = fma(float(isum), d_w * d_x, acc); acc = fma(float(corr), -dmin_w * d_x, acc)   (the others).
// The totals are exact whatever the order of their terms, so a kernel may form them in any lanes: this
// file's tiles in 8 int32 lanes per (row, token) added at the super-block's end, simd_gemm_k_rows.h with
// 16 rows in the lanes of a zmm, CUDA's exact product (matmul_exact.cu) across a warp. All give the same
// bits for every (row, token), alone or in any batch, on every x86 level.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>
#include <vector>

#include "quant/quant_impl.h"
#include "simd_gemm.h"
#include "simd_x86.h"

namespace optiml {
namespace {

struct KRow {
    __m256i s16, c16;
    float d, dmin;
};

// Scales are kept so that one shuffle gives chunk c's: word c of the low 128-bit half scales chunk c's
// elements 0..15 (group 2c), word c of the high half its elements 16..31 (group 2c+1). Formats with a
// scale per 16 elements put the even groups low and the odd groups high (split_groups); Q4_K/Q5_K,
// with one per 32, have the same 8 words in both halves.
inline __m256i chunk_scales(__m256i s16, int c) {
    return _mm256_shuffle_epi8(s16, _mm256_set1_epi16((short)((2 * c) | ((2 * c + 1) << 8))));
}

// 16 scale bytes in group order -> even groups' bytes, then odd groups'.
inline __m128i split_groups(__m128i g) {
    return _mm_shuffle_epi8(g, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}

// Q4_K and Q5_K begin with the same 16 bytes: d, dmin (fp16) and 12 bytes of six-bit scales and mins. One
// 128-bit load and a few shuffles unpack them (the scalar unpacking cost a third of the
// matrix-vector product): bytes 0..7 of the result are the scales, 8..15 the mins. The scales stay
// one int16 per 32-element chunk, in both 128-bit halves (chunk_scales); the mins go twice (one per
// 16-element half), as the bsums they meet.
template <class Block>
inline void prepare_k4(const Block& a, KRow& k) {
    static_assert(offsetof(Block, scales) == 4, "d, dmin, then the 12 scale bytes");
    const __m128i head = _mm_loadu_si128((const __m128i*)&a);
    // Low parts: scales 0..3 = q[0..3] & 63, scales 4..7 = q[8..11] & 15, mins 0..3 = q[4..7] & 63,
    // mins 4..7 = q[8..11] >> 4 (q = head + 4).
    const __m128i lo = _mm_shuffle_epi8(head, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i lo_sel = _mm_blend_epi32(lo, _mm_srli_epi16(lo, 4), 0x8);
    const __m128i low = _mm_and_si128(lo_sel, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    // High parts of scales and mins 4..7: the top 2 bits of q[0..3] and q[4..7], as bits 4 and 5.
    const __m128i hi = _mm_shuffle_epi8(head, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i both = _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30)));
    k.s16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
    k.c16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(both, both));
    const __m128 dd = _mm_cvtph_ps(head);
    k.d = _mm_cvtss_f32(dd);
    k.dmin = _mm_cvtss_f32(_mm_movehdup_ps(dd));
}

// The bits of every byte of v from bit `from` up, moved to bit `to` and kept where mask says: one
// shift and one and. A 16-bit shift carries bits across the bytes of a word; those land below bit
// `to` or above the mask's bits (to >= from: the low byte's top bits go to the high byte's low bits),
// where the mask clears them.
inline __m256i bit_to(__m256i v, int from, int to, __m256i mask) {
    const __m256i moved = to >= from ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
    return _mm256_and_si256(moved, mask);
}

template <class WBlock> struct KQ;

template <> struct KQ<block_q4_K> {
    static constexpr bool separate_min = true;
    static void prepare(const block_q4_K& a, KRow& k) { prepare_k4(a, k); }
    // 32 bytes of qs hold chunk 2j in the low nibbles and 2j+1 in the high nibbles.
    static __m256i codes(const block_q4_K& a, int c) {
        const __m256i q = load256(a.qs + 32 * (c / 2));
        return _mm256_and_si256(c & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
    }
};

template <> struct KQ<block_q5_K> {
    static constexpr bool separate_min = true;
    static void prepare(const block_q5_K& a, KRow& k) { prepare_k4(a, k); }
    // As Q4_K, plus the fifth bit: bit c of qh byte l, for element l of chunk c.
    static __m256i codes(const block_q5_K& a, int c) {
        const __m256i q = load256(a.qs + 32 * (c / 2));
        const __m256i lo = _mm256_and_si256(c & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
        return _mm256_or_si256(lo, bit_to(load256(a.qh), c, 4, _mm256_set1_epi8(0x10)));
    }
};

// Q6_K: codes 0..63 (value code - 32), 16 signed 8-bit scales.
template <> struct KQ<block_q6_K> {
    static constexpr bool separate_min = false;
    static void prepare(const block_q6_K& a, KRow& k) {
        const __m128i sc = _mm_loadu_si128((const __m128i*)a.scales);
        k.s16 = _mm256_cvtepi8_epi16(split_groups(sc));
        k.c16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);  // 32 * scale
        k.d = h2f(a.d);
        k.dmin = 0.0f;
    }
    // Half h = c / 4 uses ql[64h ..] and qh[32h ..]; chunk j = c % 4 of it takes the low (j < 2) or
    // high nibbles of ql[64h + 32 (j & 1) ..] and bits 2j, 2j+1 of qh.
    static __m256i codes(const block_q6_K& a, int c) {
        const int h = c / 4, j = c % 4;
        const __m256i l = load256(a.ql + 64 * h + 32 * (j & 1));
        const __m256i lo = _mm256_and_si256(j < 2 ? l : _mm256_srli_epi16(l, 4), _mm256_set1_epi8(0x0F));
        return _mm256_or_si256(lo, bit_to(load256(a.qh + 32 * h), 2 * j, 4, _mm256_set1_epi8(0x30)));
    }
};

// Q3_K: codes 0..7 = 2 low bits | high bit << 2 (value code - 4), 16 six-bit scales minus 32.
template <> struct KQ<block_q3_K> {
    static constexpr bool separate_min = false;
    static void prepare(const block_q3_K& a, KRow& k) {
        uint32_t aux[4];  // the 16 six-bit scales, biased by 32
        quant::q3_K_scale_bytes(a.scales, aux);
        const __m128i sc = _mm_sub_epi8(_mm_loadu_si128((const __m128i*)aux), _mm_set1_epi8(32));
        k.s16 = _mm256_cvtepi8_epi16(split_groups(sc));
        k.c16 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 2);  // 4 * scale
        k.d = h2f(a.d);
        k.dmin = 0.0f;
    }
    // Half h = c / 4: bit pair j = c % 4 of qs[32h ..], and bit c of hmask.
    static __m256i codes(const block_q3_K& a, int c) {
        const int h = c / 4, j = c % 4;
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load256(a.qs + 32 * h), 2 * j), _mm256_set1_epi8(3));
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(load256(a.hmask), c), _mm256_set1_epi8(1));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 2));
    }
};

// Q2_K: 2-bit codes, 16 bytes of (4-bit scale | 4-bit min << 4).
template <> struct KQ<block_q2_K> {
    static constexpr bool separate_min = true;
    static void prepare(const block_q2_K& a, KRow& k) {
        const __m128i b = _mm_loadu_si128((const __m128i*)a.scales);
        k.s16 = _mm256_cvtepu8_epi16(split_groups(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
        k.c16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)));
        k.d = h2f(a.d);
        k.dmin = h2f(a.dmin);
    }
    static __m256i codes(const block_q2_K& a, int c) {
        const int h = c / 4, j = c % 4;
        return _mm256_and_si256(_mm256_srli_epi16(load256(a.qs + 32 * h), 2 * j), _mm256_set1_epi8(3));
    }
};

// Where a tile reads a weight row from: its super-blocks, unpacked as they are met (vec_dot and the
// matrix-vector product meet each block once) ...
template <class WBlock>
struct KBlocks {
    const WBlock* a;
    explicit KBlocks(const void* p) : a((const WBlock*)p) {}
    void prepare(int64_t i, KRow& k) const { KQ<WBlock>::prepare(a[i], k); }
    __m256i codes(int64_t i, const KRow&, int c) const { return KQ<WBlock>::codes(a[i], c); }
    __m256i scales(int64_t, const KRow& k, int c) const { return chunk_scales(k.s16, c); }
};

// ... or the row unpacked beforehand (the batched product meets each block once per token, so it
// unpacks a few rows once and runs all its tokens over them): codes ready to use and the scales as
// KRow keeps them (a shuffle per chunk, shared by the tile's tokens, is cheaper than unpacking and
// reading 8 scale vectors a block).
struct alignas(32) KUnpacked {  // aligned: a 32-byte load across two cache lines costs two
    uint8_t codes[8][32];
    int16_t s16[16];
    int16_t c16[16];
    float d, dmin;
};
struct KFromUnpacked {
    const KUnpacked* u;
    explicit KFromUnpacked(const void* p) : u((const KUnpacked*)p) {}
    void prepare(int64_t i, KRow& k) const {
        k.s16 = load256(u[i].s16);
        k.c16 = load256(u[i].c16);
        k.d = u[i].d;
        k.dmin = u[i].dmin;
    }
    __m256i codes(int64_t i, const KRow&, int c) const { return load256(u[i].codes[c]); }
    __m256i scales(int64_t, const KRow& k, int c) const { return chunk_scales(k.s16, c); }
};

template <class WBlock>
inline void unpack_row_k(const void* row, int64_t nb, KUnpacked* out) {
    const WBlock* a = (const WBlock*)row;
    for (int64_t i = 0; i < nb; i++) {
        KRow k;
        KQ<WBlock>::prepare(a[i], k);
        for (int c = 0; c < 8; c++) {
            _mm256_storeu_si256((__m256i*)out[i].codes[c], KQ<WBlock>::codes(a[i], c));
        }
        _mm256_storeu_si256((__m256i*)out[i].s16, k.s16);
        _mm256_storeu_si256((__m256i*)out[i].c16, k.c16);
        out[i].d = k.d;
        out[i].dmin = k.dmin;
    }
}

// The batched product's copy of its Q8_K activations: the same values, each block 320 bytes with its
// codes first, so that every 32-byte load of them is aligned. Read in place, a 292-byte block's codes
// lie 4 bytes past a multiple of 4: half the loads cross a cache line, which cost the product a third
// of its time.
struct alignas(32) XAligned {
    int8_t qs[256];
    int16_t bsums[16];
    float d;
    uint8_t pad[28];
};
static_assert(sizeof(XAligned) == 320, "XAligned layout");

// A super-block's float step for one (row, token) from its integer lanes (the top of this file): the lanes'
// exact totals, then the fused steps on lane 0 of a vector (no trip through the integer registers).
template <bool kSeparateMin>
inline float k_step(float acc, __m256i sumi, __m256i corr, float dx, float dw, float dmin) {
    __m128 a = _mm_set_ss(acc);
    if (kSeparateMin) {
        const __m256i h = _mm256_hadd_epi32(sumi, corr);  // sumi's pair sums, then corr's, in each half
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const __m128 f = _mm_cvtepi32_ps(_mm_hadd_epi32(q, q));  // float(isum), float(corr), again
        a = _mm_fmadd_ss(f, _mm_set_ss(dw * dx), a);
        a = _mm_fmadd_ss(_mm_movehdup_ps(f), _mm_set_ss(-dmin * dx), a);
    } else {
        const __m256i v = _mm256_sub_epi32(sumi, corr);
        __m128i q = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
        q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 1));
        a = _mm_fmadd_ss(_mm_cvtepi32_ps(q), _mm_set_ss(dw * dx), a);
    }
    return _mm_cvtss_f32(a);
}

// The totals of 4 vectors of 8 int32 lanes (exact: any order of the terms gives them) through one tree of
// horizontal adds: out[j] the sum of v[j]'s lanes.
inline __m128i hsum4_epi32(const __m256i* v) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The float steps of an NR x NT tile's super-block: its integer lanes sumi (scaled codes) and, met with
// each token's bsums, the correction coefficients c16 of each row, into the tile's accumulators.
template <bool kSeparateMin, int NR, int NT, class XBlock>
inline void k_tile_steps(float (&acc)[NR][NT], const __m256i (&sumi)[NR][NT], const __m256i* c16, const float* dw,
                         const float* dmin, const XBlock* const* b, int64_t i) {
    __m256i corr[NR][NT];
    for (int t = 0; t < NT; t++) {
        const __m256i bs = load256(b[t][i].bsums);
        for (int r = 0; r < NR; r++) corr[r][t] = _mm256_madd_epi16(c16[r], bs);
    }
    if constexpr ((NR * NT) % 4 == 0) {
        // Four (row, token) pairs at a time: their totals by one tree, then k_step's operations lane by
        // lane (the same bits), where one pair at a time the float steps cost as much as the integers.
        alignas(16) float dwp[NR * NT], dxp[NR * NT], dmp[NR * NT];
        for (int t = 0; t < NT; t++) {
            const float dx = b[t][i].d;
            for (int r = 0; r < NR; r++) dwp[r * NT + t] = dw[r], dmp[r * NT + t] = -dmin[r], dxp[r * NT + t] = dx;
        }
        const __m256i* si = &sumi[0][0];
        const __m256i* co = &corr[0][0];
        float* a = &acc[0][0];
        for (int j = 0; j < NR * NT; j += 4) {
            const __m128 dx = _mm_load_ps(dxp + j);
            __m128 v = _mm_loadu_ps(a + j);
            if (kSeparateMin) {
                v = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4_epi32(si + j)), _mm_mul_ps(_mm_load_ps(dwp + j), dx), v);
                v = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4_epi32(co + j)), _mm_mul_ps(_mm_load_ps(dmp + j), dx), v);
            } else {
                __m256i d[4];
                for (int q = 0; q < 4; q++) d[q] = _mm256_sub_epi32(si[j + q], co[j + q]);
                v = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4_epi32(d)), _mm_mul_ps(_mm_load_ps(dwp + j), dx), v);
            }
            _mm_storeu_ps(a + j, v);
        }
    } else {
        for (int t = 0; t < NT; t++) {
            const float dx = b[t][i].d;
            for (int r = 0; r < NR; r++)
                acc[r][t] = k_step<kSeparateMin>(acc[r][t], sumi[r][t], corr[r][t], dx, dw[r], dmin[r]);
        }
    }
}

// NR rows x NT tokens over nb super-blocks: s[t * s_stride + r] = dot(row r, x_t), rows read
// through Src, activation blocks of type XBlock (block_q8_K or XAligned). ahead[r] is prefetched in step,
// and with FAR so is ahead[r + 12] (as dot_rows8_32 in simd_q32.h).
template <class WBlock, class Src, int NR, int NT, class XBlock = block_q8_K, bool FAR = false>
inline void tile_k(int64_t nb, float* s, int64_t s_stride, const void* const* rows, const void* const* ahead,
                   const uint8_t* x, size_t x_stride) {
    typedef KQ<WBlock> K;
    const Src* src[NR];
    alignas(Src) unsigned char src_mem[NR][sizeof(Src)];
    const XBlock* b[NT];
    float acc[NR][NT] = {};
    for (int r = 0; r < NR; r++) src[r] = new (src_mem[r]) Src(rows[r]);
    for (int t = 0; t < NT; t++) b[t] = (const XBlock*)(x + t * x_stride);
    for (int64_t i = 0; i < nb; i++) {
        KRow k[NR];
        for (int r = 0; r < NR; r++) {
            if (ahead) {
                const char* p = (const char*)&((const WBlock*)ahead[r])[i];
                for (size_t o = 0; o < sizeof(WBlock); o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
                if (FAR) {
                    const char* f = (const char*)&((const WBlock*)ahead[r + 12])[i];
                    for (size_t o = 0; o < sizeof(WBlock); o += 64) _mm_prefetch(f + o, _MM_HINT_T1);
                }
            }
            src[r]->prepare(i, k[r]);
        }
        // With fewer than 4 (row, token) pairs their chains of 8 multiply-adds would set the pace: two
        // chains each (even and odd chunks), added at the end (exact).
        constexpr int kChains = NR * NT < 4 ? 2 : 1;
        __m256i sumi[NR][NT], sumi2[kChains][NR][NT];
        for (int h = 0; h < kChains; h++)
            for (int r = 0; r < NR; r++)
                for (int t = 0; t < NT; t++) sumi2[h][r][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m256i xc[NT];
            for (int t = 0; t < NT; t++) xc[t] = load256(b[t][i].qs + 32 * c);
            for (int r = 0; r < NR; r++) {
                const __m256i q = src[r]->codes(i, k[r], c);
                const __m256i sc = src[r]->scales(i, k[r], c);
                for (int t = 0; t < NT; t++) {
                    __m256i& acc_c = sumi2[c % kChains][r][t];
                    acc_c = dot_u8s8_scaled(acc_c, q, xc[t], sc);
                    keep_chain(acc_c);
                }
            }
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++)
                sumi[r][t] = kChains == 2 ? _mm256_add_epi32(sumi2[0][r][t], sumi2[kChains - 1][r][t]) : sumi2[0][r][t];
        __m256i c16[NR];
        float dw[NR], dmin[NR];
        for (int r = 0; r < NR; r++) c16[r] = k[r].c16, dw[r] = k[r].d, dmin[r] = k[r].dmin;
        k_tile_steps<K::separate_min>(acc, sumi, c16, dw, dmin, b, i);
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) s[t * s_stride + r] = acc[r][t];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// tile_k over unpacked rows with 512-bit integer steps (AVX-512 VNNI): a zmm holds chunks 2p and 2p+1, its
// low half summing the even chunks and its high half the odd ones, the halves added at the super-block's
// end. The integer totals are exact, so they are tile_k's, and so are the float steps after them: the
// same bits as every other level, at half the multiplier instructions per code. (Over packed blocks, their
// codes joined two chunks at a time, vec_dot ran a third slower than tile_k.)
template <class WBlock, int NR, int NT>
inline void tile_k_unpacked512(int64_t nb, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x,
                               size_t x_stride) {
    typedef KQ<WBlock> K;
    const KUnpacked* u[NR];
    const XAligned* b[NT];
    float acc[NR][NT] = {};
    for (int r = 0; r < NR; r++) u[r] = (const KUnpacked*)rows[r];
    for (int t = 0; t < NT; t++) b[t] = (const XAligned*)(x + t * x_stride);
    for (int64_t i = 0; i < nb; i++) {
        __m512i sumi[NR][NT], s2[NR];
        for (int r = 0; r < NR; r++) {
            const __m256i sc = load256(u[r][i].s16);
            s2[r] = _mm512_inserti64x4(_mm512_castsi256_si512(sc), sc, 1);
            for (int t = 0; t < NT; t++) sumi[r][t] = _mm512_setzero_si512();
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            // chunk_scales of chunks 2p (low half) and 2p + 1 (high half)
            const short wa = (short)((4 * p) | ((4 * p + 1) << 8)), wb = (short)((4 * p + 2) | ((4 * p + 3) << 8));
            const __m512i ctl = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(wa)),
                                                   _mm256_set1_epi16(wb), 1);
            __m512i xc[NT];
            for (int t = 0; t < NT; t++) xc[t] = _mm512_loadu_si512(b[t][i].qs + 64 * p);
            for (int r = 0; r < NR; r++) {
                const __m512i q = _mm512_loadu_si512(u[r][i].codes[2 * p]);
                const __m512i sc = _mm512_shuffle_epi8(s2[r], ctl);
                for (int t = 0; t < NT; t++) {
                    sumi[r][t] = _mm512_dpwssd_epi32(sumi[r][t], _mm512_maddubs_epi16(q, xc[t]), sc);
                    __asm__("" : "+v"(sumi[r][t]));  // (keep_chain's: NR x NT independent chains)
                }
            }
        }
        __m256i si[NR][NT], c16[NR];
        float dw[NR], dmin[NR];
        for (int r = 0; r < NR; r++) {
            c16[r] = load256(u[r][i].c16), dw[r] = u[r][i].d, dmin[r] = u[r][i].dmin;
            for (int t = 0; t < NT; t++)
                si[r][t] = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r][t]), _mm512_extracti64x4_epi64(sumi[r][t], 1));
        }
        k_tile_steps<K::separate_min>(acc, si, c16, dw, dmin, b, i);
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) s[t * s_stride + r] = acc[r][t];
}
#endif

// vec_dot's tile: rows read straight from their super-blocks.
template <class WBlock>
struct KTile {
    static const void* const* prepare(int64_t, const void* const* rows, int64_t) { return rows; }
    template <int NR, int NT>
    static void run(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
        tile_k<WBlock, KBlocks<WBlock>, NR, NT>(n / OPTIML_QK_K, s, s_stride, rows, nullptr, x, x_stride);
    }
};


// The batched product's tile: prepare unpacks the tile's rows once (into a buffer of the calling
// thread), run reads them from there for every token, with activations in XAligned blocks.
template <class WBlock>
struct KUnpackedTile {
    static const void* const* prepare(int64_t n, const void* const* rows, int64_t n_rows) {
        static thread_local std::vector<KUnpacked> buf;
        static thread_local LocalVector<const void*> ptrs;
        const int64_t nb = n / OPTIML_QK_K;
        if ((int64_t)buf.size() < n_rows * nb) buf.resize(n_rows * nb);
        if ((int64_t)ptrs.size() < n_rows) ptrs.resize(n_rows);
        for (int64_t r = 0; r < n_rows; r++) {
            unpack_row_k<WBlock>(rows[r], nb, buf.data() + r * nb);
            ptrs[r] = buf.data() + r * nb;
        }
        return ptrs.data();
    }
    template <int NR, int NT>
    static void run(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        tile_k_unpacked512<WBlock, NR, NT>(n / OPTIML_QK_K, s, s_stride, rows, x, x_stride);
#else
        tile_k<WBlock, KFromUnpacked, NR, NT, XAligned>(n / OPTIML_QK_K, s, s_stride, rows, nullptr, x, x_stride);
#endif
    }
};

// Q8_K activation rows into XAligned blocks (gemm_x_fn).
inline void gemm_x_k(int64_t n, const void* x, size_t x_stride, int64_t n_tok, void* xa) {
    const int64_t nb = n / OPTIML_QK_K;
    for (int64_t t = 0; t < n_tok; t++) {
        const block_q8_K* b = (const block_q8_K*)((const uint8_t*)x + t * x_stride);
        XAligned* o = (XAligned*)xa + t * nb;
        for (int64_t i = 0; i < nb; i++) {
            std::memcpy(o[i].qs, b[i].qs, sizeof(o[i].qs));
            std::memcpy(o[i].bsums, b[i].bsums, sizeof(o[i].bsums));
            o[i].d = b[i].d;
        }
    }
}
static_assert(sizeof(XAligned) == kGemmXBlock, "gemm_x_row counts XAligned blocks");

// The batched product over activations already in XAligned blocks (gemm_pre_fn). Rows are unpacked 16
// at a time (40 KiB for 2048 columns), once for every token, which go over them 64 at a time (their
// activations, 160 KiB, stay in L2 while the 16 rows go through them).
template <class WBlock, int NR, int NT>
void gemm_pre_k(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                int64_t n_tok) {
    constexpr int64_t kRows = 16, kTokens = 64;
    const size_t xa_row = gemm_x_row(n);
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRows) {
        const int64_t nr = n_rows - r0 < kRows ? n_rows - r0 : kRows;
        const void* const* tr = KUnpackedTile<WBlock>::prepare(n, rows + r0, nr);
        for (int64_t t0 = 0; t0 < n_tok; t0 += kTokens) {
            const int64_t nt = n_tok - t0 < kTokens ? n_tok - t0 : kTokens;
            gemm_tiles<KUnpackedTile<WBlock>, NR, NT>(n, s + t0 * ldo + r0, ldo, tr, nr,
                                                       (const uint8_t*)xa + t0 * xa_row, xa_row, nt);
        }
    }
}

// The batched product (gemm_fn): the activations copied into XAligned blocks (a buffer of the calling
// thread; a copy per call, read by every row of it), then the level's gemm_pre over them.
template <class WBlock, int NR, int NT, gemm_pre_fn kPre = gemm_pre_k<WBlock, NR, NT>>
void gemm_k(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
            int64_t n_tok) {
    static thread_local std::vector<XAligned> xa;
    const int64_t nb = n / OPTIML_QK_K;
    if ((int64_t)xa.size() < n_tok * nb) xa.resize(n_tok * nb);
    gemm_x_k(n, x, x_stride, n_tok, xa.data());
    kPre(n, s, n_rows, rows, n_rows, xa.data(), n_tok);
}

// Matrix-vector product (vec_dot_rows_fn); every row's value is its vec_dot, bit for bit. Rows go 4 at
// a time sharing each activation super-block, the 4 rows after them prefetched in step, then the last
// ones one by one. Four rows' float steps run as one vector (k_tile_steps), which one row's cannot:
// measured against one row at a time (tools/bench/kernels.py, 2 threads, Zen 4 with AVX-512), 2048x2048
// in cache 1.2x (Q4_K), 1.0x (Q6_K), 1.4x (Q3_K); streamed from memory (4096x11008, 5632x2048) the same
// speed, where with the former float steps one row at a time had streamed faster. Rows of up to 2 KiB
// also fetch the rows four tiles ahead: one tile is too little lead for the memory latency (Q4_K
// streamed, 2 threads: 768 columns 22 -> 30-36 GB/s, 2048 columns 26-33 -> 37; Q6_K 768 columns 24 ->
// 29-35; rows of 2.3 and 6 KiB gained nothing).
template <class WBlock>
void vec_dot_rows_k(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    const uint8_t* xb = (const uint8_t*)x;
    const int64_t nb = n / OPTIML_QK_K;
    int64_t r = 0;
    typedef KBlocks<WBlock> Src;
    if ((size_t)nb * sizeof(WBlock) <= 2048)
        for (; r + 4 <= n_rows; r += 4)
            tile_k<WBlock, Src, 4, 1, block_q8_K, true>(nb, s + r, 1, rows + r, rows + r + 4, xb, 0);
    for (; r + 4 <= n_rows; r += 4) tile_k<WBlock, Src, 4, 1>(nb, s + r, 1, rows + r, rows + r + 4, xb, 0);
    for (; r < n_rows; r++) tile_k<WBlock, Src, 1, 1>(nb, s + r, 1, rows + r, rows + r + 4, xb, 0);
}

}  // namespace
}  // namespace optiml
