// The tiled product shared by every x86 weight family (simd_q32.h, simd_kquants.h, simd_float.h).
#pragma once

#include "simd_x86.h"

namespace optiml {
namespace {

// The token edge: `left` (1 <= left <= K) tokens as one NR x left tile.
template <class Tile, int NR, int K>
inline void run_edge(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x,
                     size_t x_stride, int64_t left) {
    if constexpr (K > 1) {
        if (left < K) return run_edge<Tile, NR, K - 1>(n, s, s_stride, rows, x, x_stride, left);
    }
    Tile::template run<NR, K>(n, s, s_stride, rows, x, x_stride);
}

// The tiles of n_rows rows already prepared (tr: what Tile::prepare returned for them), written
// s[t * ldo + r].
template <class Tile, int NR, int NT>
void gemm_tiles(int64_t n, float* s, int64_t ldo, const void* const* tr, int64_t n_rows, const uint8_t* xb,
                size_t x_stride, int64_t n_tok) {
    int64_t r = 0;
    for (; r + NR <= n_rows; r += NR) {
        float* sr = s + r;
        int64_t t = 0;
        for (; t + NT <= n_tok; t += NT) Tile::template run<NR, NT>(n, sr + t * ldo, ldo, tr + r, xb + t * x_stride, x_stride);
        if constexpr (NT > 1)
            if (t < n_tok) run_edge<Tile, NR, NT - 1>(n, sr + t * ldo, ldo, tr + r, xb + t * x_stride, x_stride, n_tok - t);
    }
    for (; r < n_rows; r++) {
        int64_t t = 0;
        for (; t + NT <= n_tok; t += NT) Tile::template run<1, NT>(n, s + r + t * ldo, ldo, tr + r, xb + t * x_stride, x_stride);
        for (; t < n_tok; t++) Tile::template run<1, 1>(n, s + r + t * ldo, ldo, tr + r, xb + t * x_stride, x_stride);
    }
}

// s[t * n_rows + r] = dot(rows[r], x_t), x_t = x + t * x_stride bytes, for r < n_rows and t < n_tok.
// Rows are taken NR at a time; Tile::prepare may unpack them once (for all the tokens) and returns
// what Tile::run reads. Whole NR x NT tiles run first, then the token edge (fewer than NT tokens) as one
// tile of its width: the experts of a mixture see a few tokens each, and 1-token tiles reread each row per
// token. The last rows (fewer than NR) run one by one with 1 x NT and 1 x 1 tiles. A tile computes each of its
// (row, token) values exactly as the family's vec_dot does, so the tiling never changes a bit.
template <class Tile, int NR, int NT>
void gemm_tiled(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                int64_t n_tok) {
    for (int64_t r = 0; r < n_rows; r += NR) {
        const int64_t nr = n_rows - r < NR ? n_rows - r : NR;
        gemm_tiles<Tile, NR, NT>(n, s + r, n_rows, Tile::prepare(n, rows + r, nr), nr, (const uint8_t*)x, x_stride,
                                 n_tok);
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
