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
        if (nq == 4) dot_f16_heads_q<O, R, 4>(n, sq, s_stride, base, stride, y, n_rows);
        else if (nq == 3) dot_f16_heads_q<O, R, 3>(n, sq, s_stride, base, stride, y, n_rows);
        else if (nq == 2) dot_f16_heads_q<O, R, 2>(n, sq, s_stride, base, stride, y, n_rows);
        else dot_f16_heads_q<O, R, 1>(n, sq, s_stride, base, stride, y, n_rows);
    }
}

}  // namespace
}  // namespace optiml
