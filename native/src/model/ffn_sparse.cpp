// The FFN computed for active neurons only. The gate is computed densely (it decides who is active);
// the up rows and down columns of inactive neurons are never read.
#include <cmath>
#include <cstring>

#include "ffn.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {

// Below these shares the down projection runs as a sum of neuron columns; above them the dense kernel
// is faster. One token: compare bytes read; the 8-bit neuron-major rows cost more per neuron than
// most dense types, and the column sum (int8 -> float conversions, fma per value) streams them at
// about half the dense kernel's rate (7B shapes, AVX-512), hence 0.5. A batch: dense kernels reuse
// each weight block across tokens, so sparse must skip most of the work to win.
constexpr double kSparseDownBytes = 0.5;
constexpr double kSparseDownBatch = 0.25;

}  // namespace

int64_t ffn_sparse(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w,
                   const NeuronMajor& down_nm, float threshold, bool on_product, const float* neuron_scale, float* x,
                   int32_t n, const FFNScratch& s, const SparseScratch& sp) {
    const int64_t n_embd = hp.n_embd, n_ff = hp.n_ff;
    rms_norm_rows(pool, x, w.norm, s.xn, n, n_embd, hp.rms_eps);

    // 1. The criterion: act(gate) (then up only for active rows), or act(gate) * up (up dense).
    if (on_product) {
        const Weight* gate_up[2] = {&w.gate, &w.up};
        float* outs[2] = {s.gate, s.up};
        matmul_shared_input(pool, kt, gate_up, outs, 2, s.xn, n);
        add_bias_rows(w.gate_b, s.gate, n);
        add_bias_rows(w.up_b, s.up, n);
        ffn_activate(pool, kt, hp, w, s.gate, s.up, n);
    } else {
        const Weight* gate[1] = {&w.gate};
        matmul_shared_input(pool, kt, gate, &s.gate, 1, s.xn, n);
        add_bias_rows(w.gate_b, s.gate, n);
        ffn_activate(pool, kt, hp, w, s.gate, ones((size_t)(n * n_ff)), n);  // act(gate) alone
    }

    // 2. Each token's active neurons.
    auto select = [&](int64_t t) {
        const float* a = s.gate + t * n_ff;
        int32_t* idx = sp.idx + t * n_ff;
        float* val = sp.val + t * n_ff;
        int32_t c = 0;
        if (neuron_scale && !on_product) {
            for (int32_t j = 0; j < n_ff; j++) {
                if (std::fabs(a[j]) * neuron_scale[j] > threshold) {
                    idx[c] = j;
                    val[c] = a[j];
                    c++;
                }
            }
        } else {
            for (int32_t j = 0; j < n_ff; j++) {
                if (std::fabs(a[j]) > threshold) {
                    idx[c] = j;
                    val[c] = a[j];
                    c++;
                }
            }
        }
        sp.count[t] = c;
    };
    if (n == 1) {
        select(0);
    } else {
        pool.run([&](int ith, int nth) {
            int64_t t0, t1;
            split_range(n, ith, nth, &t0, &t1);
            for (int64_t t = t0; t < t1; t++) select(t);
        });
    }
    int64_t total = 0;
    for (int32_t t = 0; t < n; t++) total += sp.count[t];

    // 3. Up rows of the union of active neurons, and the activations act(gate) * up.
    if (!on_product) {
        const int32_t* uni = sp.idx;
        int64_t n_uni = sp.count[0];
        if (n > 1) {
            std::memset(sp.seen, 0, n_ff);
            for (int32_t t = 0; t < n; t++)
                for (int32_t i = 0; i < sp.count[t]; i++) sp.seen[sp.idx[t * n_ff + i]] = 1;
            n_uni = 0;
            for (int32_t j = 0; j < n_ff; j++)
                if (sp.seen[j]) sp.uni[n_uni++] = j;
            uni = sp.uni;
        }
        matmul_rows(pool, kt, w.up.matrix(), uni, n_uni, s.xn, n, s.up);
        const float* ub = w.up_b.present() ? (const float*)w.up_b.data : nullptr;
        const bool relu_up = hp.ffn_act == FFN_RELU2;
        for (int32_t t = 0; t < n; t++) {
            const int32_t* idx = sp.idx + t * n_ff;
            float* val = sp.val + t * n_ff;
            const float* u = s.up + t * n_ff;
            for (int32_t i = 0; i < sp.count[t]; i++) {
                float uj = u[idx[i]] + (ub ? ub[idx[i]] : 0.0f);
                if (relu_up && uj < 0) uj = 0;
                val[i] *= uj;
            }
        }
    }

    // 4. The down projection into s.xn (free now), then into the residual stream.
    const size_t dense_bytes = row_size(w.down.type, n_ff) * (size_t)n_embd;
    const bool sparse_down = n == 1 ? (double)total * down_nm.row_bytes < kSparseDownBytes * dense_bytes
                                    : (double)total < kSparseDownBatch * (double)n * n_ff;
    if (sparse_down) {
        for (int32_t t = 0; t < n; t++)
            axpy_rows(pool, kt, down_nm, sp.idx + t * n_ff, sp.val + t * n_ff, sp.count[t], s.xn + t * n_embd,
                      /*accumulate=*/false);
    } else {
        // Dense over act(gate) * up with the inactive neurons zeroed: the same function, the dense kernel.
        std::memset(s.gate, 0, sizeof(float) * n * n_ff);
        for (int32_t t = 0; t < n; t++)
            for (int32_t i = 0; i < sp.count[t]; i++) s.gate[t * n_ff + sp.idx[t * n_ff + i]] = sp.val[t * n_ff + i];
        const Weight* down[1] = {&w.down};
        matmul_shared_input(pool, kt, down, &s.xn, 1, s.gate, n);
    }
    join_residual(pool, hp, w.down_b, w.post_norm, s.xn, n, x);
    return total;
}

}  // namespace optiml
