// The batched product (gemm) of the 32-element block formats with 16 weight rows in the lanes of a zmm,
// for AVX-512VL with VNNI (vpdpbusd exact for any unsigned codes), used from 32 tokens per call up.
//
// simd_gemm_q32.h puts 8 tokens in the lanes and broadcasts each row's codes, so every (row, block)
// unpacks its nibbles and converts its scales again for each group of 8 tokens: with the float steps
// about 26 vector operations per (row, 8 tokens, block), of which 8 are the integer dots. Here 16 rows'
// codes are transposed once per call into a panel of unsigned group vectors and float scales, and each
// token meets them with its activation dwords broadcast straight from its block (vpdpbusd's memory
// operand): 8 dots and 3-4 float steps per (16 rows, token, block), the panel's cost shared by every
// token of the call.
//
// The panel is worth its cost only when enough tokens share it: measured with tools/bench_kernels.py
// (Zen 4, 2 threads, weights streamed from memory, SmolLM2's shapes), against the token-lane kernel,
// 8 tokens: 0.64-0.83x; 16: 0.81-1.05x; 32: 0.97-1.45x; 64: 1.13-1.34x. So gemm_q32_vnni below takes this
// kernel from kRowLaneTokens tokens (prompt processing's 64-token blocks) and the token-lane one
// under it (batched decoding).
//
// Arithmetic: per (row, token), block after block, the exact integer dot of the block (unsigned codes,
// the offset taken back out as -offset * sum(x)), then acc = fma(float(isum), d_w * d_x, acc), then for
// Q4_1/Q5_1 acc = fma(m_w, s_x, acc): what vec_dot, the matrix-vector kernels and simd_gemm_q32.h
// compute, so a token gets the same bits alone, in any batch, and through either kernel.
#pragma once

#include <vector>

#include "simd_gemm_q32.h"

namespace optiml {
namespace {

constexpr int64_t kRowLaneTokens = 32;

// Block i of 16 rows: g[k] holds group k (elements 4k..4k+3) of row r in int32 lane r, as unsigned codes
// (Q8_0 + 128); d and m the rows' scales and mins.
struct RowPanel {
    __m512i g[8];
    __m512 d, m;
};

// Rows a[0..7]'s block i: g[k] group k of row r in lane r, d and m their scales and mins. Nibble
// formats transpose their packed dwords (dword k holds groups k and k + 4 in its low and high nibbles)
// and split afterwards: 12 shuffles and 12 logic operations per 8 rows instead of unpacking each row
// first. The others unpack each row to 32 codes and transpose those.
template <class WBlock>
inline void build_rows8(const WBlock* const a[8], int64_t i, __m256i g[8], __m256& d, __m256& m) {
    typedef Q32<WBlock> Q;
    if constexpr (std::is_same<WBlock, block_q4_0>::value || std::is_same<WBlock, block_q4_1>::value) {
        __m256i y[4];
        for (int j = 0; j < 4; j++)
            y[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a[j][i].qs)),
                                           _mm_loadu_si128((const __m128i*)a[j + 4][i].qs), 1);
        const __m256i a0 = _mm256_unpacklo_epi32(y[0], y[1]), a1 = _mm256_unpackhi_epi32(y[0], y[1]);
        const __m256i a2 = _mm256_unpacklo_epi32(y[2], y[3]), a3 = _mm256_unpackhi_epi32(y[2], y[3]);
        const __m256i t[4] = {_mm256_unpacklo_epi64(a0, a2), _mm256_unpackhi_epi64(a0, a2),
                              _mm256_unpacklo_epi64(a1, a3), _mm256_unpackhi_epi64(a1, a3)};
        const __m256i lo4 = _mm256_set1_epi8(0x0F);
        for (int k = 0; k < 4; k++) {
            g[k] = _mm256_and_si256(t[k], lo4);
            g[k + 4] = _mm256_and_si256(_mm256_srli_epi16(t[k], 4), lo4);
        }
    } else {
        for (int r = 0; r < 8; r++) {
            g[r] = Q::codes(a[r][i]);
            if (Q::is_signed) g[r] = _mm256_xor_si256(g[r], _mm256_set1_epi8((char)0x80));
        }
        transpose8_epi32(g);
    }
    scales_rows8(a, i, d, m);
}

