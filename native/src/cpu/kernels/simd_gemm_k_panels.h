// The driver of the k-quants' batched products with rows in the vector lanes (simd_gemm_k_rows.h: 16 rows in a
// zmm; simd_gemm_k_rows8.h: 8 in a ymm): per group of rows, their super-blocks unpacked and laid out as one
// panel each, then every token against them, T at a time.
//
// A Kernel gives: Panel (one super-block of kRows rows), Acc (a vector of kRows floats), build<WBlock>(u, i,
// panel) from the rows' unpacked super-blocks, block<WBlock, T>(panel, x, x_row, acc) (one super-block against
// T tokens' XAligned blocks, x_row bytes apart), zero() and store(s, acc, nr) (the nr live lanes).
#pragma once

#include <cstddef>
#include <type_traits>
#include <vector>

#include "simd_gemm_q32.h"
#include "simd_kquants.h"

namespace optiml {
namespace {

// Dwords per scale group: Q4_K and Q5_K have one scale per 32 elements, the others one per 16.
template <class WBlock>
constexpr int k_group_dwords() {
    return std::is_same<WBlock, block_q4_K>::value || std::is_same<WBlock, block_q5_K>::value ? 8 : 4;
}

// The scale of group j (k_group_dwords) of an unpacked super-block. s16's words: with groups of 32, word c
// the scale of chunk c; with groups of 16, the even groups' scales, then the odd ones'.
template <class WBlock>
inline int16_t k_group_scale(const KUnpacked& u, int j) {
    return k_group_dwords<WBlock>() == 8 ? u.s16[j] : u.s16[(j % 2) * 8 + j / 2];
}

// Rows u[0..7]'s super-block i with row r in int32 lane r: g[stride * k] codes 4k..4k+3, c16[stride * j] the
// correction coefficients 2j, 2j+1 (int16 pair), negated for Q3_K and Q6_K, which take the corrections out of
// isum (isum + (-c16) . bsums). stride 2 writes the low or high halves of zmm vectors.
template <class WBlock>
inline void k_lanes8(const KUnpacked* const* u, int64_t i, __m256i* g, __m256i* c16, ptrdiff_t stride) {
    __m256i v[8];
    for (int c = 0; c < 8; c++) {
        for (int r = 0; r < 8; r++) v[r] = load256(u[r][i].codes[c]);
        transpose8_epi32(v);
        for (int k = 0; k < 8; k++) _mm256_store_si256(g + stride * (8 * c + k), v[k]);
    }
    for (int r = 0; r < 8; r++) v[r] = load256(u[r][i].c16);
    transpose8_epi32(v);
    for (int j = 0; j < 8; j++)
        _mm256_store_si256(c16 + stride * j,
                           KQ<WBlock>::separate_min ? v[j] : _mm256_sub_epi16(_mm256_setzero_si256(), v[j]));
}

// T tokens (from xa, x_row bytes apart) against a panel's nb super-blocks, into s + t * ldo.
template <class Kernel, class WBlock, int T>
inline void k_panel_tile(int64_t nb, const typename Kernel::Panel* p, const uint8_t* xa, size_t x_row, float* s,
                         int64_t ldo, int64_t nr) {
    typename Kernel::Acc acc[T];
    for (int t = 0; t < T; t++) acc[t] = Kernel::zero();
    for (int64_t i = 0; i < nb; i++) Kernel::template block<WBlock, T>(p[i], xa + i * sizeof(XAligned), x_row, acc);
    for (int t = 0; t < T; t++) Kernel::store(s + t * ldo, acc[t], nr);
}

// The last n_rest < T tokens as one tile of their width.
template <class Kernel, class WBlock, int T>
inline void k_panel_rest(int64_t n_rest, int64_t nb, const typename Kernel::Panel* p, const uint8_t* xa, size_t x_row,
                         float* s, int64_t ldo, int64_t nr) {
    if constexpr (T > 0) {
        if (n_rest == T) k_panel_tile<Kernel, WBlock, T>(nb, p, xa, x_row, s, ldo, nr);
        else k_panel_rest<Kernel, WBlock, T - 1>(n_rest, nb, p, xa, x_row, s, ldo, nr);
    }
}

// gemm_pre_fn: s[t * ldo + r] = row r . token t, the tokens' activations laid out at xa (gemm_x_k).
template <class Kernel, class WBlock, int T>
void gemm_k_panels(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                   int64_t n_tok) {
    constexpr int R = Kernel::kRows;
    const int64_t nb = n / OPTIML_QK_K;
    const size_t x_row = gemm_x_row(n);
    static thread_local std::vector<typename Kernel::Panel> panel;
    static thread_local std::vector<KUnpacked> unpacked;
    if ((int64_t)panel.size() < nb) panel.resize(nb);
    if ((int64_t)unpacked.size() < R * nb) unpacked.resize(R * nb);
    for (int64_t r0 = 0; r0 < n_rows; r0 += R) {
        const int64_t nr = n_rows - r0 < R ? n_rows - r0 : R;
        const KUnpacked* u[R];
        for (int r = 0; r < R; r++) {
            // past the last row, the last row again (its lanes are not stored)
            if (r < nr) unpack_row_k<WBlock>(rows[r0 + r], nb, unpacked.data() + r * nb);
            u[r] = unpacked.data() + (r < nr ? r : nr - 1) * nb;
        }
        for (int64_t i = 0; i < nb; i++) Kernel::template build<WBlock>(u, i, panel[i]);
        const uint8_t* x = (const uint8_t*)xa;
        int64_t t = 0;
        for (; t + T <= n_tok; t += T)
            k_panel_tile<Kernel, WBlock, T>(nb, panel.data(), x + t * x_row, x_row, s + t * ldo + r0, ldo, nr);
        k_panel_rest<Kernel, WBlock, T - 1>(n_tok - t, nb, panel.data(), x + t * x_row, x_row, s + t * ldo + r0, ldo,
                                            nr);
    }
}

}  // namespace
}  // namespace optiml
