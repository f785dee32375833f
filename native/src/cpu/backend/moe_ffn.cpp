// The mixture-of-experts FFN on the CPU, as llama.cpp's build_moe_ffn + mul_mat_id compute it:
//   1. router logits = gate_inp . xn, and each token's experts and weights (moe_route);
//   2. the step's (token, expert) pairs grouped by expert: expert e's tokens become consecutive rows;
//   3. gate and up of every chosen expert over its rows, in one pool dispatch (grouped_products);
//   4. act(gate) * up, converted once for down; down of every chosen expert, one dispatch (gpt-oss: each
//      product plus its expert's bias, and the clamped SwiGLU);
//   5. y[t] = sum over t's experts, best first, of weight * down row (llama.cpp's order of the sum);
//   6. the shared expert, when there is one, scaled by sigmoid(gate_inp_shexp . xn) and added.
// An expert is an ordinary 2-D matrix inside its 3-D tensor, so the products use the dense path's
// kernels (vec_dot_rows for one token, gemm for several) for every weight type, and the same bits.
#include "moe_ffn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "ffn.h"
#include "optiml/common.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

constexpr int64_t kTokenBlock = 64;  // tokens per gemm call: their activations stay in L2 across a chunk

// One product of a grouped step: y[t * w.rows + r] = dot(w row r, x row t) for t < n_tok.
struct Product {
    WeightMatrix w;
    const uint8_t* x;  // n_tok rows in w's vec_dot_type, x_row bytes apart
    size_t x_row;
    int64_t n_tok;
    float* y;
    const uint8_t* xa = nullptr;  // or laid out for gemm_pre (gemm_x_for), when not null
};

void product_rows(const KernelTable& kt, const Product& p, int64_t r0, int64_t r1) {
    const WeightMatrix& W = p.w;
    const size_t w_row = row_size(W.type, W.cols);
    const uint8_t* wbase = (const uint8_t*)W.data;
    const vec_dot_rows_fn dot_rows = kt.vec_dot_rows[W.type];
    const gemm_fn gemm = kt.gemm[W.type];
    if (p.n_tok == 1 && dot_rows) {  // one token: each activation block shared across rows
        float s[64];
        const void* rows[64 + kRowsAhead];
        for (int64_t rb = r0; rb < r1; rb += 64) {
            const int64_t nr = std::min<int64_t>(64, r1 - rb);
            for (int64_t k = 0; k < nr + kRowsAhead; k++) rows[k] = wbase + std::min(rb + k, W.rows - 1) * w_row;
            dot_rows(W.cols, s, rows, p.x, nr);
            std::memcpy(p.y + rb, s, sizeof(float) * nr);
        }
        return;
    }
    if (p.n_tok > 1 && p.xa) {  // a batch over activations laid out once for the step: straight into y
        const void* rows[64];
        for (int64_t rb = r0; rb < r1; rb += 64) {
            const int64_t nr = std::min<int64_t>(64, r1 - rb);
            for (int64_t k = 0; k < nr; k++) rows[k] = wbase + (rb + k) * w_row;
            kt.gemm_pre[W.type](W.cols, p.y + rb, W.rows, rows, nr, p.xa, p.n_tok);
        }
        return;
    }
    if (p.n_tok > 1 && gemm) {  // a batch: each chunk of rows through every block of tokens
        const void* rows[64];
        float s[64 * kTokenBlock];
        for (int64_t rb = r0; rb < r1; rb += 64) {
            const int64_t nr = std::min<int64_t>(64, r1 - rb);
            for (int64_t k = 0; k < nr; k++) rows[k] = wbase + (rb + k) * w_row;
            for (int64_t t0 = 0; t0 < p.n_tok; t0 += kTokenBlock) {
                const int64_t nt = std::min(kTokenBlock, p.n_tok - t0);
                gemm(W.cols, s, rows, nr, p.x + t0 * p.x_row, p.x_row, nt);
                for (int64_t t = 0; t < nt; t++) std::memcpy(p.y + (t0 + t) * W.rows + rb, s + t * nr, sizeof(float) * nr);
            }
        }
        return;
    }
    const vec_dot_fn dot = kt.vec_dot[W.type];
    const vec_dot4_fn dot4 = kt.vec_dot4[W.type];
    int64_t t = 0;
    if (dot4)
        for (; t + 4 <= p.n_tok; t += 4)
            for (int64_t r = r0; r < r1; r++) {
                float s[4];
                dot4(W.cols, s, wbase + r * w_row, p.x + t * p.x_row, p.x_row);
                for (int k = 0; k < 4; k++) p.y[(t + k) * W.rows + r] = s[k];
            }
    for (; t < p.n_tok; t++)
        for (int64_t r = r0; r < r1; r++) dot(W.cols, &p.y[t * W.rows + r], wbase + r * w_row, p.x + t * p.x_row);
}

