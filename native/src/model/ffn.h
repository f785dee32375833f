// The feed-forward block of one layer, kept apart from the rest of the forward pass: this is the
// unit that is split by neuron between CPU and GPU and computed sparsely.
#pragma once

#include "optiml/model.h"

namespace optiml {

#include <functional>

struct FFNScratch {
    float* xn;    // [n][n_embd]
    float* gate;  // [n][n_ff]
    float* up;    // [n][n_ff]
};

// Sees one layer's FFN while it runs dense: its input after the norm, act(gate), up and act(gate) * up.
typedef std::function<void(const float* xn, const float* a, const float* u, const float* h)> FFNObserver;

// x[t] += down(act(gate(rms_norm(x[t]))) * up(rms_norm(x[t]))) for t in [0, n), the sum passed through
// rms_norm with w.post_norm first when there is one (Gemma 3). With an observer, act(gate) is also
// computed apart, into act_buf ([n][n_ff]), and shown to it.
void ffn_dense(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w, float* x, int32_t n,
               const FFNScratch& s, const FFNObserver* observe = nullptr, float* act_buf = nullptr);

// Scratch of the sparse FFN for up to n tokens.
struct SparseScratch {
    int32_t* idx;    // [n][n_ff]: token t's active neurons from idx + t * n_ff
    float* val;      // [n][n_ff]: their activations act(gate) * up
    int32_t* count;  // [n]
    int32_t* uni;    // [n_ff]: the union over tokens of the active neurons
    uint8_t* seen;   // [n_ff]
};

// The same FFN, computing only neurons whose |act(gate)| (on_product: |act(gate) * up|) is above
// threshold: gate (and with on_product also up) dense, up rows of active neurons only, and the down
// projection as a sum of the active neurons' columns (down_nm, neuron-major). Returns the number of
// (token, neuron) activations computed.
// neuron_scale: nullptr, or [n_ff] per-neuron weights of the gate criterion: |act(gate)| * scale.
int64_t ffn_sparse(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w,
                   const NeuronMajor& down_nm, float threshold, bool on_product, const float* neuron_scale, float* x,
                   int32_t n, const FFNScratch& s, const SparseScratch& sp);

// n floats of 1 (act(g) alone is act_mul with a row of ones), held per thread.
const float* ones(size_t n);

// act(g) * u in place over n rows of n_ff, the pool splitting rows when there are many.
void ffn_activate(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w, float* g,
                  const float* u, int32_t n);

// x[t] += post_norm(y[t] + bias) for t in [0, n): a projection already computed joins the residual.
void join_residual(ThreadPool& pool, const HParams& hp, const Weight& bias, const Weight& post_norm, float* y,
                   int32_t n, float* x);

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
