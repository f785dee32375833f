// A mixture of experts' routing on the host (optiml/moe_route.h), as llama.cpp's build_moe_ffn routes.
#include "optiml/moe_route.h"

#include <algorithm>
#include <cmath>

namespace optiml {

namespace {

// p = softmax(l) over n values, in float with the sum in double, as llama.cpp's soft_max (p may be l).
void softmax(const float* l, int32_t n, float* p) {
    const float mx = *std::max_element(l, l + n);
    double sum = 0;
    for (int32_t e = 0; e < n; e++) sum += p[e] = std::exp(l[e] - mx);
    const float inv = (float)(1.0 / sum);
    for (int32_t e = 0; e < n; e++) p[e] *= inv;
}

}  // namespace

void moe_route(const HParams& hp, const float* logits, int32_t n, int32_t* chosen, float* weight) {
    const int32_t X = hp.n_expert, k = hp.n_expert_used;
    std::vector<float> p(X);
    std::vector<int32_t> idx(X);
    for (int32_t t = 0; t < n; t++) {
        const float* l = logits + (size_t)t * X;
        // softmax over every expert (in float, the sum in double: llama.cpp's soft_max); or, gating by the
        // chosen experts' softmax, the raw logits rank them
        if (hp.expert_gating == MOE_GATING_SOFTMAX_CHOSEN) std::copy(l, l + X, p.begin());
        else softmax(l, X, p.data());
        // the k most probable, best first (ties: the lower index)
        for (int32_t e = 0; e < X; e++) idx[e] = e;
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                          [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
        float wsum = 0;
        for (int32_t j = 0; j < k; j++) {
            chosen[t * k + j] = idx[j];
            weight[t * k + j] = p[idx[j]];
            wsum += p[idx[j]];
        }
        if (hp.expert_gating == MOE_GATING_SOFTMAX_CHOSEN) softmax(weight + t * k, k, weight + t * k);
        if (hp.expert_weights_norm) {  // as llama.cpp: divided by the sum, clamped away from 0
            const float d = std::max(wsum, 6.103515625e-5f);
            for (int32_t j = 0; j < k; j++) weight[t * k + j] /= d;
        }
        if (hp.expert_weights_scale != 1.0f)
            for (int32_t j = 0; j < k; j++) weight[t * k + j] *= hp.expert_weights_scale;
    }
}

void moe_group(const int32_t* chosen, int64_t nk, int32_t k, int32_t n_expert, const int32_t* order,
               std::vector<int32_t>& count, std::vector<int32_t>& first, std::vector<int32_t>& token, int32_t* slot) {
    count.assign(n_expert, 0);
    first.resize(n_expert);
    token.resize(nk);
    for (int64_t i = 0; i < nk; i++) count[chosen[i]]++;
    for (int32_t j = 0, at = 0; j < n_expert; j++) {
        const int32_t e = order ? order[j] : j;
        first[e] = at, at += count[e];
    }
    std::vector<int32_t> fill(first);
    for (int64_t i = 0; i < nk; i++) {
        const int32_t row = fill[chosen[i]]++;
        slot[i] = row;
        token[row] = (int32_t)(i / k);
    }
}

}  // namespace optiml
