// IQ4_XS against Q8_K activations: per super-block, each 32-value sub-block's codes looked up in IQ4_NL's
// table (vpshufb), their integer dot with the activation (signed values: |v| . (x with v's sign)) times the
// sub-block's six-bit scale, summed exactly in 8 int32 lanes; then acc += d_w * d_x * float(sum), the
// scalar kernel's arithmetic (vec_dot_scalar.cpp), so every level gives the same bits. IQ4_NL itself is a
// 32-element format (simd_q32.h).
#pragma once

#include <algorithm>

#include "simd_q32.h"

namespace optiml {
namespace {

inline void vec_dot_iq4_xs(int64_t n, float* s, const void* vw, const void* vx) {
    const block_iq4_xs* w = (const block_iq4_xs*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    const __m256i lut = iq4nl_lut();
    float sumf = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i acc = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const __m256i v = _mm256_shuffle_epi8(lut, unpack_nibbles_16(w[i].qs + 16 * ib));
            const __m256i xv = load256(x[i].qs + 32 * ib);
            acc = dot_u8s8_scaled(acc, _mm256_sign_epi8(v, v), _mm256_sign_epi8(xv, v),
                                  _mm256_set1_epi16((short)iq4_xs_scale(w[i], ib)));
        }
        sumf += (x[i].d * h2f(w[i].d)) * (float)hsum_epi32(acc);
    }
    *s = sumf;
}

// The batched product: tiles of NR rows by NT tokens, each sub-block's codes looked up once for the tile's
// tokens; every (row, token) runs vec_dot_iq4_xs's arithmetic, so it gets vec_dot's bits. Rows and tokens
// left over at the edges take vec_dot itself.
template <int NR, int NT>
inline void iq4_xs_tile(int64_t nb, const block_iq4_xs* const* w, const block_q8_K* const* x, float out[NR][NT]) {
    const __m256i lut = iq4nl_lut();
    float sumf[NR][NT] = {};
    for (int64_t i = 0; i < nb; i++) {
        __m256i acc[NR][NT];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            __m256i v[NR], av[NR], sc[NR];
            for (int r = 0; r < NR; r++) {
                v[r] = _mm256_shuffle_epi8(lut, unpack_nibbles_16(w[r][i].qs + 16 * ib));
                av[r] = _mm256_sign_epi8(v[r], v[r]);
                sc[r] = _mm256_set1_epi16((short)iq4_xs_scale(w[r][i], ib));
            }
            for (int t = 0; t < NT; t++) {
                const __m256i xv = load256(x[t][i].qs + 32 * ib);
                for (int r = 0; r < NR; r++)
                    acc[r][t] = dot_u8s8_scaled(acc[r][t], av[r], _mm256_sign_epi8(xv, v[r]), sc[r]);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < NT; t++) sumf[r][t] += (x[t][i].d * h2f(w[r][i].d)) * (float)hsum_epi32(acc[r][t]);
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) out[r][t] = sumf[r][t];
}

inline void gemm_iq4_xs(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                        int64_t n_tok) {
    constexpr int NR = 2, NT = 4;
    const int64_t nb = n / 256;
    auto token = [&](int64_t t) { return (const block_q8_K*)((const uint8_t*)x + t * x_stride); };
    for (int64_t r0 = 0; r0 < n_rows; r0 += NR) {
        for (int64_t t0 = 0; t0 < n_tok; t0 += NT) {
            if (r0 + NR <= n_rows && t0 + NT <= n_tok) {
                const block_iq4_xs* w[NR];
                const block_q8_K* xs[NT];
                for (int r = 0; r < NR; r++) w[r] = (const block_iq4_xs*)rows[r0 + r];
                for (int t = 0; t < NT; t++) xs[t] = token(t0 + t);
                float out[NR][NT];
                iq4_xs_tile<NR, NT>(nb, w, xs, out);
                for (int r = 0; r < NR; r++)
                    for (int t = 0; t < NT; t++) s[(t0 + t) * n_rows + r0 + r] = out[r][t];
            } else {
                for (int64_t r = r0; r < std::min(r0 + NR, n_rows); r++)
                    for (int64_t t = t0; t < std::min(t0 + NT, n_tok); t++)
                        vec_dot_iq4_xs(n, &s[t * n_rows + r], rows[r], token(t));
            }
        }
    }
}

}  // namespace
}  // namespace optiml
