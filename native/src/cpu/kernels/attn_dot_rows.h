// attn_dot_rows from a kernel that takes RN rows at once (sharing y's loads) and its one-row form.
#pragma once

#include <cstddef>
#include <cstdint>

namespace optiml {
namespace {  // each SIMD file instantiates its own, from its own kernels

// How many rows ahead attn_dot_rows fetches. Attention's rows are scattered (V is stored a row per
// dimension, n_ctx values apart; a head's slice of a key is one of several in a cache row), so the
// hardware prefetcher does not see them coming: 8 sequences of SmolLM2 spent 9% of a step waiting
// for them. A few rows cost little time to compute, so the distance is generous.
constexpr int64_t kAttnRowsAhead = 16;

template <typename T, int RN, void (*RowsN)(int64_t, float*, const T* const*, const T*),
          void (*Rows1)(int64_t, float*, const T* const*, const T*)>
void attn_dot_rows_by(int64_t n, float* s, const void* rows, size_t stride, const void* y, int64_t n_rows) {
    const uint8_t* base = (const uint8_t*)rows;
    const size_t row_bytes = (size_t)n * sizeof(T);
    auto fetch = [&](int64_t r) {
        const uint8_t* p = base + r * stride;
        for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
    };
    for (int64_t r = 0; r < kAttnRowsAhead && r < n_rows; r++) fetch(r);
    int64_t r = 0;
    for (; r + RN <= n_rows; r += RN) {
        for (int k = 0; k < RN; k++)
            if (r + kAttnRowsAhead + k < n_rows) fetch(r + kAttnRowsAhead + k);
        const T* x[RN];
        for (int k = 0; k < RN; k++) x[k] = (const T*)(base + (r + k) * stride);
        RowsN(n, s + r, x, (const T*)y);
    }
    for (; r < n_rows; r++) {
        const T* x = (const T*)(base + r * stride);
        Rows1(n, s + r, &x, (const T*)y);
    }
}

}  // namespace
}  // namespace optiml
