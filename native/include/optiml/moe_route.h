// A mixture of experts' routing and grouping, on the host: every backend's experts meet their tokens
// in the order these give (native/src/model/moe_route.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/model.h"

namespace optiml {

// chosen[t * k + j] and weight[t * k + j] for each of n tokens, from the router logits ([n][n_expert])
// as hp says (softmax, top k, renormalized when expert_weights_norm, scaled).
void moe_route(const HParams& hp, const float* logits, int32_t n, int32_t* chosen, float* weight);

// The nk = n * k choices (chosen[i]: token i / k's expert) grouped by expert, a counting sort: expert e's
// rows are first[e] .. first[e] + count[e] - 1, its tokens in order; the experts' rows follow one another
// in `order` (a permutation of the experts; nullptr: by id). slot[i]: the row of choice i.
void moe_group(const int32_t* chosen, int64_t nk, int32_t k, int32_t n_expert, const int32_t* order,
               std::vector<int32_t>& count, std::vector<int32_t>& first, std::vector<int32_t>& token, int32_t* slot);

}  // namespace optiml
