// The batched product (gemm) of the 32-element block formats with 16 weight rows in the lanes of a zmm,
// for AVX-512VL with VNNI (vpdpbusd exact for any unsigned codes): from 32 tokens per call up for rows
// anywhere (gemm_rows16_32), and for any number of tokens with a matrix stored that way (the rows16
// layout, optiml/rows16.h; gemm_rows16_packed).
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
// under it. A matrix kept in the rows16 layout needs no transpose, and there the row lanes win from one
// token (rows16_tile).
//
// Arithmetic: per (row, token), block after block, the exact integer dot of the block (unsigned codes,
// the offset taken back out as -offset * sum(x)), then acc = fma(float(isum), d_w * d_x, acc), then for
// Q4_1/Q5_1 acc = fma(m_w, s_x, acc): what vec_dot, the matrix-vector kernels and simd_gemm_q32.h
// compute, so a token gets the same bits alone, in any batch, and through either kernel.
#pragma once

#include <algorithm>
#include <vector>

#include "optiml/rows16.h"
#include "simd_gemm_q32.h"

namespace optiml {

// The calling thread's activations terms of gemm_rows16_32, sized for n_tok tokens of nb blocks (matmul.cpp:
// made outside this file, so that its std::vector code is not compiled with this file's AVX-512 flags;
// see simd_x86.h on containers).
Rows16Terms& rows16_gemm_terms(int64_t n_tok, int64_t nb);

namespace {

constexpr int64_t kRowLaneTokens = 32;
// How far ahead of a rows16 tile each of its panels is fetched, in bytes of the panel's stream. With
// the next tile's panels as the target instead, 7B's down matrix (11008 columns, 99 KiB panels, 4 side
// by side) had 800 KiB in flight, more than L2 keeps: its matrix-vector product ran at 0.93x the row
// layout's against 1.17x with 8 KiB (4 KiB: 1.01x; 16 KiB: 0.96x; 2 threads, Zen 4).
constexpr int64_t kRows16AheadBytes = 8192;

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

// The call's activations regrouped for the tiles (Rows16Terms, optiml/kernels.h): a tile then reads
// every token's codes and terms from one pointer at fixed offsets, instead of a pointer per token (8
// general registers, spilled). Tokens [t0, t1).
template <class XBlock>
inline void fill_terms(const uint8_t* x, size_t x_stride, int64_t nb, int64_t t0, int64_t t1, Rows16Terms& tt) {
    for (int64_t t = t0; t < t1; t++) {
        const XBlock* b = (const XBlock*)(x + t * x_stride);
        for (int64_t i = 0; i < nb; i++) {
            const size_t slot = (size_t)((t / 8) * nb + i) * 8 + t % 8;
            std::memcpy(&tt.q[slot * 32], b[i].qs, 32);
            tt.dx[slot] = h2f(b[i].d);
            tt.sx[slot] = std::is_same<XBlock, block_q8_1>::value ? h2f(sum_of(b[i])) : 0.0f;
            // sum(q) of the signed bytes: their unsigned sum (+ 128 each) by vpsadbw, less 32 * 128.
            const __m256i u = _mm256_xor_si256(load256(b[i].qs), _mm256_set1_epi8((char)0x80));
            const __m256i s4 = _mm256_sad_epu8(u, _mm256_setzero_si256());
            const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
            tt.qsum[slot] = (int32_t)(_mm_cvtsi128_si32(s2) + _mm_extract_epi32(s2, 2)) - 32 * 128;
        }
    }
}

// rows16_terms_fn.
inline void rows16_terms_q32(int32_t xtype, const void* x, size_t x_stride, int64_t nb, int64_t t0, int64_t t1,
                             Rows16Terms& tt) {
    if (xtype == TYPE_Q8_1) fill_terms<block_q8_1>((const uint8_t*)x, x_stride, nb, t0, t1, tt);
    else fill_terms<block_q8_0>((const uint8_t*)x, x_stride, nb, t0, t1, tt);
}

// The weights' codes carry an offset (Q4_0 8, Q5_0 16, Q8_0 as unsigned 128), taken back out of each
// block's integer dot as -offset * sum(q).
template <class WBlock>
constexpr int32_t code_offset() { return Q32<WBlock>::is_signed ? 128 : Q32<WBlock>::offset; }

// Rows to fetch into L2 while a tile runs: the next panel's, a line of each as the tile's blocks reach
// it. The panel is built in a short burst with nothing to overlap its loads; the tile is long and reads
// only the panel and the activations, so its time hides the next rows' memory latency, spread out
// (a burst of every line at once overflows the outstanding misses and loses most of them).
struct Ahead {
    const void* const* rows = nullptr;
    int64_t n = 0;
    int64_t block_size = 0;
};

// One block of 16 rows (codes w, scales d and mins m in the lanes) against T tokens, whose codes and
// terms sit at xq, dx, sx and qsum (one slot each, Rows16Terms): the exact integer dot of the block per
// (row, token), the offset taken back out, then the float steps into acc[t].
template <class WBlock, int T>
inline void tile_block(const __m512i w[8], __m512 d, __m512 m, const uint8_t* xq, const float* dx, const float* sx,
                       const int32_t* qsum, __m512* __restrict acc) {
    // __restrict: acc aliases no activation byte, so the accumulators stay in registers.
    constexpr int32_t offset = code_offset<WBlock>();
    __m512i isum[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) isum[t] = offset ? _mm512_set1_epi32(-offset * qsum[t]) : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            int32_t xk;
            std::memcpy(&xk, xq + 32 * t + 4 * k, 4);
            isum[t] = _mm512_dpbusd_epi32(isum[t], w[k], _mm512_set1_epi32(xk));
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(dx[t]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), dd, acc[t]);
        if constexpr (Q32<WBlock>::has_min) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[t]), acc[t]);
    }
}

