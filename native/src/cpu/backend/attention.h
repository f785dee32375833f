// The CPU's attention block (native/src/cpu/backend/attention.cpp), called by the CPU backend.
#pragma once

#include "optiml/backend.h"
#include "optiml/model.h"

namespace optiml {

// x[t] += attention of layer il for the tokens of `b` (see Backend::attention). Keys and values of the
// batch are written to the cache first, so a token sees the batch's earlier tokens of its sequence.
void attention_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                   const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, float* x,
                   const StepScratch& scratch);

// attention_cpu in its three parts (see Backend::attention_qkv): norm and q/k/v projections of x into
// scratch.q/k/v; RoPE, the new keys and values into the cache and attention into scratch.attn; the
// output projection of scratch.attn added into x.
void attention_cpu_qkv(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const LayerWeights& L,
                       const float* x, int32_t n, const StepScratch& scratch);
void attention_cpu_core(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                        const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, const StepScratch& scratch);
void attention_cpu_out(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const LayerWeights& L, int32_t n,
                       float* x, const StepScratch& scratch);

}  // namespace optiml
