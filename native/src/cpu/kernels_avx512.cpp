// AVX-512 kernels (F/BW/VL/DQ + VNNI + BF16). Only what beats the AVX2 table is registered here:
// the shared k-quant bodies rebuilt with vpdpbusd, and 512-bit versions of the 32-block quants and
// float types (two 32-blocks per zmm register).
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {
namespace {

inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// Two 32-blocks' scales, one per 256-bit half (the half that holds that block's int32 sums).
inline __m512 scales2(float d0, float d1) {
    return _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
}

inline __m512i load2x256(const void* p0, const void* p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)p0)),
                              _mm256_loadu_si256((const __m256i*)p1), 1);
}

// Two blocks' 16 packed bytes -> [b0 low nibbles, b0 high, b1 low, b1 high] (64 bytes, 0..15).
inline __m512i unpack_nibbles_2x16(const uint8_t* p0, const uint8_t* p1) {
    const __m256i v = _mm256_setr_m128i(_mm_loadu_si128((const __m128i*)p0), _mm_loadu_si128((const __m128i*)p1));
    const __m512i vv = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(_mm512_shuffle_i64x2(vv, vv, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(0x0F));
}

// Signed x signed int8 dot in groups of 4: |a| * (b negated where a < 0), then vpdpbusd.
inline __m512i dot_s8s8_512(__m512i a, __m512i b) {
    const __mmask64 neg = _mm512_movepi8_mask(a);
    const __m512i bs = _mm512_mask_sub_epi8(b, neg, _mm512_setzero_si512(), b);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(a), bs);
}

void vec_dot_f32_512(int64_t n, float* s, const void* w, const void* x) {
    const float* a = (const float*)w;
    const float* b = (const float*)x;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
        acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), acc2);
        acc3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), acc3);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    if (i < n) {  // masked tail
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc1);
    }
    *s = hsum512(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

inline __m512 load_f16x16(const fp16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

void vec_dot_f16_512(int64_t n, float* s, const void* w, const void* x) {
    const fp16_t* a = (const fp16_t*)w;
    const fp16_t* b = (const fp16_t*)x;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_fmadd_ps(load_f16x16(a + i), load_f16x16(b + i), acc0);
        acc1 = _mm512_fmadd_ps(load_f16x16(a + i + 16), load_f16x16(b + i + 16), acc1);
        acc2 = _mm512_fmadd_ps(load_f16x16(a + i + 32), load_f16x16(b + i + 32), acc2);
        acc3 = _mm512_fmadd_ps(load_f16x16(a + i + 48), load_f16x16(b + i + 48), acc3);
    }
    for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(load_f16x16(a + i), load_f16x16(b + i), acc0);
    float sum = hsum512(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
    for (; i < n; i++) sum += h2f(a[i]) * h2f(b[i]);
    *s = sum;
}

// vdpbf16ps: pairs of bf16 products (exact in fp32) added into fp32 lanes.
void vec_dot_bf16_512(int64_t n, float* s, const void* w, const void* x) {
    const bf16_t* a = (const bf16_t*)w;
    const bf16_t* b = (const bf16_t*)x;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32), (__m512bh)_mm512_loadu_si512(b + i + 32));
    }
    for (; i + 32 <= n; i += 32)
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    float sum = hsum512(_mm512_add_ps(acc0, acc1));
    for (; i < n; i++) sum += bf16_to_fp32(a[i]) * bf16_to_fp32(b[i]);
    *s = sum;
}

void vec_dot_q8_0_512(int64_t n, float* s, const void* w, const void* x) {
    const block_q8_0* a = (const block_q8_0*)w;
    const block_q8_0* b = (const block_q8_0*)x;
    const int64_t nb = n / 32;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m512i p0 = dot_s8s8_512(load2x256(a[i].qs, a[i + 1].qs), load2x256(b[i].qs, b[i + 1].qs));
        const __m512i p1 = dot_s8s8_512(load2x256(a[i + 2].qs, a[i + 3].qs), load2x256(b[i + 2].qs, b[i + 3].qs));
        acc0 = _mm512_fmadd_ps(scales2(h2f(a[i].d) * h2f(b[i].d), h2f(a[i + 1].d) * h2f(b[i + 1].d)), _mm512_cvtepi32_ps(p0), acc0);
        acc1 = _mm512_fmadd_ps(scales2(h2f(a[i + 2].d) * h2f(b[i + 2].d), h2f(a[i + 3].d) * h2f(b[i + 3].d)), _mm512_cvtepi32_ps(p1), acc1);
    }
    float tail = 0;
    if (i < nb) vec_dot_q8_0((nb - i) * 32, &tail, a + i, b + i);
    *s = hsum512(_mm512_add_ps(acc0, acc1)) + tail;
}

