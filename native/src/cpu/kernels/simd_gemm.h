// The tiled product shared by every x86 weight family (simd_q32.h, simd_kquants.h, simd_float.h).
#pragma once

#include "simd_x86.h"

namespace optiml {
namespace {

// s[t * n_rows + r] = dot(rows[r], x_t), x_t = x + t * x_stride bytes, for r < n_rows and t < n_tok.
// Rows are taken NR at a time; Tile::prepare may unpack them once (for all the tokens) and returns
// what Tile::run reads. Whole NR x NT tiles run first, then the token edge with NR x 1 tiles; the last
// rows (fewer than NR) run one by one with 1 x NT and 1 x 1 tiles. A tile computes each of its
// (row, token) values exactly as the family's vec_dot does, so the tiling never changes a bit.
template <class Tile, int NR, int NT>
void gemm_tiled(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                int64_t n_tok) {
    const uint8_t* xb = (const uint8_t*)x;
    for (int64_t r = 0; r < n_rows; r += NR) {
        const int64_t nr = n_rows - r < NR ? n_rows - r : NR;
        const void* const* tr = Tile::prepare(n, rows + r, nr);
        float* sr = s + r;
        if (nr == NR) {
            int64_t t = 0;
            for (; t + NT <= n_tok; t += NT) Tile::template run<NR, NT>(n, sr + t * n_rows, n_rows, tr, xb + t * x_stride, x_stride);
            for (; t < n_tok; t++) Tile::template run<NR, 1>(n, sr + t * n_rows, n_rows, tr, xb + t * x_stride, x_stride);
            continue;
        }
        for (int64_t k = 0; k < nr; k++) {
            int64_t t = 0;
            for (; t + NT <= n_tok; t += NT)
                Tile::template run<1, NT>(n, sr + k + t * n_rows, n_rows, tr + k, xb + t * x_stride, x_stride);
            for (; t < n_tok; t++)
                Tile::template run<1, 1>(n, sr + k + t * n_rows, n_rows, tr + k, xb + t * x_stride, x_stride);
        }
    }
}

// One row, one token: the family's vec_dot.
template <class Tile>
void vec_dot_tiled(int64_t n, float* s, const void* w, const void* x) {
    const void* rows[1] = {w};
    Tile::template run<1, 1>(n, s, 1, rows, (const uint8_t*)x, 0);
}

}  // namespace
}  // namespace optiml
