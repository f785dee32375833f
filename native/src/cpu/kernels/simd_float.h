// Float dot products (F32, F16 and BF16 weights against activations of the same type), written once
// against a float vector type FV (simd_x86.h: F32x8 for AVX2, F32x16 for AVX-512).
#pragma once

#include "simd_x86.h"

namespace optiml {
namespace {

// Four accumulators of FV::N lanes take the four FV::N-element chunks of each 4N step; whole chunks
// after the last 4N step go to the first accumulator; the sum is ((a0 + a1) + (a2 + a3)) reduced
// horizontally, then the last n % N elements one by one with fma.
template <class FV, class E>
void vec_dot_float(int64_t n, float* s, const void* w, const void* x) {
    typedef typename FV::V V;
    constexpr int N = FV::N;
    const typename E::T* a = (const typename E::T*)w;
    const typename E::T* b = (const typename E::T*)x;
    V acc0 = FV::zero(), acc1 = FV::zero(), acc2 = FV::zero(), acc3 = FV::zero();
    int64_t i = 0;
    for (; i + 4 * N <= n; i += 4 * N) {
        acc0 = FV::fma(E::template load<FV>(a + i), E::template load<FV>(b + i), acc0);
        acc1 = FV::fma(E::template load<FV>(a + i + N), E::template load<FV>(b + i + N), acc1);
        acc2 = FV::fma(E::template load<FV>(a + i + 2 * N), E::template load<FV>(b + i + 2 * N), acc2);
        acc3 = FV::fma(E::template load<FV>(a + i + 3 * N), E::template load<FV>(b + i + 3 * N), acc3);
    }
    for (; i + N <= n; i += N) acc0 = FV::fma(E::template load<FV>(a + i), E::template load<FV>(b + i), acc0);
    float sum = FV::hsum(FV::add(FV::add(acc0, acc1), FV::add(acc2, acc3)));
    for (; i < n; i++) sum = std::fma(E::one(a[i]), E::one(b[i]), sum);
    *s = sum;
}

// NR rows x NT tokens; s[t * s_stride + r] gets exactly vec_dot_float's value for (row r, token t).
// vec_dot_float's four accumulators are independent chains, so the tile runs them one after
// another: pass k keeps accumulator k of every pair in registers (NR * NT of them), each row's
// chunk is loaded (and converted) once for NT tokens and each token's chunk once for NR rows.
template <class FV, class E, int NR, int NT>
void tile_float(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
    typedef typename FV::V V;
    constexpr int N = FV::N;
    const typename E::T* a[NR];
    const typename E::T* b[NT];
    for (int r = 0; r < NR; r++) a[r] = (const typename E::T*)rows[r];
    for (int t = 0; t < NT; t++) b[t] = (const typename E::T*)(x + t * x_stride);
    V part[4][NR][NT];
    int64_t tail = 0;
    for (int k = 0; k < 4; k++) {
        V acc[NR][NT];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++) acc[r][t] = FV::zero();
        int64_t i = 0;
        auto step = [&](int64_t at) {
            V xv[NT];
            for (int t = 0; t < NT; t++) xv[t] = E::template load<FV>(b[t] + at);
            for (int r = 0; r < NR; r++) {
                const V wv = E::template load<FV>(a[r] + at);
                for (int t = 0; t < NT; t++) acc[r][t] = FV::fma(wv, xv[t], acc[r][t]);
            }
        };
        for (; i + 4 * N <= n; i += 4 * N) step(i + k * N);
        if (k == 0) {
            for (; i + N <= n; i += N) step(i);
            tail = i;
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++) part[k][r][t] = acc[r][t];
    }
    for (int r = 0; r < NR; r++) {
        for (int t = 0; t < NT; t++) {
            float sum = FV::hsum(FV::add(FV::add(part[0][r][t], part[1][r][t]), FV::add(part[2][r][t], part[3][r][t])));
            for (int64_t i = tail; i < n; i++) sum = std::fma(E::one(a[r][i]), E::one(b[t][i]), sum);
            s[t * s_stride + r] = sum;
        }
    }
}

template <class FV, class E>
struct FloatTile {
    static const void* const* prepare(int64_t, const void* const* rows, int64_t) { return rows; }
    template <int NR, int NT>
    static void run(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
        tile_float<FV, E, NR, NT>(n, s, s_stride, rows, x, x_stride);
    }
};

}  // namespace
}  // namespace optiml
