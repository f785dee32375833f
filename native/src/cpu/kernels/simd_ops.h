// The element-wise ops (silu, relu and table-GELU products, softmax's exponentials) and attention's dot
// products, written once against an ops type O: a float vector type (simd_x86.h: F32x8, F32x16;
// simd_neon.h: F32x4) plus what each instruction set does its own way, given by its file (ops_avx2.cpp,
// ops_avx512.cpp, ops_neon.cpp):
//   O::exp(v)              e^v lane by lane: ggml's vectorized expf for that instruction set, so silu
//                          and softmax give llama.cpp's bits on each;
//   O::gelu_lookup(t, v)   t[f16 bits of v] (round to nearest even, as the hardware converts);
//   O::kF32Rows, kF16Rows  how many rows attn_dot_rows takes at once (registers);
//   O::kF16Chunks          whether the F16 dot runs the whole N-chunks after its last 4N step through the
//                          vector unit (ggml takes them one by one).
// Each function ends with a scalar tail equal to the reference's (ops.cpp).
#pragma once

#include <cmath>

#include "attn_dot_heads.h"
#include "attn_dot_rows.h"
#include "ops.h"

namespace optiml {
namespace {

template <class O>
void silu_mul_simd(int64_t n, float* g, const float* u) {
    typedef typename O::V V;
    const V one = O::set1(1.0f);
    int64_t i = 0;
    for (; i + O::N <= n; i += O::N) {
        const V x = O::load_f32(g + i);
        const V s = O::div(x, O::add(one, O::exp(O::neg(x))));
        O::store(g + i, O::mul(s, O::load_f32(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

template <class O>
void relu_mul_simd(int64_t n, float* g, const float* u) {
    int64_t i = 0;
    for (; i + O::N <= n; i += O::N) O::store(g + i, O::mul(O::max0(O::load_f32(g + i)), O::load_f32(u + i)));
    for (; i < n; i++) g[i] = (g[i] > 0 ? g[i] : 0.0f) * u[i];
}

// llama.cpp's table GELU, N at a time: round to f16, look up, multiply; g itself past 10, 0 below -10.
template <class O>
void gelu_mul_simd(int64_t n, float* g, const float* u) {
    typedef typename O::V V;
    const float* table = gelu_table_f16();
    const V lo = O::set1(-10.0f), hi = O::set1(10.0f);
    int64_t i = 0;
    for (; i + O::N <= n; i += O::N) {
        const V x = O::load_f32(g + i);
        const V uv = O::load_f32(u + i);
        V y = O::mul(O::gelu_lookup(table, x), uv);
        y = O::select(O::ge(x, hi), O::mul(x, uv), y);
        y = O::select(O::le(x, lo), O::zero(), y);
        O::store(g + i, y);
    }
    for (; i < n; i++) {
        const float x = g[i];
        if (x <= -10.0f) g[i] = 0.0f;
        else if (x >= 10.0f) g[i] = x * u[i];
        else g[i] = table[fp32_to_fp16(x)] * u[i];
    }
}

// ggml_vec_soft_max_f32's loop: N at a time, each group's sum added in double.
template <class O>
double softmax_exp_simd(int64_t n, float* y, const float* x, float max) {
    double sum = 0;
    int64_t i = 0;
    for (; i + O::N <= n; i += O::N) {
        const typename O::V v = O::exp(O::sub(O::load_f32(x + i), O::set1(max)));
        O::store(y + i, v);
        sum += (double)O::hsum(v);
    }
    for (; i < n; i++) {
        y[i] = std::exp(x[i] - max);
        sum += y[i];
    }
    return sum;
}

// Attention's dots, R rows against the same y at once (y loaded and converted once for all of them);
// each row sums exactly as it would alone: attn_dot is this with R = 1.
//
// F32: one accumulator, N lanes at a time, horizontal sum at the end; a tail (n % N) in double.
template <class O, int R>
inline void dot_f32_rows(int64_t n, float* s, const float* const* x, const float* y) {
    typedef typename O::V V;
    V acc[R];
    for (int r = 0; r < R; r++) acc[r] = O::zero();
    int64_t i = 0;
    for (; i + O::N <= n; i += O::N) {
        const V yv = O::load_f32(y + i);
        for (int r = 0; r < R; r++) acc[r] = O::fma(O::load_f32(x[r] + i), yv, acc[r]);
    }
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) red[r] = O::hsum(acc[r]);
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(x[r][k] * y[k]);
        s[r] = (float)sum;
    }
}

// F16: chunk i of every row into its accumulator acc[r] (y's chunk converted once).
template <class O, int R>
inline void dot_f16_step(typename O::V* acc, const fp16_t* const* x, const fp16_t* y, int64_t i) {
    const typename O::V yv = O::load_f16(y + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = O::fma(O::load_f16(x[r] + i), yv, acc[r]);
}

// F16: four accumulators over steps of 4N, folded (0+2)+(1+3), summed in ggml's order, then a tail in
// double: ggml_vec_dot_f16's order, which llama.cpp's attention follows. With O::kF16Chunks the whole
// N-chunks left after the last 4N step (at most 3) go into accumulators 0, 1, 2 in turn: the attention's
// windows are multiples of 32, so with N = 16 a window of 32 mod 64 (every V dot of a context under 32)
// would run its last 32 elements scalar (15% of a 7B-shaped model's attention per decode step there).
template <class O, int R>
inline void dot_f16_rows(int64_t n, float* s, const fp16_t* const* x, const fp16_t* y) {
    typedef typename O::V V;
    constexpr int N = O::N;
    // Accumulator j of row r: a<j>[r] (four arrays with constant indices stay in registers).
    V a0[R], a1[R], a2[R], a3[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) a0[r] = a1[r] = a2[r] = a3[r] = O::zero();
    int64_t i = 0;
    for (; i + 4 * N <= n; i += 4 * N) {
        dot_f16_step<O, R>(a0, x, y, i);
        dot_f16_step<O, R>(a1, x, y, i + N);
        dot_f16_step<O, R>(a2, x, y, i + 2 * N);
        dot_f16_step<O, R>(a3, x, y, i + 3 * N);
    }
    if (O::kF16Chunks) {
        if (i + N <= n) dot_f16_step<O, R>(a0, x, y, i), i += N;
        if (i + N <= n) dot_f16_step<O, R>(a1, x, y, i), i += N;
        if (i + N <= n) dot_f16_step<O, R>(a2, x, y, i), i += N;
    }
    float red[R];  // reduced apart from the tails, so the accumulators stay in registers
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) red[r] = O::hsum_ggml(O::add(O::add(a0[r], a2[r]), O::add(a1[r], a3[r])));
    for (int r = 0; r < R; r++) {
        double sum = red[r];
        for (int64_t k = i; k < n; k++) sum += (double)(fp16_to_fp32(x[r][k]) * fp16_to_fp32(y[k]));
        s[r] = (float)sum;
    }
}

// attn_dot_heads for F16: rows shorter than kHeadsMinLen go head by head unless the short-row kernel takes
// them (attn_dot_heads.h); the bits are the same either way.
template <class O>
void attn_dot_heads_simd(int64_t n, float* s, int64_t s_stride, const void* rows, size_t stride, const void* ys,
                         size_t y_stride, int64_t n_rows, int n_y) {
    if (n < kHeadsMinLen && !short_heads<O>(n, n_y)) {
        for (int q = 0; q < n_y; q++)
            attn_dot_rows_by<fp16_t, O::kF16Rows, dot_f16_rows<O, O::kF16Rows>, dot_f16_rows<O, 1>>(
                n, s + q * s_stride, rows, stride, (const uint8_t*)ys + q * y_stride, n_rows);
        return;
    }
    attn_dot_heads_f16<O>(n, s, s_stride, rows, stride, ys, y_stride, n_rows, n_y);
}

template <class O>
void attn_dot_f32_simd(int64_t n, float* s, const void* a, const void* b) {
    const float* x = (const float*)a;
    dot_f32_rows<O, 1>(n, s, &x, (const float*)b);
}

template <class O>
void attn_dot_f16_simd(int64_t n, float* s, const void* a, const void* b) {
    const fp16_t* x = (const fp16_t*)a;
    dot_f16_rows<O, 1>(n, s, &x, (const fp16_t*)b);
}

// gelu_exact_mul stays scalar (tanh has no vector form here).
template <class O>
inline void fill_ops(KernelTable& t) {
    t.attn_dot[TYPE_F32] = attn_dot_f32_simd<O>;
    t.attn_dot[TYPE_F16] = attn_dot_f16_simd<O>;
    t.attn_dot_rows[TYPE_F32] = attn_dot_rows_by<float, O::kF32Rows, dot_f32_rows<O, O::kF32Rows>, dot_f32_rows<O, 1>>;
    t.attn_dot_rows[TYPE_F16] = attn_dot_rows_by<fp16_t, O::kF16Rows, dot_f16_rows<O, O::kF16Rows>, dot_f16_rows<O, 1>>;
    t.attn_dot_heads[TYPE_F16] = attn_dot_heads_simd<O>;
    t.softmax_exp = softmax_exp_simd<O>;
    t.silu_mul = silu_mul_simd<O>;
    t.relu_mul = relu_mul_simd<O>;
    t.gelu_mul = gelu_mul_simd<O>;
}

}  // namespace
}  // namespace optiml