// A rows16 panel (optiml/rows16.h) is already a RowPanel but for splitting the nibbles and converting
// the scales: 12 logic operations and 2 conversions per 16 rows' block (Q8_0: the scale conversion only).
template <class WBlock>
struct Rows16 {
    static constexpr int32_t type = std::is_same<WBlock, block_q8_0>::value ? TYPE_Q8_0
                                    : Q32<WBlock>::has_min                  ? TYPE_Q4_1
                                                                            : TYPE_Q4_0;
    static constexpr int64_t code_bytes = (int64_t)rows16_code_bytes(type);
    static constexpr int64_t share = 16 * sizeof(WBlock);  // a block's share of its panel: 16 blocks' bytes
    // Block i of the panel at q (nb blocks): g[k] lane r = group k of row r, d and m the rows' scales.
    static void load(const uint8_t* q, int64_t nb, int64_t i, __m512i g[8], __m512& d, __m512& m) {
        const uint8_t* qi = q + i * code_bytes;
        if constexpr (type == TYPE_Q8_0) {
            for (int k = 0; k < 8; k++) g[k] = _mm512_loadu_si512((const void*)(qi + 64 * k));
        } else {
            const __m512i lo4 = _mm512_set1_epi8(0x0F);
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void*)(qi + 64 * k));
                g[k] = _mm512_and_si512(v, lo4);
                g[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
            }
        }
        const uint8_t* scales = q + nb * code_bytes;
        d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 32 * i)));
        if constexpr (Q32<WBlock>::has_min)
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 32 * (nb + i))));
        else m = d;
    }
};

// The panel's 16 rows (p: built for the call) against the first T tokens of token group g: out[t] lane
// r = row r . token 8g + t.
template <class WBlock, int T>
inline void row_tile(int64_t nb, const RowPanel* p, const Rows16Terms& tt, int64_t g, const Ahead& ahead,
                     __m512 out[T]) {
    __m512 acc[T];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    const size_t slot0 = (size_t)g * nb * 8;
    int64_t line = -1;
    for (int64_t i = 0; i < nb; i++) {
        if (ahead.rows) {
            const int64_t end = (i + 1) * ahead.block_size - 1;
            if (end / 64 != line) {
                line = end / 64;
                for (int64_t r = 0; r < ahead.n; r++) _mm_prefetch((const char*)ahead.rows[r] + end, _MM_HINT_T1);
            }
        }
        const size_t slot = slot0 + (size_t)i * 8;
        tile_block<WBlock, T>(p[i].g, p[i].d, p[i].m, &tt.q[slot * 32], &tt.dx[slot], &tt.sx[slot], &tt.qsum[slot],
                              acc);
    }
    for (int t = 0; t < T; t++) out[t] = acc[t];
}

