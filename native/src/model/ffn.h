// The feed-forward block of one layer, kept apart from the rest of the forward pass: this is the
// unit that is split by neuron between CPU and GPU and computed sparsely.
#pragma once

#include "optiml/model.h"

namespace optiml {

struct FFNScratch {
    float* xn;    // [n][n_embd]
    float* gate;  // [n][n_ff]
    float* up;    // [n][n_ff]
};

// x[t] += down(act(gate(rms_norm(x[t]))) * up(rms_norm(x[t]))) for t in [0, n), the sum passed through
// rms_norm with w.post_norm first when there is one (Gemma 3).
void ffn_dense(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w, float* x, int32_t n,
               const FFNScratch& s);

// Matrices sharing one input: one conversion and one dispatch when their activation types agree.
void matmul_shared_input(ThreadPool& pool, const KernelTable& kt, const Weight* const* w, float* const* y, int n_mats,
                         const float* x, int32_t n, bool accumulate = false);

// rows[t] += bias for t in [0, n) (rows of bias.cols floats); nothing when the bias is absent.
void add_bias_rows(const Weight& bias, float* rows, int32_t n);

// x[t] += post_norm(W in[t] + bias) for t in [0, n), the norm and bias only when present: how the
// attention and FFN outputs join the residual stream. With a norm, the projection is made in `scratch`
// ([n][n_embd]) and normalized whole first (a split FFN sums its parts before that norm).
void add_to_residual(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const Weight& w, const Weight& bias,
                     const Weight& post_norm, const float* in, int32_t n, float* x, float* scratch);

// rms_norm of each of n rows of `dim` floats, rows split across the pool when there are many.
void rms_norm_rows(ThreadPool& pool, const float* x, const Weight& w, float* out, int32_t n, int64_t dim, float eps);

}  // namespace optiml
