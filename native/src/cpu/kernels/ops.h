// Element-wise and per-vector operations of the forward pass (ops.cpp), private to the CPU backend.
#pragma once

#include <cstdint>

#include "optiml/rope_yarn.h"

namespace optiml {

// out = x / sqrt(mean(x^2) + eps) * w (w may be null: no scale). out may alias x.
void rms_norm(const float* x, const float* w, float* out, int64_t n, float eps);

// Rotates one head vector by position: for each pair (a, b) of the first n_rot dimensions,
// (a, b) <- (a cos - b sin, a sin + b cos). Pairs are (2i, 2i+1) when neox is false (llama), else
// (i, i + n_rot/2) (NeoX, Qwen2). cos/sin hold n_rot/2 values for this position.
void rope(float* x, int64_t n_rot, const float* cos, const float* sin, bool neox);

// cos/sin of pos * freq_scale * base^(-2i/n_rot) / freq_factor[i] (freq_factors may be null); with YaRN
// (yarn: the layer's range, HParams::rope_yarn), ggml's rope_yarn: each angle blended with the unscaled one
// by the ramp between the correction dimensions, and cos/sin times yarn.mscale.
void rope_cos_sin(int64_t pos, int64_t n_rot, float freq_base, float freq_scale, const float* freq_factors,
                  float* cos, float* sin, const RopeYarnRange& yarn = RopeYarnRange());

// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in float, as ggml_gelu_f32 writes it.
float gelu_tanh(float x);
// For every f16 bit pattern h: gelu_tanh(h) rounded to f16, as a float (ggml's ggml_table_gelu_f16).
const float* gelu_table_f16();

}  // namespace optiml