// Every product's rows in chunks from one shared counter: the chosen experts of a decode step (a few
// hundred rows each) and of a long prompt (each with many tokens) both spread over all threads in one
// dispatch, and a thread the OS slows down does not hold the others.
void grouped_products(ThreadPool& pool, const KernelTable& kt, const std::vector<Product>& ps) {
    if (ps.empty()) return;
    int64_t total = 0, max_tok = 0;
    for (const Product& p : ps) total += p.w.rows, max_tok = std::max(max_tok, p.n_tok);
    // As the dense products (matmul.cpp): about 8 chunks a thread, at most 64 rows with several tokens
    // (a batch's tile). One token's chunk is as long as that allows: each chunk's first rows wait on the
    // memory, as no row before them fetched them (Qwen3-30B-A3B-shaped decode, 2 threads: 64-row
    // chunks 0.80 ms an FFN, whole experts 0.58 ms).
    int64_t chunk = std::max<int64_t>(total / (pool.size() * 8), 16);
    if (max_tok > 1) chunk = std::min<int64_t>(chunk, 64);
    chunk = (chunk + 7) / 8 * 8;
    std::vector<int64_t> start(ps.size() + 1, 0);  // first chunk of each product
    for (size_t i = 0; i < ps.size(); i++) start[i + 1] = start[i] + (ps[i].w.rows + chunk - 1) / chunk;
    const int64_t n_chunks = start.back();
    std::atomic<int64_t> next{0};
    pool.run([&](int, int) {
        size_t i = 0;
        for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            if (c < start[i]) i = 0;
            while (c >= start[i + 1]) i++;
            const int64_t r0 = (c - start[i]) * chunk;
            product_rows(kt, ps[i], r0, std::min(r0 + chunk, ps[i].w.rows));
        }
    });
}

// xn's n rows in the vec_dot_type of `wtype`, x_row bytes each (F32: the floats themselves).
const uint8_t* convert_for(ThreadPool& pool, const KernelTable& kt, int32_t wtype, const float* x, int64_t cols,
                           int64_t n, std::vector<uint8_t>& buf, size_t* x_row) {
    const int32_t xtype = type_traits(wtype).vec_dot_type;
    *x_row = row_size(xtype, cols);
    if (xtype == TYPE_F32) return (const uint8_t*)x;
    if (buf.size() < *x_row * n) buf.resize(*x_row * n);
    convert_activations(pool, kt.from_float[xtype], x, cols, n, buf.data(), *x_row);
    return buf.data();
}

// y's grouped rows ([g.n_rows][cols]) each plus its expert's row of bias ([n_expert][cols]), if any.
void add_expert_bias(ThreadPool& pool, const Weight& bias, const MoEGroups& g, float* y, int64_t cols) {
    if (!bias.present()) return;
    std::vector<int32_t> expert(g.n_rows);
    for (int32_t e = 0; e < g.n_expert; e++)
        if (g.count[e]) std::fill(expert.begin() + g.first[e], expert.begin() + g.first[e] + g.count[e], e);
    per_token(pool, (int32_t)g.n_rows, [&](int64_t r) {
        const float* b = (const float*)bias.data + (size_t)expert[r] * cols;
        float* yr = y + r * cols;
        for (int64_t i = 0; i < cols; i++) yr[i] += b[i];
    });
}

