// The 256-element "k-quant" super-block formats Q2_K..Q6_K and the Q8_K activation format.
//
// Layouts are llama.cpp's (so gguf-py and llama.cpp read our bytes). Quantization follows
// llama.cpp's reference (no importance matrix) search: per sub-block a scale (and min) is fitted
// by a small grid search minimising weighted squared error, then the sub-block scales are themselves
// quantized to 4/6/8 bits against one fp16 super-scale, and finally every weight is re-rounded
// against the scale it will actually be decoded with.
#include <algorithm>

#include "quant_impl.h"

namespace optiml {
namespace quant {

namespace {

constexpr int QK = OPTIML_QK_K;
constexpr float GROUP_MAX_EPS = 1e-15f;  // a sub-block below this magnitude is treated as all zero

// Symmetric fit for n values onto integer levels [-nmax, nmax-1] (stored as L + nmax).
// Weights w = x^2 favour getting the large values right. Tries the plain scale amax/nmax and 18
// nearby ones and keeps the least-squares optimal scale of the best one. Returns the scale.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        if (std::fabs(x[i]) > amax) {
            amax = std::fabs(x[i]);
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        std::memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 > 0 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
            const float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        // sumlx^2/suml2 is the error reduction of the optimal scale for these levels.
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i]))));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