// Rows a[0..15]'s block i into p (two halves of 8 rows built in ymm).
template <class WBlock>
inline void build_row_panel(const WBlock* const a[16], int64_t i, RowPanel& p) {
    __m256i g0[8], g1[8];
    __m256 d0, m0, d1, m1;
    build_rows8<WBlock>(a, i, g0, d0, m0);
    build_rows8<WBlock>(a + 8, i, g1, d1, m1);
    for (int k = 0; k < 8; k++) p.g[k] = _mm512_inserti64x4(_mm512_castsi256_si512(g0[k]), g1[k], 1);
    p.d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    p.m = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
}

// Per (token, block) activation terms: the scale, the Q8_1 sum d * sum(q) (min formats) and -offset *
// sum(q) (offset formats; Q8_0 weights count as offset 128).
struct TokenTerms {
    std::vector<float> dx, sx;
    std::vector<int32_t> nc;
};

template <class WBlock>
inline void token_terms(const uint8_t* x, size_t x_stride, int64_t n_tok, int64_t nb, TokenTerms& tt) {
    typedef Q32<WBlock> Q;
    typedef typename Q::X XBlock;
    constexpr int offset = Q::is_signed ? 128 : Q::offset;
    tt.dx.resize(n_tok * nb);
    tt.sx.resize(n_tok * nb);
    tt.nc.resize(n_tok * nb);
    for (int64_t t = 0; t < n_tok; t++) {
        const XBlock* b = (const XBlock*)(x + t * x_stride);
        for (int64_t i = 0; i < nb; i++) {
            tt.dx[t * nb + i] = h2f(b[i].d);
            tt.sx[t * nb + i] = Q::has_min ? h2f(sum_of(b[i])) : 0.0f;
            if (offset) {
                // sum(q) of the signed bytes: their unsigned sum (+ 128 each) by vpsadbw, less 32 * 128.
                const __m256i u = _mm256_xor_si256(load256(b[i].qs), _mm256_set1_epi8((char)0x80));
                const __m256i s4 = _mm256_sad_epu8(u, _mm256_setzero_si256());
                const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
                const int32_t sum = (int32_t)(_mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 2)) - 32 * 128;
                tt.nc[t * nb + i] = -offset * sum;
            }
        }
    }
}

// Rows to fetch into L2 while a tile runs: the next panel's, a line of each as the tile's blocks reach
// it. The panel is built in a short burst with nothing to overlap its loads; the tile is long and reads
// only the panel and the activations, so its time hides the next rows' memory latency, spread out
// (a burst of every line at once overflows the outstanding misses and loses most of them).
struct Ahead {
    const void* const* rows = nullptr;
    int64_t n = 0;
    int64_t block_size = 0;
};

