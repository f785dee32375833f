// Mixture-of-experts models as llama.cpp lays them out in GGUF (native/src/model/moe.cpp): the
// `{arch}.expert_*` metadata and each layer's router, 3-D expert tensors and shared expert. Private to
// native/src/model (load.cpp calls these).
#pragma once

#include "optiml/gguf.h"
#include "optiml/model.h"

namespace optiml {

// True for the architectures whose every layer is a mixture of experts (qwen3moe, qwen2moe); llama is
// one (Mixtral) when its file says `llama.expert_count` > 0.
bool is_moe_arch(const std::string& arch);

// hp.n_expert and the rest of the MoE hyper-parameters from `{arch}.expert_*` (nothing for a dense
// file), after hp.n_ff (0 when the file has no feed_forward_length: then the experts' width). GGUFError
// for metadata that cannot describe a mixture (0 experts, more used than there are, a missing width),
// UnsupportedModelError for routing this build does not implement.
void read_moe_hparams(const GGUFFile& f, HParams& hp);

// Binds layer il's router, expert tensors and shared expert into L.moe, every shape checked against hp.
void bind_moe_layer(const GGUFFile& f, const HParams& hp, int il, LayerWeights& L);

}  // namespace optiml
