// Matrix-vector and matrix-matrix products of a weight matrix in any supported type with float
// activations, split across a thread pool by weight rows.
#pragma once

#include <cstdint>

#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace optiml {

// W: `rows` rows of `cols` elements of type `wtype`, row-major, rows packed (row_size(wtype, cols) apart).
// X: n_tokens activation vectors of `cols` floats. Y: n_tokens output vectors of `rows` floats.
// Y[t][r] = dot(W[r], X[t]). n_tokens == 1 is the matrix-vector product.
void matmul(ThreadPool& pool, const KernelTable& kt, int32_t wtype, const void* W, int64_t rows,
            int64_t cols, const float* X, int64_t n_tokens, float* Y);

// Checks that (wtype, cols) can be multiplied; throws ArgumentError naming the problem.
void check_matmul_args(int32_t wtype, int64_t cols);

}  // namespace optiml
