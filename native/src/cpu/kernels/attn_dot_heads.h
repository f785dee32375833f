// Attention's F16 dots for the query heads that share a KV head, all at once: each row (a key, or one
// dimension of the values) is loaded and converted once for every head instead of once per head. A
// prompt's attention was converting a row element for every multiply-add (1.5 conversions per FMA with
// the query's), which held it to a third of the FMA rate: 11% of a Qwen3-MoE-shaped prompt.
//
// Every (row, head) sums exactly as dot_f16_rows (simd_ops.h) sums it alone: accumulator j takes the
// N-chunks m = j, j + 4, j + 8, ... in order (the chunks after the last 4N step too, with kF16Chunks),
// the four fold as (0 + 2) + (1 + 3) and reduce in ggml's order, and the elements left over add in
// double. Here the accumulators run one after the other (j outer), so a tile of R rows x Q heads needs
// R x Q registers, not 4 R x Q.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optiml/ggml_types.h"

namespace optiml {
namespace {  // each SIMD file instantiates its own

constexpr int64_t kHeadsRowsAhead = 8;  // rows prefetched ahead (see attn_dot_rows.h: scattered rows)

// R rows x Q heads: s[q * s_stride + r] = dot(x[r], y[q]); y already in float (exact f16 values).
template <class O, int R, int Q>
inline void dot_f16_tile(int64_t n, float* s, int64_t s_stride, const fp16_t* const* x, const float* const* y) {
    typedef typename O::V V;
    constexpr int N = O::N;
    const int64_t chunks = O::kF16Chunks ? n / N : n / (4 * N) * 4;
    V part[4][R][Q];
    for (int j = 0; j < 4; j++) {
        V acc[R][Q];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < Q; q++) acc[r][q] = O::zero();
        for (int64_t m = j; m < chunks; m += 4) {
            V xv[R];
            for (int r = 0; r < R; r++) xv[r] = O::load_f16(x[r] + m * N);
            for (int q = 0; q < Q; q++) {
                const V yv = O::load_f32(y[q] + m * N);
                for (int r = 0; r < R; r++) acc[r][q] = O::fma(xv[r], yv, acc[r][q]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int q = 0; q < Q; q++) part[j][r][q] = acc[r][q];
    }
    V folded[R * Q];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++)
            folded[r * Q + q] = O::add(O::add(part[0][r][q], part[2][r][q]), O::add(part[1][r][q], part[3][r][q]));
    float red[R * Q];
    int i = 0;
    for (; i + 8 <= R * Q; i += 8) O::hsum_ggml8(folded + i, red + i);
    for (; i < R * Q; i++) red[i] = O::hsum_ggml(folded[i]);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < Q; q++) {
            double sum = red[r * Q + q];
            for (int64_t k = chunks * N; k < n; k++) sum += (double)(fp16_to_fp32(x[r][k]) * y[q][k]);
            s[q * s_stride + r] = (float)sum;
        }
}

// Q heads over all rows, R at a time (the rest one by one), the rows kHeadsRowsAhead ahead prefetched.
template <class O, int R, int Q>
inline void dot_f16_heads_q(int64_t n, float* s, int64_t s_stride, const uint8_t* rows, size_t stride,
                            const float* const* y, int64_t n_rows) {
    const size_t row_bytes = (size_t)n * sizeof(fp16_t);
    auto fetch = [&](int64_t r) {
        if (r >= n_rows) return;
        const uint8_t* p = rows + r * stride;
        for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    };
    for (int64_t r = 0; r < kHeadsRowsAhead; r++) fetch(r);
    int64_t r = 0;
    for (; r + R <= n_rows; r += R) {
        for (int k = 0; k < R; k++) fetch(r + kHeadsRowsAhead + k);
        const fp16_t* x[R];
        for (int k = 0; k < R; k++) x[k] = (const fp16_t*)(rows + (r + k) * stride);
        dot_f16_tile<O, R, Q>(n, s + r, s_stride, x, y);
    }
    for (; r < n_rows; r++) {
        const fp16_t* x = (const fp16_t*)(rows + r * stride);
        dot_f16_tile<O, 1, Q>(n, s + r, s_stride, &x, y);
    }
}

// Short rows (a key of head_dim 64 on AVX-512: one N-chunk for each of the four partial sums) of up to 3
// heads: the tile above keeps four partial sums of every (row, head) in memory, which costs more than the
// arithmetic on such rows. Here two rows at a time meet the Q heads with their accumulators in registers,
// 8 rows at a time, and each head's 8 sums are reduced together (hsum_ggml8). Every (row, head) sums as
// dot_f16_rows sums it alone. Measured (2 threads, against head by head): SmolLM2 (3 heads a KV head)
// decode at 2048 positions 3-10% faster, prompts of 512-1024 tokens 10-12%; one row at a time, or 4 heads
// with rows of 128 values (one row at a time: their accumulators fill the registers), ran slower than before.
template <class O>
constexpr bool short_heads(int64_t n, int n_y) {
    return O::N == 16 && n <= 4 * O::N && n_y <= 3;
}
// Shorter rows of more heads go head by head (attention.cpp): the tile's fixed cost per row outweighs the
// conversions it saves there (8 SmolLM2 sequences, head_dim 64, decoded 5% slower through it).
constexpr int64_t kHeadsMinLen = 128;

template <class O, int Q>
inline void dot_f16_short_q(int64_t n, float* s, int64_t s_stride, const uint8_t* rows, size_t stride,
                            const float* const* y, int64_t n_rows) {
    typedef typename O::V V;
    constexpr int N = O::N;
    constexpr int R = 2;  // (4 R Q accumulators, R rows and a head's vector: at most 27 of AVX-512's 32 registers)
    static_assert(Q <= 3, "short_heads: at most 3 heads");
    const int64_t chunks = O::kF16Chunks ? n / N : n / (4 * N) * 4;
    const size_t row_bytes = (size_t)n * sizeof(fp16_t);
    auto fetch = [&](int64_t r) {
        if (r >= n_rows) return;
        const uint8_t* p = rows + r * stride;
        for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    };
    for (int64_t r = 0; r < 2 * kHeadsRowsAhead; r++) fetch(r);
    for (int64_t r0 = 0; r0 < n_rows; r0 += 8) {
        const int nr = n_rows - r0 < 8 ? (int)(n_rows - r0) : 8;
        V folded[Q][8];
        for (int k = 0; k < 8; k += R) {
            const fp16_t* x[R];
            for (int i = 0; i < R; i++) {  // (past the last row: row r0 again, reduced but not stored)
                fetch(r0 + k + i + 2 * kHeadsRowsAhead);
                x[i] = (const fp16_t*)(rows + (r0 + (k + i < nr ? k + i : 0)) * stride);
            }
            V acc[R][4][Q];
            for (int i = 0; i < R; i++)
                for (int j = 0; j < 4; j++)
                    for (int q = 0; q < Q; q++) acc[i][j][q] = O::zero();
            for (int j = 0; j < 4 && j < chunks; j++) {  // (chunk j is partial sum j's only one: short_heads)
                V xv[R];
                for (int i = 0; i < R; i++) xv[i] = O::load_f16(x[i] + j * N);
                for (int q = 0; q < Q; q++) {
                    const V yv = O::load_f32(y[q] + j * N);
                    for (int i = 0; i < R; i++) acc[i][j][q] = O::fma(xv[i], yv, acc[i][j][q]);
                }
            }
            for (int i = 0; i < R; i++)
                for (int q = 0; q < Q; q++)
                    folded[q][k + i] = O::add(O::add(acc[i][0][q], acc[i][2][q]), O::add(acc[i][1][q], acc[i][3][q]));
        }
        for (int q = 0; q < Q; q++) {
            float red[8];
            O::hsum_ggml8(folded[q], red);
            for (int k = 0; k < nr; k++) {
                const fp16_t* x = (const fp16_t*)(rows + (r0 + k) * stride);
                double sum = red[k];
                for (int64_t i = chunks * N; i < n; i++) sum += (double)(fp16_to_fp32(x[i]) * y[q][i]);
                s[q * s_stride + r0 + k] = (float)sum;
            }
        }
    }
}

// attn_dot_heads_fn for F16: the heads' vectors converted to float once, then 4 heads at a time.
template <class O>
void attn_dot_heads_f16(int64_t n, float* s, int64_t s_stride, const void* rows, size_t stride, const void* ys,
                        size_t y_stride, int64_t n_rows, int n_y) {
    static thread_local std::vector<float> yf;
    if ((int64_t)yf.size() < n * n_y) yf.resize(n * n_y);
    const float* y[4];
    for (int q0 = 0; q0 < n_y; q0 += 4) {
        const int nq = n_y - q0 < 4 ? n_y - q0 : 4;
        for (int q = 0; q < nq; q++) {
            const fp16_t* src = (const fp16_t*)((const uint8_t*)ys + (q0 + q) * y_stride);
            float* dst = yf.data() + (q0 + q) * n;
            int64_t k = 0;
            for (; k + O::N <= n; k += O::N) O::store(dst + k, O::load_f16(src + k));
            for (; k < n; k++) dst[k] = fp16_to_fp32(src[k]);
            y[q] = dst;
        }
        float* sq = s + q0 * s_stride;
        const uint8_t* base = (const uint8_t*)rows;
        constexpr int R = O::kF16Rows;
        if (short_heads<O>(n, nq)) {
            if (nq == 3) dot_f16_short_q<O, 3>(n, sq, s_stride, base, stride, y, n_rows);
            else if (nq == 2) dot_f16_short_q<O, 2>(n, sq, s_stride, base, stride, y, n_rows);
            else dot_f16_short_q<O, 1>(n, sq, s_stride, base, stride, y, n_rows);
            continue;
        }
        if (nq == 4) dot_f16_heads_q<O, R, 4>(n, sq, s_stride, base, stride, y, n_rows);
        else if (nq == 3) dot_f16_heads_q<O, R, 3>(n, sq, s_stride, base, stride, y, n_rows);
        else if (nq == 2) dot_f16_heads_q<O, R, 2>(n, sq, s_stride, base, stride, y, n_rows);
        else dot_f16_heads_q<O, R, 1>(n, sq, s_stride, base, stride, y, n_rows);
    }
}

}  // namespace
}  // namespace optiml
