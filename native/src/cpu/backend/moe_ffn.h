// The CPU's mixture-of-experts FFN (native/src/cpu/moe_ffn.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/backend.h"
#include "optiml/model.h"
#include "optiml/moe_route.h"
#include "optiml/recorder.h"

namespace optiml {

// Buffers of one backend's MoE FFN, grown to the largest step seen and reused.
struct MoEScratch {
    std::vector<float> logits;        // [n][n_expert]
    std::vector<int32_t> chosen;      // [n][k]: token t's experts, best first
    std::vector<float> weight;        // [n][k]: their weights
    std::vector<int32_t> slot;        // [n][k]: the row of (t, j) in the grouped order
    std::vector<int32_t> count, first;  // [n_expert]: rows of expert e are first[e] .. first[e] + count[e]
    std::vector<int32_t> token;       // [n * k]: the token of each grouped row
    std::vector<uint8_t> xq, xg;      // the input converted for the experts' gate/up, and gathered
    std::vector<uint8_t> xg2;         // the same for up when its activation type differs from gate's
    std::vector<uint8_t> hq;          // act(gate) * up converted for down
    std::vector<float> g, u, d;       // [n * k][n_ff_exp] gate and up, [n * k][n_embd] down
    std::vector<float> sg, su, sy, sgate;  // the shared expert's gate/up [n][n_ff_shexp], output, its gate
};

// y[t] = sum over the experts e that token t's router chooses of weight(t, e) * expert_e(xn[t]) (+ the
// shared expert): the step's tokens are grouped by expert and each expert's gate, up and down products run
// over all of its tokens at once (a batch kernel reads the expert's weights once for them), every
// expert's rows handed to the pool from one queue so 1 token and 512 tokens both use every thread.
// rec (optional, `optiml profile`): told the router's choice and the experts' act(gate) * up, as layer il.
void moe_ffn_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                 int32_t n, float* y, MoEScratch& s, ActivationRecorder* rec, int il);

// The pieces moe_ffn_cpu is made of, which a layer whose experts are split between two devices runs on
// each (Session::moe_split):
// logits[t] = w's router . xn[t] ([n][n_expert]).
void moe_router_cpu(ThreadPool& pool, const KernelTable& kt, const MoEWeights& w, const float* xn, int32_t n,
                    float* logits);
// d[r] ([g.n_rows][n_embd]) = expert(xn[g.token[r]]) for every row of g, through w's expert it is grouped
// under: gate and up of every expert in one pool dispatch, act(gate) * up, down in another.
void moe_experts_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                     const MoEGroups& g, float* d, MoEScratch& s, ActivationRecorder* rec, int il);
// sy[t] = the shared expert of xn[t], sgate[t] its sigmoid gate (1 without gate_inp_shexp).
void moe_shared_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const MoEWeights& w, const float* xn,
                    int32_t n, float* sy, float* sgate, MoEScratch& s);
// y[t] = sum over t's experts j, best first, of weight[t * k + j] * row slot[t * k + j] (rows below
// n_rows_d in d, the rest in d2 from its row 0), then + sgate[t] * sy[t] when sy: llama.cpp's order.
void moe_combine(ThreadPool& pool, const HParams& hp, int32_t n, const float* weight, const int32_t* slot,
                 const float* d, int64_t n_rows_d, const float* d2, const float* sy, const float* sgate, float* y);

}  // namespace optiml
