// The FFN computed for active neurons only. Without a predictor the gate is computed densely (it decides
// who is active) and the up rows and down columns of inactive neurons are never read; with one, the
// gate rows of neurons predicted inactive are skipped too.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ffn.h"
#include "optiml/predictor.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {

// The union of the batch's per-token neuron lists (ss.idx, ss.count), in ascending order; one token's
// list as it is. *n_uni: its length.
const int32_t* union_of_lists(const SparseScratch& ss, int32_t n, int64_t width, int64_t* n_uni) {
    if (n == 1) {
        *n_uni = ss.count[0];
        return ss.idx;
    }
    std::memset(ss.seen, 0, width);
    for (int32_t t = 0; t < n; t++)
        for (int32_t i = 0; i < ss.count[t]; i++) ss.seen[ss.idx[t * width + i]] = 1;
    int64_t c = 0;
    for (int64_t j = 0; j < width; j++)
        if (ss.seen[j]) ss.uni[c++] = (int32_t)j;
    *n_uni = c;
    return ss.uni;
}

// val *= up (plus its bias; clamped at 0 for dReLU) for each token's listed neurons: the activations
// act(gate) * up once the gate criterion has chosen them and their up rows are in (at their rows of up).
void times_up(const HParams& hp, const FFNWeights& w, int32_t n, int64_t width, const float* up,
              const SparseScratch& ss) {
    const float* ub = w.up_b.present() ? (const float*)w.up_b.data : nullptr;
    const bool relu_up = hp.ffn_act == FFN_RELU2;
    for (int32_t t = 0; t < n; t++) {
        const int32_t* idx = ss.idx + t * width;
        const float* u = up + t * width;
        float* val = ss.val + t * width;
        for (int32_t i = 0; i < ss.count[t]; i++) {
            float uj = u[idx[i]] + (ub ? ub[idx[i]] : 0.0f);
            if (relu_up && uj < 0) uj = 0.0f;
            val[i] *= uj;
        }
    }
}

// Below these shares the down projection runs as a sum of neuron columns; above them the dense kernel
// is faster. One token: compare bytes read, weighed by how fast each kernel streams them (7B shapes,
// AVX-512, 2 threads, tools/bench_sparse_kernels.py): the 8-bit rows at about the dense kernel's rate,
// so they win while they are under ~0.85 of the dense bytes (about 45% of the neurons); the grouped
// rows at about 60-65% of it, with their groups' scales on top, so under ~0.55 (about 60%).
// A batch: dense kernels reuse each weight block across tokens, so sparse must skip most of the work.
constexpr double kSparseDownBytes8 = 0.85;
constexpr double kSparseDownBytesGrouped = 0.55;
constexpr double kSparseDownBatch = 0.25;

// The down projection of the active neurons (ss: per token ids into the share's rows and activations)
// into y: a sum of neuron-major rows, or the dense kernel over zero-padded activations when too many
// are active. n_list: the share's neurons; total: the (token, neuron) pairs listed.
void down_projection(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share, int32_t n,
                     int64_t n_list, int64_t total, const FFNScratch& s, const SparseScratch& ss, float* y) {
    const FFNWeights& w = *share.w;
    const int64_t n_embd = hp.n_embd;
    const int64_t width = w.gate.rows;
    const NeuronMajor& nm = *share.down_nm;
    const bool has_dense = w.down.present();
    const size_t dense_bytes = has_dense ? row_size(w.down.type, w.down.cols) * (size_t)n_embd : 0;
    const double one_token_limit = (nm.grouped ? kSparseDownBytesGrouped : kSparseDownBytes8) * dense_bytes;
    const bool sparse_down = !has_dense || (n == 1 ? (double)total * nm.row_bytes < one_token_limit
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
        // A placed share's w.down is the file's: its inputs go to their file neurons, of all n_ff.
        const int32_t* stored = share.stored;
        const int64_t in_width = stored ? hp.n_ff : width;
        std::memset(s.gate, 0, sizeof(float) * n * in_width);
        for (int32_t t = 0; t < n; t++)
            for (int32_t i = 0; i < ss.count[t]; i++) {
                const int32_t j = ss.idx[t * width + i];
                s.gate[t * in_width + (stored ? stored[j] : j)] = ss.val[t * width + i];
            }
        const Weight* down[1] = {&w.down};
        matmul_shared_input(pool, kt, down, &y, 1, s.gate, n);
    }
}

