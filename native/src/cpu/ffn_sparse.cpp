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

int64_t ffn_sparse(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                   const FFNSparsity& sp, const float* xn, int32_t n, const FFNScratch& s, const SparseScratch& ss,
                   float* y) {
    const FFNWeights& w = *share.w;
    const int64_t n_embd = hp.n_embd;
    const int64_t width = w.gate.rows;  // n_ff, or the neurons of a packed share
    const bool on_product = sp.on_product;
    const float threshold = sp.threshold;
    const float* neuron_scale = sp.neuron_scale;

    // 1. The criterion over the share's neurons: act(gate) (then up only for active rows), or
    // act(gate) * up (up for all the share's rows).
    if (share.rows) {
        std::memset(s.gate, 0, sizeof(float) * n * width);
        matmul_rows(pool, kt, w.gate.matrix(), share.rows, share.n_rows, xn, n, s.gate);
        if (on_product) matmul_rows(pool, kt, w.up.matrix(), share.rows, share.n_rows, xn, n, s.up);
    } else {
        const Weight* gate_up[2] = {&w.gate, &w.up};
        float* outs[2] = {s.gate, s.up};
        matmul_shared_input(pool, kt, gate_up, outs, on_product ? 2 : 1, xn, n);
    }
    add_bias_rows(w.gate_b, s.gate, n);
    if (on_product) {
        add_bias_rows(w.up_b, s.up, n);
        ffn_activate(pool, kt, hp, w, s.gate, s.up, n, width);
    } else {
        ffn_activate(pool, kt, hp, w, s.gate, ones((size_t)(n * width)), n, width);  // act(gate) alone
    }

    // 2. Each token's active neurons (ids into the share's rows of w).
    const int32_t* list = share.rows;
    const int64_t n_list = share.rows ? share.n_rows : width;
    auto select = [&](int64_t t) {
        const float* a = s.gate + t * width;
        int32_t* idx = ss.idx + t * width;
        float* val = ss.val + t * width;
        int32_t c = 0;
        for (int64_t i = 0; i < n_list; i++) {
            const int32_t j = list ? list[i] : (int32_t)i;
            const float m = neuron_scale && !on_product ? std::fabs(a[j]) * neuron_scale[j] : std::fabs(a[j]);
            if (m > threshold) {
                idx[c] = j;
                val[c] = a[j];
                c++;
            }
        }
        ss.count[t] = c;
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
    for (int32_t t = 0; t < n; t++) total += ss.count[t];

    // 3. Up rows of the union of active neurons, and the activations act(gate) * up.
    if (!on_product) {
        const int32_t* uni = ss.idx;
        int64_t n_uni = ss.count[0];
        if (n > 1) {
            std::memset(ss.seen, 0, width);
            for (int32_t t = 0; t < n; t++)
                for (int32_t i = 0; i < ss.count[t]; i++) ss.seen[ss.idx[t * width + i]] = 1;
            n_uni = 0;
            for (int32_t j = 0; j < width; j++)
                if (ss.seen[j]) ss.uni[n_uni++] = j;
            uni = ss.uni;
        }
        matmul_rows(pool, kt, w.up.matrix(), uni, n_uni, xn, n, s.up);
        const float* ub = w.up_b.present() ? (const float*)w.up_b.data : nullptr;
        const bool relu_up = hp.ffn_act == FFN_RELU2;
        for (int32_t t = 0; t < n; t++) {
            const int32_t* idx = ss.idx + t * width;
            float* val = ss.val + t * width;
            const float* u = s.up + t * width;
            for (int32_t i = 0; i < ss.count[t]; i++) {
                float uj = u[idx[i]] + (ub ? ub[idx[i]] : 0.0f);
                if (relu_up && uj < 0) uj = 0;
                val[i] *= uj;
            }
        }
    }

    // 4. The down projection into y.
    const NeuronMajor& nm = *share.down_nm;
    const bool has_dense = w.down.present();
    const size_t dense_bytes = has_dense ? row_size(w.down.type, w.down.cols) * (size_t)n_embd : 0;
    const bool sparse_down = !has_dense || (n == 1 ? (double)total * nm.row_bytes < kSparseDownBytes * dense_bytes
                                                   : (double)total < kSparseDownBatch * (double)n * n_list);
    if (sparse_down) {
        for (int32_t t = 0; t < n; t++) {
            int32_t* idx = ss.idx + t * width;
            if (share.nm_slot)  // neuron ids -> rows of the share's neuron-major matrix
                for (int32_t i = 0; i < ss.count[t]; i++) idx[i] = share.nm_slot[idx[i]];
            axpy_rows(pool, kt, nm, idx, ss.val + t * width, ss.count[t], y + t * n_embd, /*accumulate=*/false);
        }
    } else {
        // Dense over act(gate) * up with the inactive neurons zeroed: the same function, the dense kernel.
        std::memset(s.gate, 0, sizeof(float) * n * width);
        for (int32_t t = 0; t < n; t++)
            for (int32_t i = 0; i < ss.count[t]; i++) s.gate[t * width + ss.idx[t * width + i]] = ss.val[t * width + i];
        const Weight* down[1] = {&w.down};
        matmul_shared_input(pool, kt, down, &y, 1, s.gate, n);
    }
    return total;
}

}  // namespace optiml
