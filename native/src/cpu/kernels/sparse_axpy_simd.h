// The column-sparse down projection's kernels (contract: kernels.h, axpy_fn), written once against a float
// vector type FV (simd_x86.h: F32x8, F32x16; simd_neon.h: F32x4) and instantiated by each instruction
// set's file (sparse_axpy_avx2.cpp, sparse_axpy_avx512.cpp, sparse_axpy_neon.cpp) after its vector header.
//
// Up to four neurons per pass over y: y is loaded and stored once per four rows read, and each element
// still gets one fused multiply-add per neuron in list order (for Q8_0: fma(a[i] * d_block, q, y)), so
// every width gives the scalar reference's bits (sparse_axpy.cpp).
#pragma once

#include <cmath>

namespace optiml {
namespace {

// Rows i0 .. i0+3 (fewer at the end of the list) at byte offset off; returns how many.
template <typename T>
inline int axpy_rows_at(const void* const* w, size_t off, int64_t i0, int64_t k, const T** x) {
    int c = 0;
    for (; c < 4 && i0 + c < k; c++) x[c] = (const T*)((const uint8_t*)w[i0 + c] + off);
    return c;
}

// One pass of M Q8_0 rows over y (nb blocks). nxt: the rows of the next pass (n_nxt of them), far: those
// of the pass after it, prefetched block by block in step with this one (into L1 and L2). The rows are
// scattered and each thread reads only its slice of them (a few dozen cache lines), too short a stream
// for the hardware prefetcher to get going on its own.
template <class FV, int M>
void axpy_q8_0_pass(int64_t nb, float* y, const block_q8_0* const* b, const float* a, const block_q8_0* const* nxt,
                    int n_nxt, const block_q8_0* const* far, int n_far) {
    typedef typename FV::V V;
    constexpr int C = OPTIML_QK8_0 / FV::N;  // vectors per block
    for (int64_t j = 0; j < nb; j++) {
        for (int m = 0; m < n_nxt; m++) FV::prefetch(nxt[m] + j);
        for (int m = 0; m < n_far; m++) FV::prefetch_l2(far[m] + j);
        float* yj = y + j * OPTIML_QK8_0;
        V v[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) v[c] = FV::load_f32(yj + FV::N * c);
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) {
            const block_q8_0& blk = b[m][j];
            const V s = FV::set1(a[m] * h2f(blk.d));
            V q[C];
            FV::load_q8x32(blk.qs, q);
#pragma GCC unroll 8
            for (int c = 0; c < C; c++) v[c] = FV::fma(s, q[c], v[c]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) FV::store(yj + FV::N * c, v[c]);
    }
}

template <class FV>
void axpy_q8_0(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const int64_t nb = n / OPTIML_QK8_0;
    const block_q8_0* b[4];
    const block_q8_0* nxt[4];
    const block_q8_0* far[4];
    int cur = axpy_rows_at(w, off, 0, k, b);
    for (int64_t i = 0; i < k; i += 4) {
        const int n_nxt = axpy_rows_at(w, off, i + 4, k, nxt);
        const int n_far = axpy_rows_at(w, off, i + 8, k, far);
        switch (cur) {
            case 4: axpy_q8_0_pass<FV, 4>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            case 3: axpy_q8_0_pass<FV, 3>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            case 2: axpy_q8_0_pass<FV, 2>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            default: axpy_q8_0_pass<FV, 1>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
        }
        for (int m = 0; m < n_nxt; m++) b[m] = nxt[m];
        cur = n_nxt;
    }
}

// Float rows: E is ElemF32 or ElemF16 (simd_elem.h).
template <class FV, class E, int M>
void axpy_float_pass(int64_t n, float* y, const typename E::T* const* x, const float* a) {
    typedef typename FV::V V;
    V s[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; m++) s[m] = FV::set1(a[m]);
    int64_t r = 0;
    for (; r + FV::N <= n; r += FV::N) {
        V v = FV::load_f32(y + r);
#pragma GCC unroll 4
        for (int m = 0; m < M; m++) v = FV::fma(s[m], E::template load<FV>(x[m] + r), v);
        FV::store(y + r, v);
    }
    for (; r < n; r++)  // only at the very end of y (slices are 32-aligned)
        for (int m = 0; m < M; m++) y[r] = std::fma(a[m], E::one(x[m][r]), y[r]);
}

template <class FV, class E>
void axpy_float(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const typename E::T* x[4];
    for (int64_t i = 0; i < k; i += 4) {
        switch (axpy_rows_at(w, off, i, k, x)) {
            case 4: axpy_float_pass<FV, E, 4>(n, y, x, a + i); break;
            case 3: axpy_float_pass<FV, E, 3>(n, y, x, a + i); break;
            case 2: axpy_float_pass<FV, E, 2>(n, y, x, a + i); break;
            default: axpy_float_pass<FV, E, 1>(n, y, x, a + i); break;
        }
    }
}

template <class FV>
inline void fill_axpy(KernelTable& t) {
    t.axpy[TYPE_F32] = axpy_float<FV, ElemF32>;
    t.axpy[TYPE_F16] = axpy_float<FV, ElemF16>;
    t.axpy[TYPE_Q8_0] = axpy_q8_0<FV>;
}

}  // namespace
}  // namespace optiml