// The neurons a predictor marks active for one token (scores sc, in the file's order): ids into the
// share's rows of w, ascending, into idx; returns how many. Only the share's own neurons (a split layer's
// host share lists them through nm_slot); by groups of sp.group consecutive rows when it is > 1.
int32_t predicted_neurons(const FFNShare& share, const FFNSparsity& sp, const float* sc, int64_t width,
                          int32_t* idx) {
    const LayerPredictor& P = *sp.predictor;
    const float* bias = (const float*)P.bias.data;
    const float pthr = P.threshold;
    const int32_t* in_share = share.rows ? share.nm_slot : nullptr;
    const int32_t* stored = share.stored;  // w's rows in a placed order
    const int32_t group = sp.group;
    int32_t c = 0;
    // By groups: only the share's own neurons count towards a group's decision.
    if (group > 1)
        for (int32_t g0 = 0; g0 < width; g0 += group) {
            const int32_t g1 = std::min<int32_t>((int32_t)width, g0 + group);
            bool any = false;
            for (int32_t j = g0; j < g1 && !any; j++) {
                const int32_t f = stored ? stored[j] : j;
                any = sc[f] + bias[f] > pthr && (!in_share || in_share[j] >= 0);
            }
            if (any)
                for (int32_t j = g0; j < g1; j++)
                    if (!in_share || in_share[j] >= 0) idx[c++] = j;
        }
    // Neuron by neuron, branch-free: about which neurons fire the branch predictor can only guess (the
    // store is overwritten while the condition is false).
    else if (stored)
        for (int32_t j = 0; j < width; j++) {
            idx[c] = j;
            c += sc[stored[j]] + bias[stored[j]] > pthr;
        }
    else if (!in_share)
        for (int32_t j = 0; j < width; j++) {
            idx[c] = j;
            c += sc[j] + bias[j] > pthr;
        }
    else
        for (int32_t j = 0; j < width; j++)
            if (sc[j] + bias[j] > pthr && in_share[j] >= 0) idx[c++] = j;
    return c;
}

// The FFN over the neurons a predictor marks active. 1. z = A x and the scores B z + bias per token
// (in ss.val); 2. the predicted neurons of each token and their union; 3. gate (and, with the product
// criterion, up) for the union's rows only; 4. per token, its predicted neurons' activations (gathered
// in place to the front of its gate/up rows: the list is ascending, so entry i is read from position
// >= i), filtered by the criterion; 5. with the gate criterion, up for the neurons it kept. The caller
// then runs the down projection.
int64_t ffn_predicted(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                      const FFNSparsity& sp, const float* xn, int32_t n, const FFNScratch& s,
                      const SparseScratch& ss) {
    const FFNWeights& w = *share.w;
    const LayerPredictor& P = *sp.predictor;
    const int64_t width = w.gate.rows;
    const int64_t n_scores = share.stored ? hp.n_ff : width;  // a placed share's scores: every file neuron
    if (P.b.rows != n_scores || P.a.cols != hp.n_embd)
        throw ArgumentError("the predictor does not fit this FFN share (its neurons are not the layer's)");

    // 1. Scores.
    const Weight* pa[1] = {&P.a};
    float* z = ss.z;
    matmul_shared_input(pool, kt, pa, &z, 1, xn, n);
    const Weight* pb[1] = {&P.b};
    float* scores = ss.val;
    matmul_shared_input(pool, kt, pb, &scores, 1, ss.z, n);

    // 2. Predicted neurons per token and their union.
    auto predict = [&](int64_t t) {
        ss.count[t] = predicted_neurons(share, sp, scores + t * n_scores, width, ss.idx + t * width);
    };
    per_token(pool, n, predict);
    int64_t n_uni = 0;
    const int32_t* uni = union_of_lists(ss, n, width, &n_uni);

    // 3. Gate and up rows of the union. With the gate criterion the up rows wait for it (step 5): only
    // the neurons it keeps need theirs (ReLU: about half of those predicted). Each row's value is the
    // same whichever rows are computed beside it (matmul_rows), so the result is too.
    const bool up_after_gate = !sp.on_product;
    if (n_uni > 0) {
        if (up_after_gate)
            matmul_rows(pool, kt, w.gate.matrix(), uni, n_uni, xn, n, s.gate);
        else
            matmul_rows_gate_up(pool, kt, w.gate.matrix(), s.gate, w.up.matrix(), s.up, uni, n_uni, xn, n);
    }

    // 4. Activations and the criterion, token by token.
    const float* gb = w.gate_b.present() ? (const float*)w.gate_b.data : nullptr;
    const float* ub = w.up_b.present() ? (const float*)w.up_b.data : nullptr;
    const float threshold = sp.threshold;
    const float* neuron_scale = sp.neuron_scale;  // in the file's order
    const int32_t* stored = share.stored;
    // Each token keeps its own predicted neurons (computed for the whole batch as the union): the
    // function does not depend on which tokens share a batch.
    auto activate = [&](int64_t t) {
        float* g = s.gate + t * width;
        float* u = s.up + t * width;
        int32_t* idx = ss.idx + t * width;  // the token's predicted neurons, ascending
        const int64_t n_own = ss.count[t];
        for (int64_t i = 0; i < n_own; i++) {
            const int32_t j = idx[i];
            g[i] = g[j] + (gb ? gb[j] : 0.0f);
            if (!up_after_gate) u[i] = u[j] + (ub ? ub[j] : 0.0f);
        }
        float* val = ss.val + t * width;
        int32_t c = 0;  // idx[c] is rewritten only after idx[i >= c] was read
        if (sp.on_product) {
            ffn_activate(pool, kt, hp, w, g, u, 1, n_own);
            for (int64_t i = 0; i < n_own; i++)
                if (std::fabs(g[i]) > threshold) {
                    idx[c] = idx[i];
                    val[c] = g[i];
                    c++;
                }
        } else {
            ffn_activate(pool, kt, hp, w, g, ones((size_t)n_own), 1, n_own);  // act(gate) alone
            for (int64_t i = 0; i < n_own; i++) {
                const int32_t j = idx[i];
                const float m = neuron_scale ? std::fabs(g[i]) * neuron_scale[stored ? stored[j] : j] : std::fabs(g[i]);
                if (m > threshold) {
                    idx[c] = j;
                    val[c] = g[i];
                    c++;
                }
            }
        }
        ss.count[t] = c;
    };
    per_token(pool, n, activate);

    // 5. Gate criterion: the up rows of the neurons it kept, and act(gate) * up.
    if (up_after_gate) {
        int64_t n_kept = 0;
        const int32_t* kept = union_of_lists(ss, n, width, &n_kept);
        if (n_kept > 0) matmul_rows(pool, kt, w.up.matrix(), kept, n_kept, xn, n, s.up);
        times_up(hp, w, n, width, s.up, ss);
    }
    return n_uni;
}

}  // namespace

