// AVX2 attn_mad (see attn_quant.cpp): the weighted sum of Q8_0 / Q4_0 value rows. A head's output (two
// blocks, 64 dimensions, at a time) stays in eight registers while every position's row streams past;
// each block costs one broadcast scale, its codes widened to floats and four multiply-adds.
#include <immintrin.h>

#include <algorithm>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {

namespace {

// The 32 codes of a block as four vectors of 8 floats (values 0..7, 8..15, 16..23, 24..31).
inline void codes_q8_0(const block_q8_0& x, __m256 f[4]) {
    const __m128i lo = _mm_loadu_si128((const __m128i*)x.qs);
    const __m128i hi = _mm_loadu_si128((const __m128i*)(x.qs + 16));
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

inline void codes_q4_0(const block_q4_0& x, __m256 f[4]) {
    const __m128i q = _mm_loadu_si128((const __m128i*)x.qs);
    const __m128i m = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m), eight);                     // values 0..15
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m), eight);  // values 16..31
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// NB blocks (1 or 2) starting at block b0 of every row.
template <typename Block, void (*Codes)(const Block&, __m256*), int NB>
void mad_blocks(float* y, const uint8_t* base, size_t stride, const float* w, int64_t n_rows, int64_t b0) {
    __m256 acc[4 * NB];
    for (int i = 0; i < 4 * NB; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t r = 0; r < n_rows; r++) {
        // Rows are a cache row apart, each a few blocks of a longer row: fetch a few ahead.
        if (r + 8 < n_rows) _mm_prefetch((const char*)(base + (size_t)(r + 8) * stride) + b0 * sizeof(Block), _MM_HINT_T0);
        if (w[r] == 0.0f) continue;  // masked: whatever a truncated sequence left there is not read
        const Block* x = (const Block*)(base + (size_t)r * stride) + b0;
        for (int k = 0; k < NB; k++) {
            const __m256 s = _mm256_set1_ps(w[r] * _cvtsh_ss(x[k].d));
            __m256 f[4];
            Codes(x[k], f);
            for (int i = 0; i < 4; i++) acc[4 * k + i] = _mm256_fmadd_ps(s, f[i], acc[4 * k + i]);
        }
    }
    for (int i = 0; i < 4 * NB; i++) _mm256_storeu_ps(y + b0 * 32 + 8 * i, acc[i]);
}

template <typename Block, void (*Codes)(const Block&, __m256*)>
void attn_mad_avx2(int64_t n, float* y, const void* rows, size_t stride, const float* w, int64_t n_rows) {
    const uint8_t* base = (const uint8_t*)rows;
    const int64_t nb = n / 32;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) mad_blocks<Block, Codes, 2>(y, base, stride, w, n_rows, b);
    if (b < nb) mad_blocks<Block, Codes, 1>(y, base, stride, w, n_rows, b);
}

}  // namespace

void fill_attn_quant_avx2(KernelTable& t) {
    t.attn_mad[TYPE_Q8_0] = attn_mad_avx2<block_q8_0, codes_q8_0>;
    t.attn_mad[TYPE_Q4_0] = attn_mad_avx2<block_q4_0, codes_q4_0>;
}

}  // namespace optiml