// Q4_0: sum (q-8)*x = dpbusd(q, x) - dpbusd(8, x), q unsigned 0..15.
inline __m512i q4_0_2blocks(const block_q4_0* a, const block_q8_0* b) {
    const __m512i q = unpack_nibbles_2x16(a[0].qs, a[1].qs);
    const __m512i xv = load2x256(b[0].qs, b[1].qs);
    const __m512i z = _mm512_setzero_si512();
    return _mm512_sub_epi32(_mm512_dpbusd_epi32(z, q, xv), _mm512_dpbusd_epi32(z, _mm512_set1_epi8(8), xv));
}

void vec_dot_q4_0_512(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_0* a = (const block_q4_0*)w;
    const block_q8_0* b = (const block_q8_0*)x;
    const int64_t nb = n / 32;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t i = 0;
    for (; i + 4 <= nb; i += 4) {
        const __m512i p0 = q4_0_2blocks(a + i, b + i);
        const __m512i p1 = q4_0_2blocks(a + i + 2, b + i + 2);
        acc0 = _mm512_fmadd_ps(scales2(h2f(a[i].d) * h2f(b[i].d), h2f(a[i + 1].d) * h2f(b[i + 1].d)), _mm512_cvtepi32_ps(p0), acc0);
        acc1 = _mm512_fmadd_ps(scales2(h2f(a[i + 2].d) * h2f(b[i + 2].d), h2f(a[i + 3].d) * h2f(b[i + 3].d)), _mm512_cvtepi32_ps(p1), acc1);
    }
    float tail = 0;
    if (i < nb) vec_dot_q4_0((nb - i) * 32, &tail, a + i, b + i);
    *s = hsum512(_mm512_add_ps(acc0, acc1)) + tail;
}

void vec_dot_q4_1_512(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_1* a = (const block_q4_1*)w;
    const block_q8_1* b = (const block_q8_1*)x;
    const int64_t nb = n / 32;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    float summs = 0;
    int64_t i = 0;
    const __m512i z = _mm512_setzero_si512();
    for (; i + 4 <= nb; i += 4) {
        const __m512i p0 = _mm512_dpbusd_epi32(z, unpack_nibbles_2x16(a[i].qs, a[i + 1].qs), load2x256(b[i].qs, b[i + 1].qs));
        const __m512i p1 = _mm512_dpbusd_epi32(z, unpack_nibbles_2x16(a[i + 2].qs, a[i + 3].qs), load2x256(b[i + 2].qs, b[i + 3].qs));
        acc0 = _mm512_fmadd_ps(scales2(h2f(a[i].d) * h2f(b[i].d), h2f(a[i + 1].d) * h2f(b[i + 1].d)), _mm512_cvtepi32_ps(p0), acc0);
        acc1 = _mm512_fmadd_ps(scales2(h2f(a[i + 2].d) * h2f(b[i + 2].d), h2f(a[i + 3].d) * h2f(b[i + 3].d)), _mm512_cvtepi32_ps(p1), acc1);
        for (int k = 0; k < 4; k++) summs += h2f(a[i + k].m) * h2f(b[i + k].s);
    }
    float tail = 0;
    if (i < nb) vec_dot_q4_1((nb - i) * 32, &tail, a + i, b + i);
    *s = hsum512(_mm512_add_ps(acc0, acc1)) + summs + tail;
}

}  // namespace

void fill_kernels_avx512(KernelTable& t) {
    // simd_common.h compiled with VNNI: vpdpbusd replaces vpmaddubsw + vpmaddwd.
    t.vec_dot[TYPE_Q2_K] = vec_dot_q2_K;
    t.vec_dot[TYPE_Q3_K] = vec_dot_q3_K;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K;
    t.vec_dot[TYPE_Q4_0] = vec_dot_q4_0_512;
    t.vec_dot[TYPE_Q4_1] = vec_dot_q4_1_512;
    t.vec_dot[TYPE_Q5_0] = vec_dot_q5_0;
    t.vec_dot[TYPE_Q5_1] = vec_dot_q5_1;
    t.vec_dot[TYPE_Q8_0] = vec_dot_q8_0_512;
    // 512-bit float dots.
    t.vec_dot[TYPE_F32] = vec_dot_f32_512;
    t.vec_dot[TYPE_F16] = vec_dot_f16_512;
    t.vec_dot[TYPE_BF16] = vec_dot_bf16_512;
}

}  // namespace optiml
