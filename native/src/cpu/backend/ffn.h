// The CPU's feed-forward block and the helpers the CPU backend's ops share (native/src/cpu/backend/ffn*.cpp).
// An FFN is computed as a share of neurons (backend.h: FFNShare): the whole layer, a device's packed
// part, or the host's part of a split layer, dense or sparse.
#pragma once

#include "optiml/backend.h"
#include "optiml/model.h"

#include <functional>

namespace optiml {

// f(t) for every token t of a batch: tokens split across threads, or inline for one token (no
// hand-off for the common decoding step).
template <typename F>
void per_token(ThreadPool& pool, int32_t n, const F& f) {
    if (n == 1) {
        f(0);
        return;
    }
    pool.run([&](int ith, int nth) {
        int64_t t0, t1;
        split_range(n, ith, nth, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) f(t);
    });
}

struct FFNScratch {
    float* gate;  // [n][n_ff]
    float* up;    // [n][n_ff]
};

// Sees one layer's FFN while it runs dense: its input after the norm, act(gate), up and act(gate) * up.
typedef std::function<void(const float* xn, const float* a, const float* u, const float* h)> FFNObserver;

// y[t] = down(act(gate(xn[t])) * up(xn[t])) over the neurons of `share` (see FFNShare in backend.h):
// every neuron of share.w, or only share.rows of it (the others contribute nothing). A share with no
// down matrix (share.w->down absent) sums its neurons' neuron-major down rows instead. With an observer
// (whole FFNs only), act(gate) is also computed apart, into act_buf ([n][n_ff]), and shown to it.
void ffn_dense(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share, const float* xn,
               int32_t n, const FFNScratch& s, float* y, const FFNObserver* observe = nullptr,
               float* act_buf = nullptr);

// The share's gate and up products with their biases, [n][share.w->gate.rows] each: every neuron of a
// whole or packed share; a share with rows fills those neurons only and zeroes the others.
void ffn_gate_up(ThreadPool& pool, const KernelTable& kt, const FFNShare& share, const float* xn, int32_t n,
                 float* gate, float* up);

// A split layer's FFN finished on the host as one device computes it whole (Backend::ffn_finish): the
// other share's gate2/up2 ([n][k2], file neurons rows2) put into s.gate/s.up beside this share's (which
// ffn_gate_up wrote, full width), then act(gate) * up and the whole down product into y.
void ffn_finish_split(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                      const float* gate2, const float* up2, const int32_t* rows2, int64_t k2, int32_t n,
                      const FFNScratch& s, float* y);

// Scratch of the sparse FFN for up to n tokens.
struct SparseScratch {
    int32_t* idx;    // [n][n_ff]: token t's active neurons from idx + t * n_ff
    float* val;      // [n][n_ff]: their activations act(gate) * up
    int32_t* count;  // [n]
    int32_t* uni;    // [n_ff]: the union over tokens of the active neurons
    uint8_t* seen;   // [n_ff]
    float* z;        // [n][rank]: the predictor's low-rank projection (with a predictor only)
};

// The same FFN computing only neurons whose |act(gate)| (on_product: |act(gate) * up|) is above the
// threshold: the criterion over the share's neurons, up rows of active neurons only, and the down
// projection as a sum of the active neurons' neuron-major columns (share.down_nm), or the dense down
// over the zero-padded activations when too many are active. Returns the (token, neuron) activations
// computed. With sp.predictor, gate and up are computed only for the union over tokens of the neurons
// the predictor marks active (its own two small products come first); the criterion then filters those.
int64_t ffn_sparse(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                   const FFNSparsity& sp, const float* xn, int32_t n, const FFNScratch& s, const SparseScratch& ss,
                   float* y);

// n floats of 1 (act(g) alone is act_mul with a row of ones), held per thread.
const float* ones(size_t n);

// act(g) * u in place over n rows of n_ff, the pool splitting rows when there are many.
void ffn_activate(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w, float* g,
                  const float* u, int32_t n, int64_t n_ff);

// y[t] = sum over the share's neurons j of h[t][j] * neuron-major down row of j (share.down_nm, rows
// through share.nm_slot): the down projection of a share stored neuron-major only.
void ffn_down_neuron_major(ThreadPool& pool, const KernelTable& kt, const FFNShare& share, const float* h,
                           int64_t width, int32_t n, int64_t n_embd, float* y);

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