// gpt-oss's activation, in place of gate, as ggml's swiglu_oai computes it (alpha 1.702, limit 7).
void swiglu_oai(int64_t n, float* gate, const float* up) {
    constexpr float alpha = 1.702f, limit = 7.0f;
    for (int64_t i = 0; i < n; i++) {
        const float x = std::min(gate[i], limit), y = std::clamp(up[i], -limit, limit);
        gate[i] = x / (1.0f + std::exp(alpha * -x)) * (y + 1.0f);
    }
}

}  // namespace

void moe_router_cpu(ThreadPool& pool, const KernelTable& kt, const MoEWeights& w, const float* xn, int32_t n,
                    float* logits) {
    const Weight* router[1] = {&w.gate_inp};
    float* out[1] = {logits};
    matmul_shared_input(pool, kt, router, out, 1, xn, n);
    add_bias_rows(w.gate_inp_b, logits, n);
}

void moe_experts_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                     const MoEGroups& g, float* d, MoEScratch& s, ActivationRecorder* rec, int il) {
    const int64_t E = hp.n_embd, F = w.gate.rows;
    const int64_t nr = g.n_rows;
    if (nr == 0) return;

    // gate and up of each chosen expert over its rows: the input converted once, then gathered.
    auto gathered = [&](int32_t wtype, std::vector<uint8_t>& gbuf, size_t* x_row) {
        const uint8_t* xq = convert_for(pool, kt, wtype, xn, E, g.n_tok, s.xq, x_row);
        if (gbuf.size() < *x_row * nr) gbuf.resize(*x_row * nr);
        for (int64_t r = 0; r < nr; r++) std::memcpy(gbuf.data() + r * *x_row, xq + g.token[r] * *x_row, *x_row);
        return (const uint8_t*)gbuf.data();
    };
    size_t xg_row = 0, xu_row = 0;
    const uint8_t* xg = gathered(w.gate.type, s.xg, &xg_row);
    const bool same_x = type_traits(w.gate.type).vec_dot_type == type_traits(w.up.type).vec_dot_type;
    const uint8_t* xu = same_x ? xg : gathered(w.up.type, s.xg2, &xu_row);
    if (same_x) xu_row = xg_row;
    s.g.resize(nr * F);
    s.u.resize(nr * F);
    // A prompt's rows laid out once for the batched kernels that read them so (x86 k-quants).
    const bool pre = g.n_tok > 1 && same_x && kt.gemm_x && kt.gemm_pre[w.gate.type] && kt.gemm_pre[w.up.type];
    const uint8_t* xa = pre ? gemm_x_for(pool, kt, xg, xg_row, E, nr) : nullptr;
    const size_t xa_row = gemm_x_row(E);
    std::vector<Product> ps;
    for (int32_t e = 0; e < g.n_expert; e++) {
        if (!g.count[e]) continue;
        const int64_t r0 = g.first[e];
        const uint8_t* xae = xa ? xa + r0 * xa_row : nullptr;
        ps.push_back({w.gate.matrix(e), xg + r0 * xg_row, xg_row, g.count[e], s.g.data() + r0 * F, xae});
        ps.push_back({w.up.matrix(e), xu + r0 * xu_row, xu_row, g.count[e], s.u.data() + r0 * F, xae});
    }
    grouped_products(pool, kt, ps);
    add_expert_bias(pool, w.gate_b, g, s.g.data(), F);
    add_expert_bias(pool, w.up_b, g, s.u.data(), F);

    // act(gate) * up, then down of each chosen expert over its rows.
    const bool oai = hp.ffn_act == FFN_SWIGLU_OAI;
    per_token(pool, (int32_t)nr, [&](int64_t r) {
        if (oai) swiglu_oai(F, s.g.data() + r * F, s.u.data() + r * F);
        else kt.silu_mul(F, s.g.data() + r * F, s.u.data() + r * F);
    });
    if (rec)
        for (int32_t e = 0; e < g.n_expert; e++)
            if (g.count[e]) rec->record_expert_neurons(il, e, s.g.data() + (int64_t)g.first[e] * F, g.count[e]);
    size_t h_row = 0;
    const uint8_t* hq = convert_for(pool, kt, w.down.type, s.g.data(), F, nr, s.hq, &h_row);
    const bool pre_h = g.n_tok > 1 && kt.gemm_x && kt.gemm_pre[w.down.type];
    const uint8_t* ha = pre_h ? gemm_x_for(pool, kt, hq, h_row, F, nr) : nullptr;
    const size_t ha_row = gemm_x_row(F);
    ps.clear();
    for (int32_t e = 0; e < g.n_expert; e++) {
        if (!g.count[e]) continue;
        const int64_t r0 = g.first[e];
        ps.push_back({w.down.matrix(e), hq + r0 * h_row, h_row, g.count[e], d + r0 * E, ha ? ha + r0 * ha_row : nullptr});
    }
    grouped_products(pool, kt, ps);
    add_expert_bias(pool, w.down_b, g, d, E);
}

