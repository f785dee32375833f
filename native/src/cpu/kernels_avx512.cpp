// AVX-512 kernels (F/BW/VL/DQ + VNNI + BF16): the shared 256-bit quant bodies rebuilt with vpdpbusd,
// and 512-bit float dots. 512-bit versions of the 32-block quants (two blocks per zmm) were tried and
// measured no faster than the 256-bit ones on Zen 4, and they summed blocks in a different order from
// llama.cpp (which runs its 256-bit kernels on AVX-512 machines too), so its greedy outputs drifted
// further from llama.cpp's; the 256-bit bodies are used instead.
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {
namespace {

inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

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

}  // namespace

void fill_kernels_avx512(KernelTable& t) {
    // simd_common.h compiled with VNNI: vpdpbusd replaces vpmaddubsw + vpmaddwd.
    t.vec_dot[TYPE_Q2_K] = vec_dot_q2_K;
    t.vec_dot[TYPE_Q3_K] = vec_dot_q3_K;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K;
    fill_dots_32(t);
    // 512-bit float dots.
    t.vec_dot[TYPE_F32] = vec_dot_f32_512;
    t.vec_dot[TYPE_F16] = vec_dot_f16_512;
    t.vec_dot[TYPE_BF16] = vec_dot_bf16_512;
}

}  // namespace optiml
