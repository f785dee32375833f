// The k-quants' batched product with 8 weight rows in the lanes of a ymm (AVX2, AVX-VNNI, AVX-512 without
// VNNI), from kKRows8Tokens tokens: simd_gemm_k_rows.h's layout at half the width, with the integer steps
// of a machine without vpdpbusd.
//
// tile_k (simd_kquants.h) spends per (row, token, super-block) 8 x (vpmaddubsw, vpmaddwd, vpaddd) on its
// integers and then adds its 8 lanes up for the float steps. Here 8 rows' codes lie as dword groups in the
// lanes (KRowPanel8, built once per call) and each token's activation dwords are broadcast: vpmaddubsw gives
// int16 pair sums of 8 rows at once, which are added in int16 over as many dwords as cannot overflow
// (kInt16Depth: the codes' range decides it) and then multiplied by the group's scale into int32 with one
// vpmaddwd (vpdpwssd with VNNI). The float steps then run on 8 rows at once. Measured with
// tools/bench/kernels.py --simd avx2 --tokens N (2 threads, Zen 4, 4096x4096) against tile_k: 16 tokens
// 0.9-1.1x, 32 tokens 1.1-1.3x, 128 tokens 1.1-1.3x (Q4_K, Q6_K, Q3_K) and 1.3x (Q5_K, Q2_K); so from 32.
//
// Arithmetic: the super-block's exact integer totals per (row, token), then simd_kquants.h's float steps
// lane by lane: the same bits as vec_dot for every (row, token).
#pragma once

#include <type_traits>

#include "simd_gemm_k_panels.h"

namespace optiml {
namespace {

constexpr int64_t kKRows8Tokens = 32;

// Dwords whose vpmaddubsw pair sums may be added in int16: a pair sum is at most 2 * max code * 128.
template <class WBlock>
constexpr int k_int16_depth() {
    constexpr int max_code = std::is_same<WBlock, block_q2_K>::value   ? 3
                             : std::is_same<WBlock, block_q3_K>::value ? 7
                             : std::is_same<WBlock, block_q4_K>::value ? 15
                             : std::is_same<WBlock, block_q5_K>::value ? 31
                                                                       : 63;
    constexpr int depth = 32767 / (2 * max_code * 128);
    return depth < k_group_dwords<WBlock>() ? depth : k_group_dwords<WBlock>();
}

// Super-block i of 8 rows, row r in int32 lane r of every vector.
struct alignas(32) KRowPanel8 {
    __m256i g[64];      // codes 4k..4k+3 (unsigned) of row r in g[k]
    __m256i scale[16];  // the scale of the row's group j as an int16 pair (s, s)
    __m256i c16[8];     // the row's correction coefficients 2j, 2j+1 (int16 pair), negated for Q3_K/Q6_K
    __m256 d, dmin;     // d_w and -dmin_w
};

// Rows u[0..7] (unpacked, KUnpacked), super-block i, into p.
template <class WBlock>
inline void build_k_panel8(const KUnpacked* const* u, int64_t i, KRowPanel8& p) {
    constexpr int G = k_group_dwords<WBlock>();
    k_lanes8<WBlock>(u, i, p.g, p.c16, 1);
    alignas(32) int32_t sc[16][8];
    alignas(32) float d[8], dmin[8];
    for (int r = 0; r < 8; r++) {
        for (int j = 0; j < 64 / G; j++) {
            const int16_t s = k_group_scale<WBlock>(u[r][i], j);
            sc[j][r] = (int32_t)(((uint32_t)(uint16_t)s << 16) | (uint16_t)s);
        }
        d[r] = u[r][i].d;
        dmin[r] = -u[r][i].dmin;
    }
    for (int j = 0; j < 64 / G; j++) p.scale[j] = _mm256_load_si256((const __m256i*)sc[j]);
    p.d = _mm256_load_ps(d);
    p.dmin = _mm256_load_ps(dmin);
}

// One super-block of a panel against T tokens, whose blocks (XAligned) lie x_row bytes apart from x: the
// integer totals, then the float steps into acc[t] (lane r: row r . token t).
template <class WBlock, int T>
inline void k_rows8_block(const KRowPanel8& p, const uint8_t* x, size_t x_row, __m256* __restrict acc) {
    constexpr int G = k_group_dwords<WBlock>(), D = k_int16_depth<WBlock>();
    constexpr bool kSeparateMin = KQ<WBlock>::separate_min;
    auto xdword = [&](int t, size_t offset) {
        int32_t v;
        std::memcpy(&v, x + t * x_row + offset, 4);
        return _mm256_set1_epi32(v);
    };
    __m256i tot[T], corr[T];
    for (int t = 0; t < T; t++) tot[t] = _mm256_setzero_si256(), corr[t] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 64 / G; j++) {
#pragma GCC unroll 2
        for (int k0 = 0; k0 < G; k0 += D) {  // D dwords summed in int16, then scaled into int32
            __m256i s16[T];
#pragma GCC unroll 8
            for (int k = k0; k < k0 + D; k++) {
                const __m256i w = p.g[G * j + k];
                for (int t = 0; t < T; t++) {
                    const __m256i m = _mm256_maddubs_epi16(w, xdword(t, offsetof(XAligned, qs) + 4 * (G * j + k)));
                    s16[t] = k == k0 ? m : _mm256_add_epi16(s16[t], m);
                }
            }
            for (int t = 0; t < T; t++) tot[t] = madd_acc(tot[t], s16[t], p.scale[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < T; t++) {
            const __m256i bs = xdword(t, offsetof(XAligned, bsums) + 4 * j);
            if (kSeparateMin) corr[t] = madd_acc(corr[t], p.c16[j], bs);
            else tot[t] = madd_acc(tot[t], p.c16[j], bs);
        }
    for (int t = 0; t < T; t++) {
        float dxs;
        std::memcpy(&dxs, x + t * x_row + offsetof(XAligned, d), 4);
        const __m256 dx = _mm256_set1_ps(dxs);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[t]), _mm256_mul_ps(p.d, dx), acc[t]);
        if (kSeparateMin) acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr[t]), _mm256_mul_ps(p.dmin, dx), acc[t]);
    }
}

