// Matrix-vector and matrix-matrix products of weight matrices in any supported type with float
// activations, split across a thread pool by weight rows.
#pragma once

#include <cstdint>

#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace optiml {

// `rows` rows of `cols` elements of `type`, row-major, rows packed row_size(type, cols) apart.
struct WeightMatrix {
    int32_t type;
    int64_t rows;
    int64_t cols;
    const void* data;
    bool rows16 = false;  // in the rows16 layout (optiml/rows16.h) rather than row after row
};

// For each matrix m: Y[m][t][r] = dot(W[m] row r, X[t]) (or += with accumulate), for n_tokens
// activation vectors X[t] of `cols` floats. The matrices share the input, so they must have the same
// cols and vec_dot_type; the input is converted once and all rows go through one pool dispatch.
// n_tokens == 1 is the matrix-vector product. rows16 matrices need a level with gemm_rows16 for their type.
void matmul_many(ThreadPool& pool, const KernelTable& kt, const WeightMatrix* w, float* const* y, int n_mats,
                 const float* X, int64_t n_tokens, bool accumulate = false);

inline void matmul(ThreadPool& pool, const KernelTable& kt, int32_t wtype, const void* W, int64_t rows,
                   int64_t cols, const float* X, int64_t n_tokens, float* Y, bool accumulate = false) {
    const WeightMatrix m{wtype, rows, cols, W};
    matmul_many(pool, kt, &m, &Y, 1, X, n_tokens, accumulate);
}

// Converts n_tokens rows of `cols` floats (X) to the weights' vec_dot_type, x_row bytes apart in xq:
// a few rows on the calling thread, more across the pool.
void convert_activations(ThreadPool& pool, from_float_fn convert, const float* X, int64_t cols, int64_t n_tokens,
                         uint8_t* xq, size_t x_row);

// X (n_tokens rows of `cols` floats) in the activation type xtype, for a product: X itself for F32, else
// converted into a buffer of the calling thread, valid until its next call.
const uint8_t* activations_for(ThreadPool& pool, const KernelTable& kt, int32_t xtype, const float* X, int64_t cols,
                               int64_t n_tokens);

// x (n_tokens rows of activations in Q8_K, x_row bytes apart) laid out for the level's gemm_pre, once for
// all the row chunks of a product: into a buffer of the calling thread, valid until its next call. Only
// where kt.gemm_x is set.
const uint8_t* gemm_x_for(ThreadPool& pool, const KernelTable& kt, const uint8_t* x, size_t x_row, int64_t cols,
                          int64_t n_tokens);

// Checks that (wtype, cols) can be multiplied; throws ArgumentError naming the problem.
void check_matmul_args(int32_t wtype, int64_t cols);

}  // namespace optiml