// The panel's 16 rows against T tokens (blocks xb[t], terms at dx/sx/nc + term0[t]): out[t] lane r =
// row r . token t.
template <class WBlock, int T>
inline void row_tile(int64_t nb, const RowPanel* p, const typename Q32<WBlock>::X* const* xb, const TokenTerms& tt,
                     const int64_t* term0, const Ahead& ahead, __m512 out[T]) {
    typedef Q32<WBlock> Q;
    constexpr bool offset = Q::offset != 0 || Q::is_signed;
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    int64_t line = -1;
    for (int64_t i = 0; i < nb; i++) {
        if (ahead.rows) {
            const int64_t end = (i + 1) * ahead.block_size - 1;
            if (end / 64 != line) {
                line = end / 64;
                for (int64_t r = 0; r < ahead.n; r++) _mm_prefetch((const char*)ahead.rows[r] + end, _MM_HINT_T1);
            }
        }
        __m512i isum[T];
        for (int t = 0; t < T; t++)
            isum[t] = offset ? _mm512_set1_epi32(tt.nc[term0[t] + i]) : _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {
            const __m512i w = p[i].g[k];
            for (int t = 0; t < T; t++) {
                int32_t xk;
                std::memcpy(&xk, (const uint8_t*)xb[t][i].qs + 4 * k, 4);
                isum[t] = _mm512_dpbusd_epi32(isum[t], w, _mm512_set1_epi32(xk));
            }
        }
        for (int t = 0; t < T; t++) {
            const __m512 dd = _mm512_mul_ps(p[i].d, _mm512_set1_ps(tt.dx[term0[t] + i]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), dd, acc[t]);
            if constexpr (Q::has_min) acc[t] = _mm512_fmadd_ps(p[i].m, _mm512_set1_ps(tt.sx[term0[t] + i]), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = acc[t];
}

// Tokens t0..t0 + T - 1 against the panel, into s (the panel's nr live rows from row r0).
template <class WBlock, int T>
inline void row_tile_store(int64_t nb, const RowPanel* p, const uint8_t* x, size_t x_stride, int64_t t0,
                           const TokenTerms& tt, const Ahead& ahead, float* s, int64_t n_rows, int64_t r0, int64_t nr) {
    typedef typename Q32<WBlock>::X XBlock;
    const XBlock* xb[T];
    int64_t term0[T];
    for (int t = 0; t < T; t++) {
        xb[t] = (const XBlock*)(x + (t0 + t) * x_stride);
        term0[t] = (t0 + t) * nb;
    }
    __m512 out[T];
    row_tile<WBlock, T>(nb, p, xb, tt, term0, ahead, out);
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(s + (t0 + t) * n_rows + r0, live, out[t]);
}

// The last n_tok % 8 tokens: a tile of exactly that many (T counts down to it).
template <class WBlock, int T = 7>
inline void row_tile_rest(int64_t n_rest, int64_t nb, const RowPanel* p, const uint8_t* x, size_t x_stride,
                          int64_t t0, const TokenTerms& tt, const Ahead& ahead, float* s, int64_t n_rows, int64_t r0,
                          int64_t nr) {
    if constexpr (T > 0) {
        if (n_rest == T) row_tile_store<WBlock, T>(nb, p, x, x_stride, t0, tt, ahead, s, n_rows, r0, nr);
        else row_tile_rest<WBlock, T - 1>(n_rest, nb, p, x, x_stride, t0, tt, ahead, s, n_rows, r0, nr);
    }
}

// gemm_fn: s[t * n_rows + r] = row r . token t. Per 16 rows: their panel, then every token, 8 at a
// time (the next 16 rows fetched into L2 during the first 8).
template <class WBlock>
void gemm_rows16_32(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                    int64_t n_tok) {
    const int64_t nb = n / 32;
    static thread_local std::vector<RowPanel> panel;
    static thread_local TokenTerms tt;
    if ((int64_t)panel.size() < nb) panel.resize(nb);
    const uint8_t* xb = (const uint8_t*)x;
    token_terms<WBlock>(xb, x_stride, n_tok, nb, tt);
    for (int64_t r0 = 0; r0 < n_rows; r0 += 16) {
        const int64_t nr = n_rows - r0 < 16 ? n_rows - r0 : 16;
        const WBlock* a[16];
        for (int r = 0; r < 16; r++) a[r] = (const WBlock*)rows[r0 + (r < nr ? r : nr - 1)];
        for (int64_t i = 0; i < nb; i++) build_row_panel<WBlock>(a, i, panel[i]);
        const int64_t n_ahead = n_rows - (r0 + 16) < 16 ? n_rows - (r0 + 16) : 16;
        const Ahead ahead = {n_ahead > 0 ? rows + r0 + 16 : nullptr, n_ahead, sizeof(WBlock)};
        int64_t t0 = 0;
        for (; t0 + 8 <= n_tok; t0 += 8)
            row_tile_store<WBlock, 8>(nb, panel.data(), xb, x_stride, t0, tt, t0 == 0 ? ahead : Ahead(), s, n_rows,
                                      r0, nr);
        row_tile_rest<WBlock>(n_tok - t0, nb, panel.data(), xb, x_stride, t0, tt, t0 == 0 ? ahead : Ahead(), s,
                              n_rows, r0, nr);
    }
}

// The batched product of the AVX-512VNNI kernel set: rows in the lanes from kRowLaneTokens tokens,
// tokens in the lanes under it (see the top of this file). Both give every (row, token) the same bits.
template <class WBlock, int NR>
void gemm_q32_vnni(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                   int64_t n_tok) {
    if (n_tok >= kRowLaneTokens) gemm_rows16_32<WBlock>(n, s, rows, n_rows, x, x_stride, n_tok);
    else gemm_panels_32<WBlock, NR>(n, s, rows, n_rows, x, x_stride, n_tok);
}

}  // namespace
}  // namespace optiml