int64_t ffn_sparse(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                   const FFNSparsity& sp, const float* xn, int32_t n, const FFNScratch& s, const SparseScratch& ss,
                   float* y) {
    if (share.stored && !sp.predictor)
        throw Error("internal: an FFN share in a placed order runs with a predictor only");
    const FFNWeights& w = *share.w;
    const int64_t width = w.gate.rows;  // n_ff, or the neurons of a packed share
    const bool on_product = sp.on_product;
    const float threshold = sp.threshold;
    const float* neuron_scale = sp.neuron_scale;
    if (sp.predictor) {
        const int64_t n_uni = ffn_predicted(pool, kt, hp, share, sp, xn, n, s, ss);
        int64_t listed = 0;
        for (int32_t t = 0; t < n; t++) listed += ss.count[t];
        down_projection(pool, kt, hp, share, n, share.rows ? share.n_rows : width, listed, s, ss, y);
        return n_uni * n;  // gate and up rows computed for every token
    }

    // 1. The criterion over the share's neurons: act(gate) (then up only for active rows), or
    // act(gate) * up (up for all the share's rows).
    if (share.rows) {
        std::memset(s.gate, 0, sizeof(float) * n * width);
        if (on_product)
            matmul_rows_gate_up(pool, kt, w.gate.matrix(), s.gate, w.up.matrix(), s.up, share.rows, share.n_rows, xn, n);
        else
            matmul_rows(pool, kt, w.gate.matrix(), share.rows, share.n_rows, xn, n, s.gate);
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
    per_token(pool, n, select);
    int64_t total = 0;
    for (int32_t t = 0; t < n; t++) total += ss.count[t];

    // 3. Up rows of the union of active neurons, and the activations act(gate) * up.
    if (!on_product) {
        int64_t n_uni = 0;
        const int32_t* uni = union_of_lists(ss, n, width, &n_uni);
        matmul_rows(pool, kt, w.up.matrix(), uni, n_uni, xn, n, s.up);
        times_up(hp, w, n, width, s.up, ss);
    }

    down_projection(pool, kt, hp, share, n, n_list, total, s, ss, y);
    return total;
}

}  // namespace optiml
