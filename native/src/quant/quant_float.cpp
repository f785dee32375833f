// F32, F16 and BF16 rows. Conversions round to nearest even, as numpy's astype(float16) and
// gguf-py's BF16 code do, so quantize_row output is byte-identical to gguf.quants.quantize.
#include "quant_impl.h"

namespace optiml {
namespace quant {

void copy_row_f32(const float* x, void* y, int64_t n) { std::memcpy(y, x, (size_t)n * sizeof(float)); }

void quantize_row_f16(const float* x, void* y, int64_t n) {
    fp16_t* out = (fp16_t*)y;
    for (int64_t i = 0; i < n; i++) out[i] = fp32_to_fp16(x[i]);
}

void quantize_row_bf16(const float* x, void* y, int64_t n) {
    bf16_t* out = (bf16_t*)y;
    for (int64_t i = 0; i < n; i++) out[i] = fp32_to_bf16(x[i]);
}

void dequantize_row_f32(const void* x, float* y, int64_t n) { std::memcpy(y, x, (size_t)n * sizeof(float)); }

void dequantize_row_f16(const void* x, float* y, int64_t n) {
    const fp16_t* in = (const fp16_t*)x;
    for (int64_t i = 0; i < n; i++) y[i] = fp16_to_fp32(in[i]);
}

void dequantize_row_bf16(const void* x, float* y, int64_t n) {
    const bf16_t* in = (const bf16_t*)x;
    for (int64_t i = 0; i < n; i++) y[i] = bf16_to_fp32(in[i]);
}

}  // namespace quant
}  // namespace optiml
