// IQ4_NL and IQ4_XS (ggml types 20 and 23): 4-bit codes into a non-linear table of 16 levels, under a scale
// per 32 values (IQ4_NL) or a 256-value super-block scale times a six-bit scale per 32 (IQ4_XS). Files
// quantized by llama.cpp carry them; this library reads them (dequantization here, the dot products in
// vec_dot_scalar.cpp and the SIMD kernels) and writes them as llama-quantize does without an importance matrix
// (quantize_row_iq4_nl / _iq4_xs below).
//
// Dequantization: table value times the scale, as ggml's dequantize_row_iq4_nl / _iq4_xs (d * (ls - 32)
// formed first, then times the table value).
#include <algorithm>

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

namespace {

// The table index nearest to x (ggml's best_index_int8: ties to the upper level's side as it rounds them).
int best_index(float x) {
    const int8_t* v = kIq4nlValues;
    if (x <= v[0]) return 0;
    if (x >= v[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < v[mid]) hi = mid;
        else lo = mid;
    }
    return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

// ggml's quantize_row_iq4_nl_impl with no importance weights (each value weighs x^2) and 7 tries: per 32 values
// the scale that best fits the table, searched over 15 candidates around amax / 127; for a super-block of
// 256 (IQ4_XS) those scales then as six-bit multiples of the largest / 32, the codes chosen again under them.
// Products are rounded before they are summed (fp_barrier), as ggml's C reads without contraction.
void quantize_iq4_block(int super_size, const float* x, fp16_t* dh, uint8_t* q4, uint16_t* scales_h,
                        uint8_t* scales_l) {
    constexpr int ntry = 7;
    float scales[8];
    uint8_t L[256];
    float weight[32];
    std::memset(q4, 0, super_size / 2);
    *dh = fp32_to_fp16(0.0f);
    float max_scale = 0.0f, amax_scale = 0.0f;
    for (int ib = 0; ib < super_size / 32; ib++) {
        const float* xb = x + 32 * ib;
        uint8_t* Lb = L + 32 * ib;
        for (int j = 0; j < 32; j++) weight[j] = xb[j] * xb[j];
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float ax = std::fabs(xb[j]);
            if (ax > amax) {
                amax = ax;
                max = xb[j];
            }
        }
        if (amax < 1e-15f) {
            scales[ib] = 0.0f;
            continue;
        }
        float d = -max / kIq4nlValues[0];
        float id = 1.0f / d;
        float sumqx = 0.0f, sumq2 = 0.0f;
        for (int j = 0; j < 32; j++) {
            const int l = best_index(fp_barrier(id * xb[j]));
            Lb[j] = (uint8_t)l;
            const float q = kIq4nlValues[l], w = weight[j];
            sumqx += fp_barrier(fp_barrier(w * q) * xb[j]);
            sumq2 += fp_barrier(fp_barrier(w * q) * q);
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; itry++) {
            id = (itry + kIq4nlValues[0]) / max;
            sumqx = sumq2 = 0.0f;
            for (int j = 0; j < 32; j++) {
                const float q = kIq4nlValues[best_index(fp_barrier(id * xb[j]))], w = weight[j];
                sumqx += fp_barrier(fp_barrier(w * q) * xb[j]);
                sumq2 += fp_barrier(fp_barrier(w * q) * q);
            }
            if (sumq2 > 0 && fp_barrier(sumqx * sumqx) > fp_barrier(best * sumq2)) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        if (std::fabs(d) > amax_scale) {
            amax_scale = std::fabs(d);
            max_scale = d;
        }
    }
    if (super_size > 32) {
        *scales_h = 0;
        const float d = -max_scale / 32;
        *dh = fp32_to_fp16(d);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int ib = 0; ib < super_size / 32; ib++) {
            int l = std::max(-32, std::min(31, nearest_int(id * scales[ib])));
            const float dl = d * l, idl = dl != 0.0f ? 1.0f / dl : 0.0f;
            for (int j = 0; j < 32; j++) L[32 * ib + j] = (uint8_t)best_index(fp_barrier(idl * x[32 * ib + j]));
            l += 32;
            if (ib % 2 == 0) scales_l[ib / 2] = (uint8_t)(l & 0xF);
            else scales_l[ib / 2] |= (uint8_t)((l & 0xF) << 4);
            *scales_h |= (uint16_t)((l >> 4) << (2 * ib));
        }
    } else {
        *dh = fp32_to_fp16(scales[0]);
        const float id = scales[0] != 0.0f ? 1.0f / scales[0] : 0.0f;
        for (int j = 0; j < 32; j++) L[j] = (uint8_t)best_index(fp_barrier(id * x[j]));
    }
    for (int i = 0; i < super_size / 32; i++)
        for (int j = 0; j < 16; j++) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

}  // namespace

void quantize_row_iq4_nl(const float* x, void* vy, int64_t n) {
    block_iq4_nl* y = (block_iq4_nl*)vy;
    for (int64_t i = 0; i < n / 32; i++) quantize_iq4_block(32, x + 32 * i, &y[i].d, y[i].qs, nullptr, nullptr);
}

void quantize_row_iq4_xs(const float* x, void* vy, int64_t n) {
    block_iq4_xs* y = (block_iq4_xs*)vy;
    for (int64_t i = 0; i < n / 256; i++)
        quantize_iq4_block(256, x + 256 * i, &y[i].d, y[i].qs, &y[i].scales_h, y[i].scales_l);
}

}  // namespace quant
}  // namespace optiml
