// Activation conversion (float rows -> Q8_0, Q8_1, Q8_K, F16, BF16), byte-identical to the scalar
// reference (native/src/quant/*) on every x86 level.
#pragma once

#include "simd_x86.h"

namespace optiml {
namespace {

// 32 int32 (4 vectors) -> 32 int8 in order.
inline __m256i pack_i32x32_to_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b);  // lanes interleaved: a0 b0 | a1 b1
    const __m256i cd = _mm256_packs_epi32(c, d);
    const __m256i p = _mm256_packs_epi16(ab, cd);  // a0 b0 c0 d0 | a1 b1 c1 d1 (4-byte groups)
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Quantizes one block of 32 activations to int8 as the scalar activation_row_q8_0 does (id = 127/amax,
// ties to even); returns d (float, before fp16 rounding).
inline float quantize_block_q8(const float* x, int8_t* qs, __m256i* sum32) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    const float amax = hmax_ps(mx);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    // cvtps_epi32 rounds to nearest even in the default MXCSR mode.
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
    if (sum32) *sum32 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    _mm256_storeu_si256((__m256i*)qs, pack_i32x32_to_i8(i0, i1, i2, i3));
    return d;
}

void from_float_q8_0(const float* x, void* y, int64_t n) {
    block_q8_0* out = (block_q8_0*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, nullptr);
        out[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    }
}

void from_float_q8_1(const float* x, void* y, int64_t n) {
    block_q8_1* out = (block_q8_1*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i sum32;
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, &sum32);
        out[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        out[i].s = _cvtss_sh(d * (float)hsum_epi32(sum32), _MM_FROUND_TO_NEAREST_INT);
    }
}

// Q8_K: scale from the element of largest magnitude (first one on ties, keeping its sign),
// round-to-nearest-even, clamp to 127.
void from_float_q8_K(const float* x, void* y, int64_t n) {
    block_q8_K* out = (block_q8_K*)y;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < n / OPTIML_QK_K; i++) {
        const float* xb = x + OPTIML_QK_K * i;
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < OPTIML_QK_K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + k), absmask));
        const float amax = hmax_ps(mx);
        if (amax == 0.0f) {
            std::memset(&out[i], 0, sizeof(block_q8_K));
            continue;
        }
        float max = 0;
        const __m256 va = _mm256_set1_ps(amax);
        for (int k = 0; k < OPTIML_QK_K; k += 8) {
            const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(xb + k), absmask), va, _CMP_EQ_OQ));
            if (m) { max = xb[k + __builtin_ctz((unsigned)m)]; break; }
        }
        const float iscale = -127.f / max;
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int k = 0; k < OPTIML_QK_K; k += 32) {
            __m256i q[4];
            for (int t = 0; t < 4; t++) {
                const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * t), vs),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[t] = _mm256_min_epi32(_mm256_cvtps_epi32(v), lim);
            }
            const __m256i p = pack_i32x32_to_i8(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i*)(out[i].qs + k), p);
            // bsums of the two groups of 16 in these 32 bytes.
            const __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
            out[i].bsums[k / 16] = (int16_t)hsum_epi32_128(_mm256_castsi256_si128(s16));
            out[i].bsums[k / 16 + 1] = (int16_t)hsum_epi32_128(_mm256_extracti128_si256(s16, 1));
        }
        out[i].d = 1 / iscale;
    }
}

void from_float_f16(const float* x, void* y, int64_t n) {
    fp16_t* out = (fp16_t*)y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = fp32_to_fp16(x[i]);
}

// The scalar fp32_to_bf16 in integer lanes (vcvtneps2bf16 would flush denormals, so it is not used).
void from_float_bf16(const float* x, void* y, int64_t n) {
    bf16_t* out = (bf16_t*)y;
    int64_t i = 0;
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int t = 0; t < 2; t++) {
            const __m256i u = _mm256_loadu_si256((const __m256i*)(x + i + 8 * t));
            const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            const __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64));
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i rv = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
            r[t] = _mm256_blendv_epi8(rv, nanv, isnan);
        }
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i*)(out + i), p);
    }
    for (; i < n; i++) out[i] = fp32_to_bf16(x[i]);
}

}  // namespace
}  // namespace optiml
