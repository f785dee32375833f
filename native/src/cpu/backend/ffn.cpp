#include "ffn.h"

#include <cstring>
#include <vector>

#include "cpu/kernels/ops.h"

namespace optiml {

void matmul_shared_input(ThreadPool& pool, const KernelTable& kt, const Weight* const* w, float* const* y, int n_mats,
                         const float* x, int32_t n, bool accumulate) {
    WeightMatrix mats[4];
    float* outs[4];
    bool done[4] = {false, false, false, false};
    for (int i = 0; i < n_mats; i++) {
        if (done[i]) continue;
        // Group every not yet done matrix whose activations convert the same way as matrix i.
        int k = 0;
        const int32_t xtype = type_traits(w[i]->type).vec_dot_type;
        for (int j = i; j < n_mats; j++) {
            if (done[j] || type_traits(w[j]->type).vec_dot_type != xtype) continue;
            mats[k] = w[j]->matrix();
            outs[k] = y[j];
            done[j] = true;
            k++;
        }
        matmul_many(pool, kt, mats, outs, k, x, n, accumulate);
    }
}

void add_bias_rows(const Weight& bias, float* rows, int32_t n) {
    if (!bias.present()) return;
    const float* b = (const float*)bias.data;
    for (int32_t t = 0; t < n; t++)
        for (int64_t i = 0; i < bias.cols; i++) rows[t * bias.cols + i] += b[i];
}

void add_to_residual(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const Weight& w, const Weight& bias,
                     const Weight& post_norm, const float* in, int32_t n, float* x, float* scratch) {
    const Weight* mat[1] = {&w};
    if (!post_norm.present()) {
        matmul_shared_input(pool, kt, mat, &x, 1, in, n, /*accumulate=*/true);
        add_bias_rows(bias, x, n);
        return;
    }
    matmul_shared_input(pool, kt, mat, &scratch, 1, in, n);
    add_bias_rows(bias, scratch, n);
    rms_norm_rows(pool, scratch, post_norm, scratch, n, hp.n_embd, hp.rms_eps);
    for (int64_t i = 0; i < (int64_t)n * hp.n_embd; i++) x[i] += scratch[i];
}

void rms_norm_rows(ThreadPool& pool, const float* x, const Weight& w, float* out, int32_t n, int64_t dim, float eps) {
    const float* scale = (const float*)w.data;
    if (n * dim <= 16384) {  // a decode step (of a few sequences): less than waking the pool
        for (int32_t t = 0; t < n; t++) rms_norm(x + t * dim, scale, out + t * dim, dim, eps);
        return;
    }
    pool.run([&](int ith, int nth) {
        int64_t t0, t1;
        split_range(n, ith, nth, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) rms_norm(x + t * dim, scale, out + t * dim, dim, eps);
    });
}

void join_residual(ThreadPool& pool, const HParams& hp, const Weight& bias, const Weight& post_norm, float* y,
                   int32_t n, float* x) {
    add_bias_rows(bias, y, n);
    if (post_norm.present()) rms_norm_rows(pool, y, post_norm, y, n, hp.n_embd, hp.rms_eps);
    for (int64_t i = 0; i < (int64_t)n * hp.n_embd; i++) x[i] += y[i];
}

const float* ones(size_t n) {
    static thread_local std::vector<float> v;
    if (v.size() < n) v.assign(n, 1.0f);
    return v.data();
}

void ffn_activate(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNWeights& w, float* g,
                  const float* u, int32_t n, int64_t n_ff) {
    // GELU: llama.cpp's f16 table where the gate's input is quantized to 8 bits anyway (its rounding is
    // far below that, and matching llama.cpp's bits keeps its greedy text); exact in float otherwise.
    const int32_t gate_x = type_traits(w.gate.type).vec_dot_type;
    const bool float_gate = gate_x == TYPE_F32 || gate_x == TYPE_F16 || gate_x == TYPE_BF16;
    const act_mul_fn act = hp.ffn_act == FFN_GELU ? (float_gate ? kt.gelu_exact_mul : kt.gelu_mul)
                           : is_relu_family(hp.ffn_act) ? kt.relu_mul
                                                        : kt.silu_mul;
    auto row = [&](int64_t t) {
        float* gt = g + t * n_ff;
        const float* ut = u + t * n_ff;
        if (hp.ffn_act == FFN_RELU2) {
            for (int64_t i = 0; i < n_ff; i++) gt[i] = gt[i] > 0 && ut[i] > 0 ? gt[i] * ut[i] : 0.0f;
        } else {
            act(n_ff, gt, ut);
        }
    };
    per_token(pool, n, row);
}

// The share's neurons as a list: its rows, or 0..R-1 of a whole share (a thread-local buffer).
static const int32_t* share_neurons(const FFNShare& sh, int64_t* count) {
    if (sh.rows) {
        *count = sh.n_rows;
        return sh.rows;
    }
    static thread_local std::vector<int32_t> all;
    const int64_t r = sh.w->gate.rows;
    if ((int64_t)all.size() < r) {
        all.resize(r);
        for (int64_t i = 0; i < r; i++) all[i] = (int32_t)i;
    }
    *count = r;
    return all.data();
}

void ffn_down_neuron_major(ThreadPool& pool, const KernelTable& kt, const FFNShare& sh, const float* h,
                           int64_t width, int32_t n, int64_t n_embd, float* y) {
    int64_t count;
    const int32_t* neurons = share_neurons(sh, &count);
    static thread_local std::vector<int32_t> slots;
    static thread_local std::vector<float> vals;
    slots.resize(count);
    vals.resize(count);
    for (int64_t i = 0; i < count; i++) slots[i] = sh.nm_slot ? sh.nm_slot[neurons[i]] : neurons[i];
    for (int32_t t = 0; t < n; t++) {
        for (int64_t i = 0; i < count; i++) vals[i] = h[t * width + neurons[i]];
        axpy_rows(pool, kt, *sh.down_nm, slots.data(), vals.data(), count, y + t * n_embd, /*accumulate=*/false);
    }
}

void ffn_gate_up(ThreadPool& pool, const KernelTable& kt, const FFNShare& share, const float* xn, int32_t n,
                 float* gate, float* up) {
    const FFNWeights& w = *share.w;
    const int64_t width = w.gate.rows;  // n_ff, or the neurons of a packed share
    if (!share.rows) {
        const Weight* gate_up[2] = {&w.gate, &w.up};
        float* outs[2] = {gate, up};
        matmul_shared_input(pool, kt, gate_up, outs, 2, xn, n);
        add_bias_rows(w.gate_b, gate, n);
        add_bias_rows(w.up_b, up, n);
        return;
    }
    // The host's part of a split layer: its rows only, the other neurons' activations zero
    // (act(0) * 0 = 0 for every activation), so the full-width down adds nothing for them.
    std::memset(gate, 0, sizeof(float) * n * width);
    std::memset(up, 0, sizeof(float) * n * width);
    matmul_rows_gate_up(pool, kt, w.gate.matrix(), gate, w.up.matrix(), up, share.rows, share.n_rows, xn, n);
    for (const auto& [bias, out] : {std::pair{&w.gate_b, gate}, std::pair{&w.up_b, up}}) {
        if (!bias->present()) continue;
        const float* b = (const float*)bias->data;
        for (int32_t t = 0; t < n; t++)
            for (int64_t i = 0; i < share.n_rows; i++) out[t * width + share.rows[i]] += b[share.rows[i]];
    }
}

void ffn_finish_split(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share,
                      const float* gate2, const float* up2, const int32_t* rows2, int64_t k2, int32_t n,
                      const FFNScratch& s, float* y) {
    const FFNWeights& w = *share.w;
    const int64_t width = w.gate.rows;
    for (int32_t t = 0; t < n; t++) {
        float* g = s.gate + t * width;
        float* u = s.up + t * width;
        for (int64_t i = 0; i < k2; i++) {
            g[rows2[i]] = gate2[t * k2 + i];
            u[rows2[i]] = up2[t * k2 + i];
        }
    }
    ffn_activate(pool, kt, hp, w, s.gate, s.up, n, width);
    const Weight* down[1] = {&w.down};
    matmul_shared_input(pool, kt, down, &y, 1, s.gate, n);
}

void ffn_dense(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const FFNShare& share, const float* xn,
               int32_t n, const FFNScratch& s, float* y, const FFNObserver* observe, float* act_buf) {
    const FFNWeights& w = *share.w;
    const int64_t width = w.gate.rows;  // n_ff, or the neurons of a packed share
    ffn_gate_up(pool, kt, share, xn, n, s.gate, s.up);

    if (observe) {  // act(gate) on its own: the activation times a row of ones
        std::memcpy(act_buf, s.gate, sizeof(float) * n * width);
        ffn_activate(pool, kt, hp, w, act_buf, ones((size_t)n * width), n, width);
    }
    ffn_activate(pool, kt, hp, w, s.gate, s.up, n, width);
    if (observe) (*observe)(xn, act_buf, s.up, s.gate);

    if (w.down.present()) {
        const Weight* down[1] = {&w.down};
        matmul_shared_input(pool, kt, down, &y, 1, s.gate, n);
    } else {
        ffn_down_neuron_major(pool, kt, share, s.gate, width, n, hp.n_embd, y);
    }
}

}  // namespace optiml