// Tokens 8g..8g + T - 1 against the panel, into s (the panel's nr live rows from row r0).
template <class WBlock, int T>
inline void row_tile_store(int64_t nb, const RowPanel* src, const Rows16Terms& tt, int64_t g, const Ahead& ahead, float* s,
                           int64_t n_rows, int64_t r0, int64_t nr) {
    __m512 out[T];
    row_tile<WBlock, T>(nb, src, tt, g, ahead, out);
    const __mmask16 live = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < T; t++) _mm512_mask_storeu_ps(s + (8 * g + t) * n_rows + r0, live, out[t]);
}

// Every token against the panel: tiles of 8, then one of the n_tok % 8 left (T counts down to it).
template <class WBlock, int T = 7>
inline void row_tile_rest(int64_t n_rest, int64_t nb, const RowPanel* src, const Rows16Terms& tt, int64_t g,
                          const Ahead& ahead, float* s, int64_t n_rows, int64_t r0, int64_t nr) {
    if constexpr (T > 0) {
        if (n_rest == T) row_tile_store<WBlock, T>(nb, src, tt, g, ahead, s, n_rows, r0, nr);
        else row_tile_rest<WBlock, T - 1>(n_rest, nb, src, tt, g, ahead, s, n_rows, r0, nr);
    }
}
template <class WBlock>
inline void row_tiles(int64_t n_tok, int64_t nb, const RowPanel* src, const Rows16Terms& tt, const Ahead& ahead, float* s,
                      int64_t n_rows, int64_t r0, int64_t nr) {
    int64_t g = 0;
    for (; 8 * g + 8 <= n_tok; g++)
        row_tile_store<WBlock, 8>(nb, src, tt, g, g == 0 ? ahead : Ahead(), s, n_rows, r0, nr);
    row_tile_rest<WBlock>(n_tok - 8 * g, nb, src, tt, g, g == 0 ? ahead : Ahead(), s, n_rows, r0, nr);
}

// gemm_fn: s[t * n_rows + r] = row r . token t. Per 16 rows: their panel, then every token, 8 at a
// time (the next 16 rows fetched into L2 during the first 8).
template <class WBlock>
void gemm_rows16_32(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                    int64_t n_tok) {
    const int64_t nb = n / 32;
    static thread_local std::vector<RowPanel> panel;
    Rows16Terms& tt = rows16_gemm_terms(n_tok, nb);
    if ((int64_t)panel.size() < nb) panel.resize(nb);
    fill_terms<typename Q32<WBlock>::X>((const uint8_t*)x, x_stride, nb, 0, n_tok, tt);
    for (int64_t r0 = 0; r0 < n_rows; r0 += 16) {
        const int64_t nr = n_rows - r0 < 16 ? n_rows - r0 : 16;
        const WBlock* a[16];
        for (int r = 0; r < 16; r++) a[r] = (const WBlock*)rows[r0 + (r < nr ? r : nr - 1)];
        for (int64_t i = 0; i < nb; i++) build_row_panel<WBlock>(a, i, panel[i]);
        const int64_t n_ahead = n_rows - (r0 + 16) < 16 ? n_rows - (r0 + 16) : 16;
        const Ahead ahead = {n_ahead > 0 ? rows + r0 + 16 : nullptr, n_ahead, sizeof(WBlock)};
        row_tiles<WBlock>(n_tok, nb, panel.data(), tt, ahead, s, n_rows, r0, nr);
    }
}