// The panels of 8 rows for gemm_k_panels (simd_gemm_k_panels.h).
struct KRows8 {
    typedef KRowPanel8 Panel;
    typedef __m256 Acc;
    static constexpr int kRows = 8;
    template <class WBlock>
    static void build(const KUnpacked* const* u, int64_t i, Panel& p) { build_k_panel8<WBlock>(u, i, p); }
    template <class WBlock, int T>
    static void block(const Panel& p, const uint8_t* x, size_t x_row, Acc* __restrict acc) {
        k_rows8_block<WBlock, T>(p, x, x_row, acc);
    }
    static Acc zero() { return _mm256_setzero_ps(); }
    static void store(float* s, Acc v, int64_t nr) {
        if (nr == 8) return _mm256_storeu_ps(s, v);
        alignas(32) float f[8];
        _mm256_store_ps(f, v);
        for (int64_t r = 0; r < nr; r++) s[r] = f[r];
    }
};

// gemm_pre_fn with 8 rows in the lanes. Tokens per tile: the formats with mins keep a third accumulator per
// token, so fewer of them fit the 16 registers.
template <class WBlock>
void gemm_rows8_k(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                  int64_t n_tok) {
    gemm_k_panels<KRows8, WBlock, KQ<WBlock>::separate_min ? 3 : 4>(n, s, ldo, rows, n_rows, xa, n_tok);
}

// gemm_pre_fn of the kernel sets without AVX-512 VNNI: rows in the lanes from kKRows8Tokens tokens, tile_k
// under it.
template <class WBlock, int NR, int NT>
void gemm_pre_k_rows8(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                      int64_t n_tok) {
    if (n_tok >= kKRows8Tokens) gemm_rows8_k<WBlock>(n, s, ldo, rows, n_rows, xa, n_tok);
    else gemm_pre_k<WBlock, NR, NT>(n, s, ldo, rows, n_rows, xa, n_tok);
}

}  // namespace
}  // namespace optiml
