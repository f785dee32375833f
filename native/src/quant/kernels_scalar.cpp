// PLACEHOLDER until the quantization helper lands.
#include "optiml/kernels.h"
#include "optiml/quant.h"

namespace optiml {
void fill_kernels_scalar(KernelTable& table) {}
bool can_dequantize(int32_t type) { return false; }
bool can_quantize(int32_t type) { return false; }
void dequantize_row(int32_t type, const void* src, float* dst, int64_t n) {}
void quantize_row(int32_t type, const float* src, void* dst, int64_t n) {}
}  // namespace optiml
