// The k-quants' batched product with 16 weight rows in the lanes of a zmm (AVX-512VL with VNNI), from
// kKRowLaneTokens tokens.
//
// tile_k (simd_kquants.h) gives each (row, token) 8 int32 lanes of its own: per super-block 8 integer
// dots of 64 bytes (vpmaddubsw by the codes, vpdpwssd by the scales), then the lanes added up and the
// float steps, about 17 vector operations per (row, token, super-block). Here 16 rows' codes are laid
// out once per call as dword groups in the lanes (KRowPanel), and each token meets them with its
// activation dwords broadcast (vpdpbusd's memory operand): per (16 rows, token, super-block) 64 dots,
// one multiply and add per scale group, 8 vpdpwssd for the corrections and 3 or 6 float steps, about 6
// operations per (row, token, super-block). The panel costs about as much as 8 tokens, so the kernel
// takes over from kKRowLaneTokens tokens (tools/bench/kernels.py --tokens N, 2 threads, Zen 4 with
// AVX-512 VNNI, against tile_k: 4 tokens 0.8-1.2x, 8: 1.0-1.3x, 16: 1.1-1.6x, 128: 1.5-2.0x).
//
// Arithmetic: the super-block's exact integer totals isum and corr per (row, token), then simd_kquants.h's
// float steps (k_step) lane by lane: the same bits as vec_dot for every (row, token).
#pragma once

#include "simd_gemm_k_panels.h"

namespace optiml {
namespace {

constexpr int64_t kKRowLaneTokens = 8;

// Super-block i of 16 rows, row r in int32 lane r of every vector.
struct alignas(64) KRowPanel {
    __m512i g[64];      // codes 4k..4k+3 (unsigned) of row r in g[k]
    __m512i scale[16];  // the scale of the row's group j (16 or 32 elements, k_group_dwords)
    __m512i c16[8];     // the row's correction coefficients 2j, 2j+1 (int16 pair), negated for Q3_K/Q6_K
    __m512 d, dmin;     // d_w and -dmin_w
};

// Rows u[0..15] (unpacked, KUnpacked), super-block i, into p.
template <class WBlock>
inline void build_k_panel(const KUnpacked* const* u, int64_t i, KRowPanel& p) {
    constexpr int G = k_group_dwords<WBlock>();
    k_lanes8<WBlock>(u, i, (__m256i*)p.g, (__m256i*)p.c16, 2);  // rows 0..7: the low halves
    k_lanes8<WBlock>(u + 8, i, (__m256i*)p.g + 1, (__m256i*)p.c16 + 1, 2);
    alignas(64) int32_t sc[16][16];
    alignas(64) float d[16], dmin[16];
    for (int r = 0; r < 16; r++) {
        for (int j = 0; j < 64 / G; j++) sc[j][r] = k_group_scale<WBlock>(u[r][i], j);
        d[r] = u[r][i].d;
        dmin[r] = -u[r][i].dmin;
    }
    for (int j = 0; j < 64 / G; j++) p.scale[j] = _mm512_load_si512(sc[j]);
    p.d = _mm512_load_ps(d);
    p.dmin = _mm512_load_ps(dmin);
}

// One super-block of a panel against T tokens, whose blocks (XAligned) lie x_row bytes apart from x: the
// integer totals, then the float steps into acc[t] (lane r: row r . token t).
template <class WBlock, int T>
inline void k_rows_block(const KRowPanel& p, const uint8_t* x, size_t x_row, __m512* __restrict acc) {
    constexpr int G = k_group_dwords<WBlock>();
    constexpr bool kSeparateMin = KQ<WBlock>::separate_min;
    __m512i tot[T], corr[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) tot[t] = _mm512_setzero_si512(), corr[t] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int j = 0; j < 64 / G; j++) {
        __m512i gs[T];
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) gs[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int k = 0; k < G; k++) {
            const __m512i w = p.g[G * j + k];
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                int32_t xk;
                std::memcpy(&xk, x + t * x_row + offsetof(XAligned, qs) + 4 * (G * j + k), 4);
                gs[t] = _mm512_dpbusd_epi32(gs[t], w, _mm512_set1_epi32(xk));
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) tot[t] = _mm512_add_epi32(tot[t], _mm512_mullo_epi32(gs[t], p.scale[j]));
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            int32_t bs;
            std::memcpy(&bs, x + t * x_row + offsetof(XAligned, bsums) + 4 * j, 4);
            if (kSeparateMin) corr[t] = _mm512_dpwssd_epi32(corr[t], p.c16[j], _mm512_set1_epi32(bs));
            else tot[t] = _mm512_dpwssd_epi32(tot[t], p.c16[j], _mm512_set1_epi32(bs));
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        float dxs;
        std::memcpy(&dxs, x + t * x_row + offsetof(XAligned, d), 4);
        const __m512 dx = _mm512_set1_ps(dxs);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[t]), _mm512_mul_ps(p.d, dx), acc[t]);
        if (kSeparateMin) acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(corr[t]), _mm512_mul_ps(p.dmin, dx), acc[t]);
    }
}

// The panels of 16 rows for gemm_k_panels (simd_gemm_k_panels.h).
struct KRows16 {
    typedef KRowPanel Panel;
    typedef __m512 Acc;
    static constexpr int kRows = 16;
    template <class WBlock>
    static void build(const KUnpacked* const* u, int64_t i, Panel& p) { build_k_panel<WBlock>(u, i, p); }
    template <class WBlock, int T>
    static void block(const Panel& p, const uint8_t* x, size_t x_row, Acc* __restrict acc) {
        k_rows_block<WBlock, T>(p, x, x_row, acc);
    }
    static Acc zero() { return _mm512_setzero_ps(); }
    static void store(float* s, Acc v, int64_t nr) { _mm512_mask_storeu_ps(s, (__mmask16)((1u << nr) - 1), v); }
};

// gemm_pre_fn with 16 rows in the lanes. Tokens per tile: the formats with mins keep a third accumulator per
// token.
template <class WBlock>
void gemm_rows_k(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                 int64_t n_tok) {
    gemm_k_panels<KRows16, WBlock, KQ<WBlock>::separate_min ? 5 : 6>(n, s, ldo, rows, n_rows, xa, n_tok);
}

// gemm_pre_fn of the VNNI kernel set: rows in the lanes from kKRowLaneTokens tokens, tile_k under it.
template <class WBlock, int NR, int NT>
void gemm_pre_k_vnni(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                     int64_t n_tok) {
    if (n_tok >= kKRowLaneTokens) gemm_rows_k<WBlock>(n, s, ldo, rows, n_rows, xa, n_tok);
    else gemm_pre_k<WBlock, NR, NT>(n, s, ldo, rows, n_rows, xa, n_tok);
}

}  // namespace
}  // namespace optiml
