// IQ4_NL and IQ4_XS (ggml types 20 and 23): 4-bit codes into a non-linear table of 16 levels, under a scale
// per 32 values (IQ4_NL) or a 256-value super-block scale times a six-bit scale per 32 (IQ4_XS). Files
// quantized by llama.cpp carry them; this library reads them (dequantization here, the dot products in
// vec_dot_scalar.cpp and the SIMD kernels) and does not write them (llama-quantize does).
//
// Dequantization: table value times the scale, as ggml's dequantize_row_iq4_nl / _iq4_xs (d * (ls - 32)
// formed first, then times the table value).
#include "quant_impl.h"

namespace optiml {
namespace quant {

void dequantize_row_iq4_nl(const void* vx, float* y, int64_t n) {
    const block_iq4_nl* x = (const block_iq4_nl*)vx;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = fp16_to_fp32(x[i].d);
        for (int j = 0; j < 16; j++) {
            y[32 * i + j] = d * (float)kIq4nlValues[x[i].qs[j] & 0x0F];
            y[32 * i + j + 16] = d * (float)kIq4nlValues[x[i].qs[j] >> 4];
        }
    }
}

void dequantize_row_iq4_xs(const void* vx, float* y, int64_t n) {
    const block_iq4_xs* x = (const block_iq4_xs*)vx;
    for (int64_t i = 0; i < n / 256; i++) {
        const float d = fp16_to_fp32(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            const float dl = d * (float)iq4_xs_scale(x[i], ib);
            const uint8_t* qs = x[i].qs + 16 * ib;
            float* out = y + 256 * i + 32 * ib;
            for (int j = 0; j < 16; j++) {
                out[j] = dl * (float)kIq4nlValues[qs[j] & 0x0F];
                out[j + 16] = dl * (float)kIq4nlValues[qs[j] >> 4];
            }
        }
    }
}

}  // namespace quant
}  // namespace optiml
