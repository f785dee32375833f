// YaRN RoPE scaling as ggml computes it (ggml_rope_yarn_corr_dims, rope_yarn), shared by the CPU's
// rope_cos_sin and the CUDA kernels so both turn q and k by the same angles.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace optiml {

struct RopeYarnRange {
    float ext_factor = 0.0f;        // 0: no YaRN (mscale may still scale cos and sin)
    float low = 0.0f, high = 0.0f;  // pairs below low extrapolate, above high interpolate, a ramp between
    float mscale = 1.0f;            // cos and sin are multiplied by it
};

// For a layer of RoPE base `base` and scale `freq_scale` (1 / the YaRN factor): ext_factor 0 (no YaRN)
// gives mscale = attn_factor and no ramp.
inline RopeYarnRange rope_yarn_range(int64_t n_rot, float base, float freq_scale, float ext_factor, float attn_factor,
                                     float beta_fast, float beta_slow, int32_t n_ctx_orig) {
    RopeYarnRange r;
    r.ext_factor = ext_factor;
    r.mscale = attn_factor;
    if (ext_factor == 0.0f) return r;
    // The dimension whose rotation turns `turns` times over the original context.
    auto dim = [&](float turns) {
        return (float)n_rot * std::log((float)n_ctx_orig / (turns * 2 * (float)M_PI)) / (2 * std::log(base));
    };
    r.low = std::max(0.0f, std::floor(dim(beta_fast)));
    r.high = std::min((float)(n_rot - 1), std::ceil(dim(beta_slow)));
    r.mscale *= 1.0f + 0.1f * std::log(1.0f / freq_scale);
    return r;
}

// Pair i's angle: the interpolated one (extrap * freq_scale) blended towards the extrapolated one by
// the ramp (1 below low, 0 above high) times ext_factor.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float rope_yarn_angle(float extrap, float freq_scale, int64_t i, float ext_factor, float low, float high) {
    const float interp = extrap * freq_scale;
    if (ext_factor == 0.0f) return interp;
    const float y = ((float)i - low) / (high - low > 0.001f ? high - low : 0.001f);
    const float mix = (1.0f - (y < 0.0f ? 0.0f : y > 1.0f ? 1.0f : y)) * ext_factor;
    return interp * (1.0f - mix) + extrap * mix;
}

}  // namespace optiml
