// AVX-512 kernels for the column-sparse down projection (contract: kernels.h, axpy_fn): as the
// AVX2 ones, 16 lanes wide. Four neurons per pass over y, one fma per neuron and element in list
// order, so the bits equal the scalar reference.
#include <immintrin.h>

#include <cmath>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

inline __m512 q8x16(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))); }

// nxt: the rows of the next pass (n_nxt of them), prefetched block by block in step with this one.
// The rows are scattered and each thread reads only its slice of them (a few dozen cache lines),
// too short a stream for the hardware prefetcher to get going on its own.
template <int M>
void q8_0_pass(int64_t nb, float* y, const block_q8_0* const* b, const float* a, const block_q8_0* const* nxt,
               int n_nxt, const block_q8_0* const* far, int n_far) {
    for (int64_t j = 0; j < nb; j++) {
        for (int m = 0; m < n_nxt; m++) _mm_prefetch((const char*)(nxt[m] + j), _MM_HINT_T0);
        for (int m = 0; m < n_far; m++) _mm_prefetch((const char*)(far[m] + j), _MM_HINT_T1);
        float* yj = y + j * OPTIML_QK8_0;
        __m512 y0 = _mm512_loadu_ps(yj), y1 = _mm512_loadu_ps(yj + 16);
        for (int m = 0; m < M; m++) {
            const block_q8_0& blk = b[m][j];
            const __m512 s = _mm512_set1_ps(a[m] * _cvtsh_ss(blk.d));
            y0 = _mm512_fmadd_ps(s, q8x16(blk.qs), y0);
            y1 = _mm512_fmadd_ps(s, q8x16(blk.qs + 16), y1);
        }
        _mm512_storeu_ps(yj, y0);
        _mm512_storeu_ps(yj + 16, y1);
    }
}

void axpy_q8_0_avx512(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const int64_t nb = n / OPTIML_QK8_0;
    auto rows = [&](int64_t i0, const block_q8_0** b) {  // up to 4 rows from i0; returns how many
        int c = 0;
        for (; c < 4 && i0 + c < k; c++) b[c] = (const block_q8_0*)((const uint8_t*)w[i0 + c] + off);
        return c;
    };
    const block_q8_0* b[4];
    const block_q8_0* nxt[4];
    const block_q8_0* far[4];
    int cur = rows(0, b);
    for (int64_t i = 0; i < k; i += 4) {
        const int n_nxt = rows(i + 4, nxt);
        const int n_far = rows(i + 8, far);
        switch (cur) {
            case 4: q8_0_pass<4>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            case 3: q8_0_pass<3>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            case 2: q8_0_pass<2>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
            default: q8_0_pass<1>(nb, y, b, a + i, nxt, n_nxt, far, n_far); break;
        }
        for (int m = 0; m < n_nxt; m++) b[m] = nxt[m];
        cur = n_nxt;
    }
}

// Float rows: T is float or fp16_t; load16 widens 16 of them.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const fp16_t* x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x)); }
inline float load1(const float* x) { return *x; }
inline float load1(const fp16_t* x) { return _cvtsh_ss(*x); }

template <typename T, int M>
void float_pass(int64_t n, float* y, const T* const* x, const float* a) {
    __m512 s[M];
    for (int m = 0; m < M; m++) s[m] = _mm512_set1_ps(a[m]);
    int64_t r = 0;
    for (; r + 16 <= n; r += 16) {
        __m512 v = _mm512_loadu_ps(y + r);
        for (int m = 0; m < M; m++) v = _mm512_fmadd_ps(s[m], load16(x[m] + r), v);
        _mm512_storeu_ps(y + r, v);
    }
    for (; r < n; r++)  // only at the very end of y (slices are 32-aligned)
        for (int m = 0; m < M; m++) y[r] = std::fma(a[m], load1(x[m] + r), y[r]);
}

template <typename T>
void axpy_float_avx512(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    const T* x[4];
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) {
        for (int m = 0; m < 4; m++) x[m] = (const T*)((const uint8_t*)w[i + m] + off);
        float_pass<T, 4>(n, y, x, a + i);
    }
    for (int m = 0; m < k - i; m++) x[m] = (const T*)((const uint8_t*)w[i + m] + off);
    switch (k - i) {
        case 3: float_pass<T, 3>(n, y, x, a + i); break;
        case 2: float_pass<T, 2>(n, y, x, a + i); break;
        case 1: float_pass<T, 1>(n, y, x, a + i); break;
        default: break;
    }
}

}  // namespace

void fill_sparse_avx512(KernelTable& t) {
    t.axpy[TYPE_F32] = axpy_float_avx512<float>;
    t.axpy[TYPE_F16] = axpy_float_avx512<fp16_t>;
    t.axpy[TYPE_Q8_0] = axpy_q8_0_avx512;
}

}  // namespace optiml