// P panels of a rows16 matrix (from q, panel_bytes apart) against the first T tokens of token group
// g, block by block side by side: out[p][t] lane r = row 16 p + r . token 8 g + t. With few tokens one
// panel's integer dots are a chain of 8 dependent vpdpbusd a block; P panels give the core P independent
// chains. Each panel's stream is fetched kRows16AheadBytes ahead (and on into the next tile's panels):
// sequential as panels are, the hardware prefetcher alone left the matrix-vector product at half the
// bandwidth the row layout reaches. Each block is row_tile's tile_block, so the bits are vec_dot's.
template <class WBlock, int T, int P>
inline void rows16_tile(int64_t nb, const uint8_t* q, int64_t panel_bytes, const Rows16Terms& tt, int64_t g,
                        __m512 out[P][T]) {
    typedef Rows16<WBlock> R;
    __m512 acc[P][T];
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++) acc[p][t] = _mm512_setzero_ps();
    const size_t slot0 = (size_t)g * nb * 8;
    const uint8_t* xq = tt.q.data() + slot0 * 32;
    const float* dx = tt.dx.data() + slot0;
    const float* sx = tt.sx.data() + slot0;
    const int32_t* qsum = tt.qsum.data() + slot0;
    const int64_t ahead = std::min<int64_t>(nb, std::max<int64_t>(1, kRows16AheadBytes / R::share));
    for (int64_t i = 0; i < nb; i++, xq += 256, dx += 8, sx += 8, qsum += 8) {
        // Block i + ahead of each panel, or past a panel's end the block of the panel P on (the next
        // tile's), so that every stream is fetched a fixed distance ahead whatever the row length.
        const int64_t j = i + ahead < nb ? i + ahead : i + ahead - nb;
        const uint8_t* pf = q + (i + ahead < nb ? 0 : P * panel_bytes);
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) {
            const uint8_t* pp = pf + p * panel_bytes;
            for (int64_t off = 0; off < R::code_bytes; off += 64)
                _mm_prefetch((const char*)pp + j * R::code_bytes + off, _MM_HINT_T1);
            if (j % 2 == 0) {  // a line of scales (and of mins) serves two blocks
                _mm_prefetch((const char*)pp + nb * R::code_bytes + 32 * j, _MM_HINT_T1);
                if (Q32<WBlock>::has_min)
                    _mm_prefetch((const char*)pp + nb * R::code_bytes + 32 * (nb + j), _MM_HINT_T1);
            }
            __m512i w[8];
            __m512 d, m;
            R::load(q + p * panel_bytes, nb, i, w, d, m);
            tile_block<WBlock, T>(w, d, m, xq, dx, sx, qsum, acc[p]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int t = 0; t < T; t++) out[p][t] = acc[p][t];
}

// Every panel of the matrix at w (n_rows rows) against T tokens of group g, token t's into s + t * ldo:
// P panels at a time, P as many as the registers hold (accumulators P * T), then the rest one by one.
template <class WBlock, int T>
inline void rows16_group(int64_t nb, const uint8_t* w, int64_t n_rows, const Rows16Terms& tt, int64_t g, float* s,
                         int64_t ldo) {
    constexpr int P = T <= 2 ? 4 : T <= 4 ? 2 : 1;
    const int64_t panel_bytes = 16 * nb * sizeof(WBlock);
    const int64_t n_panels = n_rows / 16;
    auto run = [&](auto p_const, int64_t p0) {
        constexpr int NP = decltype(p_const)::value;
        __m512 out[NP][T];
        rows16_tile<WBlock, T, NP>(nb, w + p0 * panel_bytes, panel_bytes, tt, g, out);
        for (int p = 0; p < NP; p++)
            for (int t = 0; t < T; t++) _mm512_storeu_ps(s + t * ldo + (p0 + p) * 16, out[p][t]);
    };
    int64_t p0 = 0;
    for (; p0 + P <= n_panels; p0 += P) run(std::integral_constant<int, P>(), p0);
    for (; p0 < n_panels; p0++) run(std::integral_constant<int, 1>(), p0);
}

template <class WBlock, int T = 7>
inline void rows16_rest(int64_t n_rest, int64_t nb, const uint8_t* w, int64_t n_rows, const Rows16Terms& tt, int64_t g,
                        float* s, int64_t ldo) {
    if constexpr (T > 0) {
        if (n_rest == T) rows16_group<WBlock, T>(nb, w, n_rows, tt, g, s, ldo);
        else rows16_rest<WBlock, T - 1>(n_rest, nb, w, n_rows, tt, g, s, ldo);
    }
}

// gemm_rows16_fn: the product with a rows16 matrix (optiml/rows16.h), 8 tokens at a time and then the
// rest, each tile reading the rows' blocks as they are stored.
template <class WBlock>
void gemm_rows16_packed(int64_t n, float* s, int64_t ldo, const void* w, int64_t n_rows, const Rows16Terms& tt,
                        int64_t t0, int64_t n_tok) {
    const int64_t nb = n / 32;
    int64_t k = 0;  // tokens done
    for (; k + 8 <= n_tok; k += 8)
        rows16_group<WBlock, 8>(nb, (const uint8_t*)w, n_rows, tt, (t0 + k) / 8, s + k * ldo, ldo);
    rows16_rest<WBlock>(n_tok - k, nb, (const uint8_t*)w, n_rows, tt, (t0 + k) / 8, s + k * ldo, ldo);
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
