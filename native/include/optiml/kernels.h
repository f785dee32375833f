// Dot-product kernels and their run-time selection by SIMD level.
//
// A dot product of a weight row of type T with an activation vector works like llama.cpp's: the
// activation is first converted to T's vec_dot_type (Q8_0 for Q4_0/Q5_0/Q8_0/MXFP4, Q8_1 for Q4_1/Q5_1,
// Q8_K for the k-quants, F16/BF16/F32 for the float types), then an integer or float dot runs block
// by block.
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/ggml_types.h"

namespace optiml {

enum SimdLevel : int {
    SIMD_SCALAR = 0,  // portable reference, every platform
    SIMD_AVX2 = 1,    // AVX2 + FMA + F16C (AVX-VNNI kernels are added when the CPU has it)
    SIMD_AVX512 = 2,  // AVX-512 F/BW/VL/DQ (VNNI and BF16 kernels are added when the CPU has them)
    SIMD_NEON = 3,    // aarch64 NEON (+ dotprod when present)
    SIMD_LEVEL_COUNT = 4,
};

const char* simd_level_name(SimdLevel level);

// *s = dot(w[0..n), x[0..n)); w is a row of the weight type, x is a row already in its vec_dot_type.
typedef void (*vec_dot_fn)(int64_t n, float* s, const void* w, const void* x);
// s[r] = dot(row r, y) for n_rows rows `stride` bytes apart, each with attn_dot's bits.
typedef void (*attn_dot_rows_fn)(int64_t n, float* s, const void* rows, size_t stride, const void* y, int64_t n_rows);
// s[q * s_stride + r] = dot(row r, y_q) for n_rows rows `stride` bytes apart and n_y vectors y_q
// (y_stride bytes apart), each with attn_dot's bits: the query heads of one KV head at once.
typedef void (*attn_dot_heads_fn)(int64_t n, float* s, int64_t s_stride, const void* rows, size_t stride,
                                  const void* y, size_t y_stride, int64_t n_rows, int n_y);
// s[t] = dot(w, x_t) for 4 activation rows x_t = x + t * x_stride bytes: a batch kernel that unpacks
// each weight block once; every s[t] equals what vec_dot gives for that row, bit for bit.
typedef void (*vec_dot4_fn)(int64_t n, float* s, const void* w, const void* x, size_t x_stride);
// s[r] = dot(rows[r], x) for n_rows weight rows and one activation row: a matrix-vector kernel that
// shares each activation block across several rows; every s[r] equals what vec_dot gives for that
// row, bit for bit (same per-row block order, interleaved across rows). rows holds n_rows +
// kRowsAhead pointers: those past the end are only prefetched (the rows that come next; repeat the
// last row when none do). Rows may lie anywhere: the dense product passes consecutive ones, the row-sparse
// product the active ones.
typedef void (*vec_dot_rows_fn)(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows);
constexpr int64_t kRowsAhead = 24;
// s[t * n_rows + r] = dot(rows[r], x_t) for r < n_rows and t < n_tok, x_t = x + t * x_stride bytes:
// the batched product, in register tiles of several rows and tokens, so that each unpacked weight
// block serves several tokens and each activation block several rows. Every s[t * n_rows + r]
// equals what vec_dot gives for that (row, token), bit for bit. Rows may lie anywhere (the
// row-sparse product passes the active ones).
typedef void (*gemm_fn)(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                        int64_t n_tok);
// The batched product over activations laid out for it beforehand (gemm_x), once for all of a product's
// row chunks and threads: s[t * ldo + r] = dot(rows[r], x_t), x_t = xa + t * gemm_x_row(n) bytes, with
// vec_dot's bits; the output is written in place (ldo floats a token), so no chunk copies it.
typedef void (*gemm_pre_fn)(int64_t n, float* s, int64_t ldo, const void* const* rows, int64_t n_rows, const void* xa,
                            int64_t n_tok);
// n_tok rows of Q8_K activations (x_stride bytes apart) into gemm_pre's layout, gemm_x_row(n) bytes a row:
// each super-block's codes 32-byte aligned (read in place, half of the loads would cross a cache line).
typedef void (*gemm_x_fn)(int64_t n, const void* x, size_t x_stride, int64_t n_tok, void* xa);
constexpr size_t kGemmXBlock = 320;  // bytes of a super-block of 256 activations in gemm_pre's layout
inline size_t gemm_x_row(int64_t n) { return (size_t)(n / 256) * kGemmXBlock; }
// The activations of a product with rows16 matrices (optiml/rows16.h), regrouped once per call for all
// its row chunks: for token group g (tokens 8g..8g+7) and block i, slot (g * nb + i) * 8 + t holds
// token 8g + t's 32 codes, its scale dx, its Q8_1 sum d * sum(q) (sx; Q8_1 only) and sum(q) (qsum).
struct Rows16Terms {
    std::vector<uint8_t> q;
    std::vector<float> dx, sx;
    std::vector<int32_t> qsum;
};
inline void rows16_terms_size(int64_t n_tok, int64_t nb, Rows16Terms& t) {
    const size_t n_slots = (size_t)((n_tok + 7) / 8) * (size_t)nb * 8;
    t.q.resize(n_slots * 32);
    t.dx.resize(n_slots);
    t.sx.resize(n_slots);
    t.qsum.resize(n_slots);
}
// Fills tokens [t0, t1) of terms sized by rows16_terms_size from activations x (xtype Q8_0 or Q8_1, rows
// x_stride bytes apart, nb blocks each); threads may fill disjoint ranges at once.
typedef void (*rows16_terms_fn)(int32_t xtype, const void* x, size_t x_stride, int64_t nb, int64_t t0, int64_t t1,
                                Rows16Terms& t);
// The product with a matrix in the rows16 layout: n_rows (a multiple of 16) rows from w, which is
// where row 0's panel starts, against tokens t0..t0 + n_tok - 1 of x (t0 a multiple of 8);
// s[t * ldo + r] = row r . token t0 + t.
typedef void (*gemm_rows16_fn)(int64_t n, float* s, int64_t ldo, const void* w, int64_t n_rows, const Rows16Terms& x,
                               int64_t t0, int64_t n_tok);
// Converts n floats into a row of an activation type (Q8_0, Q8_1, Q8_K, F16, BF16, F32).
typedef void (*from_float_fn)(const float* x, void* y, int64_t n);

// Attention's weighted sum of quantized value rows (Q8_0, Q4_0): y[d] = sum_r w[r] * row_r[d] for d < n
// (a multiple of 32), rows r < n_rows `stride` bytes apart; y is overwritten. Rows of weight 0 are not
// read. native/src/cpu/attn_quant*.cpp
typedef void (*attn_mad_fn)(int64_t n, float* y, const void* rows, size_t stride, const float* w, int64_t n_rows);
// y[i] = e^(x[i] - max) for i < n; returns the sum of the y[i] (accumulated in double).
typedef double (*softmax_exp_fn)(int64_t n, float* y, const float* x, float max);
// g[i] = act(g[i]) * u[i] (the gated FFN activation), in place.
typedef void (*act_mul_fn)(int64_t n, float* g, const float* u);
// y[r] += a[0] * w_0[r] + ... + a[k-1] * w_{k-1}[r] for r < n, where w_i is the row of the table's
// type starting w_offset bytes into w[i] (n and w_offset whole blocks). Each element is updated with
// one fused multiply-add per row, rows in list order (a scale per Q8_0 block: fma(a[i] * d, q, y)),
// so every SIMD level and every split of [0, n) gives the same bits. native/src/cpu/kernels/sparse_axpy*.cpp
typedef void (*axpy_fn)(int64_t n, float* y, const void* const* w, size_t w_offset, const float* a, int64_t k);
// Groups of grouped neuron-major rows (sparse.h), each group's coefficients quantized to int8 with one
// scale s (q[i] * s stands for neuron i's activation; q_sum = q[0] + ... + q[k-1]). For each group in
// list order and each row r < n: t[r] = sum_i q[i] * c_i[r] in integers, with c_i the 4-bit codes
// (0..15) of row i starting w_offset bytes into w[i], minus 8 * q_sum for Q4_0 (centred codes); then
// y[r] = fma(d[r] * s, (float)t[r], y[r]), and where there are minimums (Q4_1, Q4_K) y[r] = fma(m[r],
// s * (float)q_sum, y[r]); d and m are fp16 (Q4_0, Q4_1) or float (Q4_K). n is a multiple of 32 and
// k at most kMaxGroupRun (t[r] then is exact in float). The integer sums are exact and the float
// steps fixed: every SIMD level gives the same bits, whatever it does between groups.
struct GroupTerms {
    const void* const* w;
    const int8_t* q;
    int64_t k;
    int32_t q_sum;
    float s;
    const void* d;  // the scales of rows 0 .. n-1
    const void* m;  // the minimums (Q4_1, Q4_K), else null
};
typedef void (*axpy_group_fn)(int64_t n, float* y, size_t w_offset, const GroupTerms* groups, int n_groups);
// Up to max_rows row pointers (at byte offset off) from row `from` of g on, counted on through the
// groups after it (next[0 .. n_next)): the rows a kernel reads later, to prefetch. Returns how many.
inline int group_rows_ahead(const GroupTerms& g, const GroupTerms* next, int n_next, int64_t from, size_t off,
                            const uint8_t** out, int max_rows) {
    int got = 0;
    for (int h = -1; h < n_next && got < max_rows; h++) {
        const GroupTerms& gh = h < 0 ? g : next[h];
        for (; from < gh.k && got < max_rows; from++) out[got++] = (const uint8_t*)gh.w[from] + off;
        from = from > gh.k ? from - gh.k : 0;
    }
    return got;
}
// The most groups one axpy_group call takes (a kernel may keep y in registers across them).
constexpr int kGroupsPerCall = 4;
// The most rows one axpy_group call sums: |t[r]| <= 15 * 127 * 1024 < 2^24.
constexpr int64_t kMaxGroupRun = 1024;
// How far ahead (in dimensions) the axpy_group kernels prefetch a row; while a call runs, the caller
// prefetches the first kGroupPrefetchDims of the next call's rows and kGroupScalePrefetchDims of its
// scales (a longer stream: 2 or 4 bytes a dimension against half a byte a row).
constexpr int64_t kGroupPrefetchDims = 512;
constexpr int64_t kGroupScalePrefetchDims = 2048;

struct KernelTable {
    SimdLevel level;
    vec_dot_fn vec_dot[TYPE_COUNT];       // indexed by weight type
    vec_dot4_fn vec_dot4[TYPE_COUNT];     // optional, indexed by weight type
    vec_dot_rows_fn vec_dot_rows[TYPE_COUNT];  // optional, indexed by weight type
    // Optional, indexed by weight type. A level that has no gemm for a type leaves it null (the
    // scalar table has none): matmul then calls that level's vec_dot (or vec_dot4) per (row, token).
    gemm_fn gemm[TYPE_COUNT];
    // Optional (x86 k-quants), with gemm_x for their activations (Q8_K): gemm over activations laid out
    // once per product.
    gemm_pre_fn gemm_pre[TYPE_COUNT];
    gemm_x_fn gemm_x;
    // Optional, Q4_0/Q4_1/Q8_0 only: the product with rows16 matrices, for any number of tokens. Where a
    // level has it, a CPU-only model read into memory keeps its dense matrices in that layout.
    gemm_rows16_fn gemm_rows16[TYPE_COUNT];
    rows16_terms_fn rows16_terms;  // with gemm_rows16
    from_float_fn from_float[TYPE_COUNT];  // indexed by activation type
    // Attention's dot products (K.q and the weighted sum of V), for F16 and F32 rows. For F16 they sum
    // in ggml_vec_dot_f16's order and softmax_exp uses ggml's vectorized exp, so attention follows
    // llama.cpp's arithmetic (8-bit activations downstream make last bits decide close tokens).
    vec_dot_fn attn_dot[TYPE_COUNT];
    // Optional: attn_dot over many rows (K rows against q, V's dimension rows against the weights),
    // sharing y's loads and conversions; where null, attention calls attn_dot per row.
    attn_dot_rows_fn attn_dot_rows[TYPE_COUNT];
    // Optional: several heads' vectors against the same rows (each row converted once for all of
    // them); F16 only; where null, attention runs head by head.
    attn_dot_heads_fn attn_dot_heads[TYPE_COUNT];
    attn_mad_fn attn_mad[TYPE_COUNT];  // quantized values: Q8_0, Q4_0
    softmax_exp_fn softmax_exp;
    act_mul_fn silu_mul;                   // silu(g) * u, silu(x) = x / (1 + e^-x)
    act_mul_fn relu_mul;                   // max(g, 0) * u
    // gelu(g) * u with the tanh-approximated GELU, as llama.cpp's CPU geglu computes it: g rounded to
    // f16 and looked up in a table of gelu rounded to f16 (0 for g <= -10, g itself for g >= 10).
    act_mul_fn gelu_mul;
    act_mul_fn gelu_exact_mul;             // gelu(g) * u in float, no f16 rounding
    // Column-sparse down projection over neuron-major rows (sparse.h), indexed by the rows' type:
    // F32, F16 and Q8_0.
    axpy_fn axpy[TYPE_COUNT];
    axpy_group_fn axpy_group[TYPE_COUNT];  // grouped rows: Q4_0, Q4_1, Q4_K
};

// Attention's dots of n_rows rows (`stride` bytes apart) with y: the level's many-row kernel where it
// has one, attn_dot row by row otherwise (the same bits either way).
inline void attn_dots(const KernelTable& kt, int32_t type, int64_t n, float* s, const void* rows, size_t stride,
                      const void* y, int64_t n_rows) {
    if (kt.attn_dot_rows[type]) return kt.attn_dot_rows[type](n, s, rows, stride, y, n_rows);
    for (int64_t r = 0; r < n_rows; r++) kt.attn_dot[type](n, &s[r], (const uint8_t*)rows + r * stride, y);
}

// A quantized KV cache (native/src/cpu/attn_quant.cpp). kv_from_float: the conversion that writes a row
// of keys or values of `type` (F16, F32, Q8_0, Q4_0) into the cache, as llama.cpp's CPU writes it.
from_float_fn kv_from_float(const KernelTable& kt, int32_t type);
// s[r] = dot(row r, y) for n_rows quantized key rows `stride` bytes apart (type Q8_0 or Q4_0; y a row of
// Q8_0), by the level's many-row kernel where it has one; ptrs: room for n_rows + kRowsAhead pointers.
void kv_quant_dots(const KernelTable& kt, int32_t type, int64_t n, float* s, const void* rows, size_t stride,
                   const void* y, int64_t n_rows, const void** ptrs);

// The rotation that makes a quantized cache lose less (llama.cpp's attention rotation, PR #21038): an
// orthonormal Walsh-Hadamard transform of each head in stripes of kv_rotation_block(...) values, applied
// to q and k (q.k unchanged), and to v before it is stored and to the attention output after (H = H^T =
// H^-1). It spreads a head's outlier dimensions over its block, so one block scale fits all of them.
// 0: no rotation (an F16/F32 side, or a head dimension that is not a multiple of 64).
int64_t kv_rotation_block(int32_t type, int64_t head_dim, bool values);
void kv_rotate(float* x, int64_t n, int64_t block);

// Each SIMD file fills in the entries it implements and leaves the others untouched.
void fill_kernels_scalar(KernelTable& table);
void fill_kernels_avx2(KernelTable& table);
void fill_kernels_avxvnni(KernelTable& table);     // AVX2 level, when the CPU has AVX-VNNI
void fill_kernels_avx512(KernelTable& table);      // F/BW/VL/DQ
void fill_kernels_avx512vnni(KernelTable& table);  // + VNNI, when the CPU has it
void fill_kernels_avx512bf16(KernelTable& table);  // + BF16, when the CPU has it
void fill_kernels_neon(KernelTable& table);
// Element-wise ops (activations), native/src/cpu/kernels/ops*.cpp.
void fill_ops_scalar(KernelTable& table);
void fill_ops_avx2(KernelTable& table);
void fill_ops_avx512(KernelTable& table);
void fill_ops_neon(KernelTable& table);
// Sparse FFN kernels (axpy), native/src/cpu/kernels/sparse_axpy*.cpp.
void fill_sparse_scalar(KernelTable& table);
void fill_sparse_avx2(KernelTable& table);
void fill_sparse_avx512(KernelTable& table);
void fill_sparse_grouped_avx512vnni(KernelTable& table);  // grouped rows, when the CPU has VNNI
void fill_sparse_neon(KernelTable& table);
// Quantized KV cache kernels (attn_mad), native/src/cpu/attn_quant*.cpp.
void fill_attn_quant_scalar(KernelTable& table);
void fill_attn_quant_avx2(KernelTable& table);

// Is the level compiled into this build and supported by this CPU?
bool simd_level_available(SimdLevel level);
// The fastest available level (OPTIML_SIMD=scalar|avx2|avx512|neon in the environment lowers it).
SimdLevel best_simd_level();
// The table for a level: that level's kernels, with lower levels filling any gaps.
// Throws ArgumentError when the level is not available.
const KernelTable& kernel_table(SimdLevel level);
inline const KernelTable& kernel_table() { return kernel_table(best_simd_level()); }

}  // namespace optiml
