// The CPU's attention block (native/src/cpu/attention.cpp), called by the CPU backend.
#pragma once

#include "optiml/backend.h"
#include "optiml/model.h"

namespace optiml {

// x[t] += attention of layer il for the tokens of `b` (see Backend::attention). Keys and values of the
// batch are written to the cache first, so a token sees the batch's earlier tokens of its sequence.
void attention_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                   const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, float* x,
                   const StepScratch& scratch);

}  // namespace optiml