void moe_shared_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                    int32_t n, float* sy, float* sgate, MoEScratch& s) {
    const int64_t S = w.shared.gate.rows;
    s.sg.resize(n * S);
    s.su.resize(n * S);
    FFNShare share;
    share.w = &w.shared;
    ffn_dense(pool, kt, hp, share, xn, n, FFNScratch{s.sg.data(), s.su.data()}, sy);
    if (!w.gate_inp_shexp.present()) {
        std::fill(sgate, sgate + n, 1.0f);
        return;
    }
    const Weight* gate[1] = {&w.gate_inp_shexp};
    float* out[1] = {sgate};
    matmul_shared_input(pool, kt, gate, out, 1, xn, n);
    for (int32_t t = 0; t < n; t++) sgate[t] = 1.0f / (1.0f + std::exp(-sgate[t]));
}

void moe_combine(ThreadPool& pool, const HParams& hp, int32_t n, const float* weight, const int32_t* slot,
                 const float* d, int64_t n_rows_d, const float* d2, const float* sy, const float* sgate, float* y) {
    const int32_t k = hp.n_expert_used;
    const int64_t E = hp.n_embd;
    per_token(pool, n, [&](int64_t t) {
        float* yt = y + t * E;
        for (int32_t j = 0; j < k; j++) {
            const float wj = weight[t * k + j];
            const int64_t r = slot[t * k + j];
            const float* dr = r < n_rows_d ? d + r * E : d2 + (r - n_rows_d) * E;
            if (j == 0)
                for (int64_t i = 0; i < E; i++) yt[i] = dr[i] * wj;
            else
                for (int64_t i = 0; i < E; i++) yt[i] += dr[i] * wj;
        }
        if (!sy) return;
        const float g = sgate[t];
        const float* st = sy + t * E;
        for (int64_t i = 0; i < E; i++) yt[i] += st[i] * g;
    });
}

void moe_ffn_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                 int32_t n, float* y, MoEScratch& s, ActivationRecorder* rec, int il) {
    const int32_t X = hp.n_expert, k = hp.n_expert_used;
    const int64_t nk = (int64_t)n * k;

    // 1. The router.
    s.logits.resize((size_t)n * X);
    s.chosen.resize(nk);
    s.weight.resize(nk);
    moe_router_cpu(pool, kt, w, xn, n, s.logits.data());
    moe_route(hp, s.logits.data(), n, s.chosen.data(), s.weight.data());
    if (rec) rec->record_experts(il, s.chosen.data(), s.weight.data(), n, k);

    // 2. Grouped by expert; 3-4. every chosen expert over its rows.
    s.slot.resize(nk);
    moe_group(s.chosen.data(), nk, k, X, nullptr, s.count, s.first, s.token, s.slot.data());
    s.d.resize(nk * hp.n_embd);
    const MoEGroups g{n, s.token.data(), nk, s.first.data(), s.count.data(), X};
    moe_experts_cpu(pool, kt, hp, w, xn, g, s.d.data(), s, rec, il);

    // 5-6. Each token's experts weighted and summed, best first, and the shared expert.
    const bool shared = w.shared.gate.present();
    if (shared) {
        s.sy.resize((size_t)n * hp.n_embd);
        s.sgate.resize(n);
        moe_shared_cpu(pool, kt, hp, w, xn, n, s.sy.data(), s.sgate.data(), s);
    }
    moe_combine(pool, hp, n, s.weight.data(), s.slot.data(), s.d.data(), nk, nullptr, shared ? s.sy.data() : nullptr,
                shared ? s.sgate.data() : nullptr, y);
}

}  // namespace optiml
