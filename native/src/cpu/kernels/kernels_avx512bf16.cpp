// AVX-512 BF16 (e.g. Cooper Lake, Sapphire Rapids, Zen 4): the BF16 dot product with vdpbf16ps.
#include "optiml/kernels.h"

#include "simd_x86.h"

namespace optiml {
namespace {

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
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    for (; i < n; i++) sum += bf16_to_fp32(a[i]) * bf16_to_fp32(b[i]);
    *s = sum;
}

}  // namespace

void fill_kernels_avx512bf16(KernelTable& t) {
    t.vec_dot[TYPE_BF16] = vec_dot_bf16_512;
    // vdpbf16ps adds each lane's two products one after the other (the odd element's first) and
    // treats denormals as zero, which no tile of simd_float.h reproduces: batches of BF16 weights go
    // through vec_dot one (row, token) at a time (matmul.cpp does that when gemm is null).
    t.gemm[TYPE_BF16] = nullptr;
}

}  // namespace optiml
