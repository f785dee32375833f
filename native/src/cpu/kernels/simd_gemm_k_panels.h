// The driver of the k-quants' batched products with rows in the vector lanes (simd_gemm_k_rows.h: 16 rows in a
// zmm; simd_gemm_k_rows8.h: 8 in a ymm): per group of rows, their super-blocks unpacked and laid out as one
// panel each, then every token against them, T at a time.
//
// A Kernel gives: Panel (one super-block of kRows rows), Acc (a vector of kRows floats), build<WBlock>(u, i,
// panel) from the rows' unpacked super-blocks, block<WBlock, T>(panel, x, x_row, acc) (one super-block against
// T tokens' XAligned blocks, x_row bytes apart), zero() and store(s, acc, nr) (the nr live lanes).
#pragma once

#include <vector>

#include "simd_kquants.h"

namespace optiml {
namespace {

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
