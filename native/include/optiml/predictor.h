// Activation predictors (`optiml train-predictors`): per layer a low-rank map n_embd -> rank -> n_ff whose
// score says which FFN neurons will fire, so the sparse FFN computes gate, up and down for those alone.
// They live in a companion GGUF (MODEL.predictors.gguf) so the model file stays a valid llama.cpp file.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "optiml/gguf.h"
#include "optiml/model.h"

namespace optiml {

// Layer l's predictor: neuron j is predicted active for input x when (B (A x))[j] + bias[j] > threshold.
struct LayerPredictor {
    Weight a;     // [n_embd -> rank], F16, Q8_0 or F32
    Weight b;     // [rank -> n_ff], F16, Q8_0 or F32
    Weight bias;  // F32 [n_ff]
    float threshold = 0.0f;
    int32_t rank = 0;
};

// Keys and tensor names of the companion file (one place; python/optiml/predictor.py writes the same).
//   optiml.predictor.model_fingerprint (string), optiml.predictor.threshold (f32[n_layer]),
//   blk.N.ffn_pred_a.weight, blk.N.ffn_pred_b.weight, blk.N.ffn_pred_b.bias
struct Predictors {
    std::shared_ptr<GGUFFile> file;
    std::vector<LayerPredictor> layers;  // [n_layer]
    int32_t max_rank = 0;

    // Binds the predictors of `path` for `model`, checking that every tensor fits the model's shapes
    // (GGUFError otherwise). The content fingerprint is checked by the caller (python/optiml/predictor.py).
    static std::shared_ptr<const Predictors> load(const std::string& path, const Model& model);
};

}  // namespace optiml
