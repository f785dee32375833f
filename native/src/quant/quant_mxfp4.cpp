// MXFP4 (ggml type 39, the experts of gpt-oss files): 32 E2M1 codes under one E8M0 scale, as ggml stores
// them (block_mxfp4 in optiml/ggml_types.h).
//
// Quantization is ggml's quantize_row_mxfp4_ref (and gguf-py's MXFP4.quantize_blocks): e = floor(log2(amax))
// - 2 + 127, so that the block's largest magnitude lands in [4, 8) half-scales (the table reaches 12:
// values up to 1.5 times 2^floor(log2(amax)) keep their nearest code), then each value takes the code of
// the nearest table value, the first one on ties. Every operation is float32 as there: the table value
// times the scale is exact (a power of two times a small integer), the difference with x is rounded once,
// and the comparisons are strict, so the bytes are ggml's. Where ggml's float-to-uint8 cast is undefined
// (amax below 2^-125, or infinite), e is clamped to 0 and 255.
//
// Dequantization: table value times the scale, exact in float32 (denormal scales included).
#include "quant_impl.h"

namespace optiml {
namespace quant {

namespace {

// The index of the table value nearest x at scale d (the first of equals).
inline uint8_t nearest_mxfp4(float x, float d) {
    uint8_t best = 0;
    float best_err = std::fabs((float)kMxfp4Values[0] * d - x);
    for (uint8_t i = 1; i < 16; i++) {
        const float err = std::fabs((float)kMxfp4Values[i] * d - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

// ggml's scale exponent for a block whose largest magnitude is amax (NaNs ignored there, as here).
inline uint8_t mxfp4_exponent(float amax) {
    if (!(amax > 0.0f)) return 0;
    const float e = std::floor(std::log2(amax)) - 2.0f + 127.0f;
    if (!(e >= 0.0f)) return 0;
    return e >= 255.0f ? 255 : (uint8_t)e;
}

}  // namespace

void quantize_row_mxfp4(const float* x, void* vy, int64_t n) {
    block_mxfp4* y = (block_mxfp4*)vy;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            if (amax < std::fabs(x[j])) amax = std::fabs(x[j]);
        const uint8_t e = mxfp4_exponent(amax);
        const float d = e8m0_to_fp32_half(e);
        y[i].e = e;
        for (int j = 0; j < 16; j++)
            y[i].qs[j] = (uint8_t)(nearest_mxfp4(x[j], d) | (nearest_mxfp4(x[j + 16], d) << 4));
    }
}

void dequantize_row_mxfp4(const void* vx, float* y, int64_t n) {
    const block_mxfp4* x = (const block_mxfp4*)vx;
    for (int64_t i = 0; i < n / 32; i++, y += 32) {
        const float d = e8m0_to_fp32_half(x[i].e);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)kMxfp4Values[x[i].qs[j] & 0x0F] * d;
            y[j + 16] = (float)kMxfp4Values[x[i].qs[j] >> 4] * d;
        }
    }
}

}  // namespace quant
}  // namespace optiml