// Q3_K's symmetric fit: levels [-nmax, nmax-1], then coordinate-descent passes that move single
// levels while the weighted fit improves. Returns the scale; L holds level + nmax.
float make_q3_quants(int n, int nmax, const float* x, int8_t* L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        if (std::fabs(x[i]) > amax) {
            amax = std::fabs(x[i]);
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        std::memset(L, 0, (size_t)n);
        return 0.0f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * x[i])));
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int nl = std::max(-nmax, std::min(nmax - 1, nearest_int(x[i] * sl2 / slx)));
                if (nl != L[i]) {
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)nl;
                        sumlx = slx;
                        suml2 = sl2;
                        changed++;
                    }
                }
            }
        }
        if (!changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

// Asymmetric fit x ~ scale*L - min with L in [0, nmax] and min >= 0 (returned in *the_min).
// Starts from the min/max range, then tries nstep+1 scales (nmax + rmin + rdelta*is)/(max-min);
// for each, L is rounded and (scale, min) solved by weighted least squares; the best by weighted
// squared error (or absolute error when use_mad) is kept.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep, bool use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        min = std::min(min, x[i]);
        max = std::max(max, x[i]);
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        std::memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.0f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)std::max(0, std::min(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {  // the format only subtracts a min: refit the scale with min = 0
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? std::fabs(diff) : diff * diff;
                err += weights[i] * diff;
            }
            if (err < best_error) {
                std::memcpy(L, Laux, (size_t)n);
                best_error = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

// Packs 8 six-bit scales and mins into Q4_K/Q5_K's 12 bytes (inverse of get_scale_min_k4).
void pack_scale_min_k4(const uint8_t* ls, const uint8_t* lm, uint8_t* q) {
    std::memset(q, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            q[j] = ls[j];
            q[j + 4] = lm[j];
        } else {
            q[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
            q[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            q[j - 0] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}

// Shared by Q4_K (nmax 15) and Q5_K (nmax 31): fills d, dmin, scales and the codes L[256].
template <typename Block>
void fit_q45_K(const float* x, Block& y, uint8_t* L, int nmax, float rmin, float rdelta, int nstep) {
    float mins[8], scales[8], weights[32];
    uint8_t Laux[32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float* xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        const float av_x = std::sqrt(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + std::fabs(xs[l]);
        scales[j] = make_qkx2_quants(32, nmax, xs, weights, L + 32 * j, &mins[j], Laux, rmin, rdelta, nstep, false);
        max_scale = std::max(max_scale, scales[j]);
        max_min = std::max(max_min, mins[j]);
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        ls[j] = (uint8_t)std::min(63, nearest_int(inv_scale * scales[j]));
        lm[j] = (uint8_t)std::min(63, nearest_int(inv_min * mins[j]));
    }
    pack_scale_min_k4(ls, lm, y.scales);
    y.d = fp32_to_fp16(max_scale / 63.f);
    y.dmin = fp32_to_fp16(max_min / 63.f);
    // Re-round every weight against the scale and min as they will be decoded.
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        get_scale_min_k4(j, y.scales, &sc, &m);
        const float d = fp16_to_fp32(y.d) * sc;
        if (d == 0.0f) continue;
        const float dm = fp16_to_fp32(y.dmin) * m;
        for (int ii = 0; ii < 32; ii++)
            L[32 * j + ii] = (uint8_t)std::max(0, std::min(nmax, nearest_int((x[32 * j + ii] + dm) / d)));
    }
}

}  // namespace

void q3_K_scales(const uint8_t* p, int8_t* sc) {
    // Low 4 bits: bytes 0..7 (low nibble for scales 0..7, high nibble for 8..15);
    // high 2 bits: bytes 8..11, scale j in byte 8 + j%4 at bit 2*(j/4).
    for (int j = 0; j < 16; j++) {
        const int lo = j < 8 ? (p[j] & 0xF) : (p[j - 8] >> 4);
        const int hi = (p[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

// ---- quantization ------------------------------------------------------------------------------

void quantize_row_q2_K(const float* x, void* vy, int64_t n) {
    block_q2_K* y = (block_q2_K*)vy;
    uint8_t L[QK], Laux[16];
    float weights[16], mins[16], scales[16];
    const float q4scale = 15.f;
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            for (int l = 0; l < 16; l++) weights[l] = std::fabs(x[16 * j + l]);
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f, 15, true);
            max_scale = std::max(max_scale, scales[j]);
            max_min = std::max(max_min, mins[j]);
        }
        if (max_scale > 0) {
            const float iscale = q4scale / max_scale;
            for (int j = 0; j < 16; j++) y[i].scales[j] = (uint8_t)nearest_int(iscale * scales[j]);
            y[i].d = fp32_to_fp16(max_scale / q4scale);
        } else {
            std::memset(y[i].scales, 0, 16);
            y[i].d = fp32_to_fp16(0.f);
        }
        if (max_min > 0) {
            const float iscale = q4scale / max_min;
            for (int j = 0; j < 16; j++) y[i].scales[j] |= (uint8_t)(nearest_int(iscale * mins[j]) << 4);
            y[i].dmin = fp32_to_fp16(max_min / q4scale);
        } else {
            y[i].dmin = fp32_to_fp16(0.f);
        }
        for (int j = 0; j < 16; j++) {
            const float d = fp16_to_fp32(y[i].d) * (y[i].scales[j] & 0xF);
            if (d == 0.0f) continue;
            const float dm = fp16_to_fp32(y[i].dmin) * (y[i].scales[j] >> 4);
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (uint8_t)std::max(0, std::min(3, nearest_int((x[16 * j + ii] + dm) / d)));
        }
        // Byte l of each 32-byte group holds elements l, l+32, l+64, l+96 of its 128 (2 bits each).
        for (int j = 0; j < QK; j += 128)
            for (int l = 0; l < 32; l++)
                y[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

void quantize_row_q3_K(const float* x, void* vy, int64_t n) {
    block_q3_K* y = (block_q3_K*)vy;
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
            if (std::fabs(scales[j]) > amax) {
                amax = std::fabs(scales[j]);
                max_scale = scales[j];
            }
        }
        std::memset(y[i].scales, 0, 12);
        if (max_scale != 0.0f) {
            const float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; j++) {
                const int l = std::max(-32, std::min(31, nearest_int(iscale * scales[j]))) + 32;
                if (j < 8) y[i].scales[j] = (uint8_t)(l & 0xF);
                else y[i].scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                y[i].scales[j % 4 + 8] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            y[i].d = fp32_to_fp16(1 / iscale);
        } else {
            y[i].d = fp32_to_fp16(0.f);
        }
        int8_t sc[16];
        q3_K_scales(y[i].scales, sc);
        for (int j = 0; j < 16; j++) {
            const float d = fp16_to_fp32(y[i].d) * sc[j];
            if (d == 0.0f) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (int8_t)(std::max(-4, std::min(3, nearest_int(x[16 * j + ii] / d))) + 4);
        }
        // Bit 2 of each code goes to hmask: element j sets bit j/32 of hmask[j%32].
        std::memset(y[i].hmask, 0, 32);
        for (int j = 0; j < QK; j++) {
            if (L[j] > 3) {
                y[i].hmask[j % 32] |= (uint8_t)(1 << (j / 32));
                L[j] -= 4;
            }
        }
        for (int j = 0; j < QK; j += 128)
            for (int l = 0; l < 32; l++)
                y[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

void quantize_row_q4_K(const float* x, void* vy, int64_t n) {
    block_q4_K* y = (block_q4_K*)vy;
    uint8_t L[QK];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        fit_q45_K(x, y[i], L, 15, -1.f, 0.1f, 20);
        // 32 bytes per 64 elements: low nibbles the first 32, high nibbles the next 32.
        uint8_t* q = y[i].qs;
        for (int j = 0; j < QK; j += 64, q += 32)
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}

void quantize_row_q5_K(const float* x, void* vy, int64_t n) {
    block_q5_K* y = (block_q5_K*)vy;
    uint8_t L[QK];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        fit_q45_K(x, y[i], L, 31, -0.5f, 0.1f, 15);
        // Low 4 bits as in Q4_K; bit 4 of element 64k+l (l < 32) in qh[l] bit 2k, of 64k+32+l in bit 2k+1.
        uint8_t* qh = y[i].qh;
        uint8_t* ql = y[i].qs;
        std::memset(qh, 0, 32);
        uint8_t m1 = 1, m2 = 2;
        for (int j = 0; j < QK; j += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
            for (int l = 0; l < 32; l++) {
                int l1 = L[j + l], l2 = L[j + l + 32];
                if (l1 > 15) { l1 -= 16; qh[l] |= m1; }
                if (l2 > 15) { l2 -= 16; qh[l] |= m2; }
                ql[l] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

void quantize_row_q6_K(const float* x, void* vy, int64_t n) {
    block_q6_K* y = (block_q6_K*)vy;
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
            if (std::fabs(scales[ib]) > max_abs_scale) {
                max_abs_scale = std::fabs(scales[ib]);
                max_scale = scales[ib];
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            std::memset(&y[i], 0, sizeof(block_q6_K));
            continue;
        }
        const float iscale = -128.f / max_scale;
        y[i].d = fp32_to_fp16(1 / iscale);
        for (int ib = 0; ib < 16; ib++) y[i].scales[ib] = (int8_t)std::min(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < 16; j++) {
            const float d = fp16_to_fp32(y[i].d) * y[i].scales[j];
            if (d == 0.0f) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (int8_t)(std::max(-32, std::min(31, nearest_int(x[16 * j + ii] / d))) + 32);
        }
        // Per 128 elements: ql[l] = low nibbles of l and l+64, ql[l+32] of l+32 and l+96;
        // qh[l] = the high 2 bits of l, l+32, l+64, l+96.
        uint8_t* ql = y[i].ql;
        uint8_t* qh = y[i].qh;
        for (int j = 0; j < QK; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                const uint8_t* q = (const uint8_t*)L + j + l;
                ql[l] = (uint8_t)((q[0] & 0xF) | ((q[64] & 0xF) << 4));
                ql[l + 32] = (uint8_t)((q[32] & 0xF) | ((q[96] & 0xF) << 4));
                qh[l] = (uint8_t)((q[0] >> 4) | ((q[32] >> 4) << 2) | ((q[64] >> 4) << 4) | ((q[96] >> 4) << 6));
            }
        }
    }
}

void quantize_row_q8_K(const float* x, void* vy, int64_t n) {
    block_q8_K* y = (block_q8_K*)vy;
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max = 0, amax = 0;
        for (int j = 0; j < QK; j++) {
            if (std::fabs(x[j]) > amax) {
                amax = std::fabs(x[j]);
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            std::memset(&y[i], 0, sizeof(block_q8_K));
            continue;
        }
        // The extreme maps to -127 exactly; the opposite sign may round to +128, hence the min().
        const float iscale = -127.f / max;
        for (int j = 0; j < QK; j++) y[i].qs[j] = (int8_t)std::min(127, nearest_int(iscale * x[j]));
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += y[i].qs[16 * j + l];
            y[i].bsums[j] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

// ---- dequantization ----------------------------------------------------------------------------
// As for the 32-element formats, sub-scale * code products are exact in float32, so the results
// equal ggml's and gguf-py's bit for bit.

void dequantize_row_q2_K(const void* vx, float* y, int64_t n) {
    const block_q2_K* x = (const block_q2_K*)vx;
    for (int64_t i = 0; i < n / QK; i++) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        for (int j = 0; j < QK; j++) {
            // element j: 128-half h, within it position p; byte h*32 + p%32, shift 2*(p/32)
            const int h = j / 128, p = j % 128;
            const int q = (x[i].qs[h * 32 + p % 32] >> (2 * (p / 32))) & 3;
            const uint8_t sc = x[i].scales[j / 16];
            const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
            *y++ = dl * (float)q - ml;
        }
    }
}

void dequantize_row_q3_K(const void* vx, float* y, int64_t n) {
    const block_q3_K* x = (const block_q3_K*)vx;
    int8_t sc[16];
    for (int64_t i = 0; i < n / QK; i++) {
        const float d = fp16_to_fp32(x[i].d);
        q3_K_scales(x[i].scales, sc);
        for (int j = 0; j < QK; j++) {
            const int h = j / 128, p = j % 128;
            const int lo = (x[i].qs[h * 32 + p % 32] >> (2 * (p / 32))) & 3;
            const int hi = (x[i].hmask[j % 32] >> (j / 32)) & 1;
            const float dl = d * (float)sc[j / 16];
            *y++ = dl * (float)(lo - (hi ? 0 : 4));
        }
    }
}

void dequantize_row_q4_K(const void* vx, float* y, int64_t n) {
    const block_q4_K* x = (const block_q4_K*)vx;
    for (int64_t i = 0; i < n / QK; i++) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        const uint8_t* q = x[i].qs;
        for (int j = 0; j < 8; j += 2, q += 32) {
            uint8_t sc, m;
            get_scale_min_k4(j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            get_scale_min_k4(j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        }
    }
}

void dequantize_row_q5_K(const void* vx, float* y, int64_t n) {
    const block_q5_K* x = (const block_q5_K*)vx;
    for (int64_t i = 0; i < n / QK; i++) {
        const float d = fp16_to_fp32(x[i].d), dmin = fp16_to_fp32(x[i].dmin);
        const uint8_t* ql = x[i].qs;
        const uint8_t* qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            get_scale_min_k4(j, x[i].scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            get_scale_min_k4(j + 1, x[i].scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        }
    }
}

void dequantize_row_q6_K(const void* vx, float* y, int64_t n) {
    const block_q6_K* x = (const block_q6_K*)vx;
    for (int64_t i = 0; i < n / QK; i++) {
        const float d = fp16_to_fp32(x[i].d);
        const uint8_t* ql = x[i].ql;
        const uint8_t* qh = x[i].qh;
        const int8_t* sc = x[i].scales;
        for (int h = 0; h < 2; h++, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l + 0] = (d * (float)sc[is + 0]) * (float)q1;
                y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
        }
    }
}

void dequantize_row_q8_K(const void* vx, float* y, int64_t n) {
    const block_q8_K* x = (const block_q8_K*)vx;
    for (int64_t i = 0; i < n / QK; i++, y += QK)
        for (int j = 0; j < QK; j++) y[j] = x[i].d * (float)x[i].qs[j];
}

}  // namespace quant
}  // namespace optiml
