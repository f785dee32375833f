// Whole-row conversions between float32 and the block formats (scalar reference code,
// native/src/quant/). Rows must hold a whole number of blocks; callers check that.
#pragma once

#include <cstdint>

#include "optiml/ggml_types.h"

namespace optiml {

// Can `type` be dequantized / quantized by this library?
bool can_dequantize(int32_t type);
bool can_quantize(int32_t type);

// dst[0..n) = values of a row of `type` holding n elements.
void dequantize_row(int32_t type, const void* src, float* dst, int64_t n);

// Quantize a row of weights. For Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, F16, BF16 the bytes are identical to
// gguf-py's gguf.quants.quantize (MXFP4: for blocks whose largest magnitude is at least 2^-125, where
// ggml's scale exponent is defined); the k-quants follow llama.cpp's reference (non-imatrix) search.
void quantize_row(int32_t type, const float* src, void* dst, int64_t n);

}  // namespace optiml
