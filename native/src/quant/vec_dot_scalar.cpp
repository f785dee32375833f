// Portable dot products of a weight row with an activation row already converted to the weight
// type's vec_dot_type, and fill_kernels_scalar(), which registers them with the from_float converters.
//
// Semantics are llama.cpp's: integer products are summed exactly per block (or sub-block), then scaled
// by the float block scales and accumulated in float. Float types (F32/F16/BF16) accumulate in double,
// as ggml's scalar code does, so the scalar table is also a precise reference for the SIMD ones.
#include "optiml/kernels.h"
#include "quant_impl.h"

namespace optiml {
namespace quant {

namespace {

constexpr int QK = OPTIML_QK_K;

void vec_dot_f32(int64_t n, float* s, const void* vw, const void* vx) {
    const float* w = (const float*)vw;
    const float* x = (const float*)vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)w[i] * (double)x[i];
    *s = (float)sum;
}

void vec_dot_f16(int64_t n, float* s, const void* vw, const void* vx) {
    const fp16_t* w = (const fp16_t*)vw;
    const fp16_t* x = (const fp16_t*)vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(fp16_to_fp32(w[i]) * fp16_to_fp32(x[i]));  // exact in float
    *s = (float)sum;
}

void vec_dot_bf16(int64_t n, float* s, const void* vw, const void* vx) {
    const bf16_t* w = (const bf16_t*)vw;
    const bf16_t* x = (const bf16_t*)vx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += (double)(bf16_to_fp32(w[i]) * bf16_to_fp32(x[i]));  // exact in float
    *s = (float)sum;
}

// ---- 32-element formats -------------------------------------------------------------------

void vec_dot_q4_0_q8_0(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q4_0* w = (const block_q4_0*)vw;
    const block_q8_0* x = (const block_q8_0*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            sumi += ((w[i].qs[j] & 0x0F) - 8) * x[i].qs[j];
            sumi += ((w[i].qs[j] >> 4) - 8) * x[i].qs[j + 16];
        }
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d));
    }
    *s = sumf;
}

void vec_dot_q4_1_q8_1(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q4_1* w = (const block_q4_1*)vw;
    const block_q8_1* x = (const block_q8_1*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            sumi += (w[i].qs[j] & 0x0F) * x[i].qs[j];
            sumi += (w[i].qs[j] >> 4) * x[i].qs[j + 16];
        }
        // The min term: sum_j m*dx*q_j = m * s, with s = dx*sum(q) stored in the Q8_1 block.
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d)) +
                fp16_to_fp32(w[i].m) * fp16_to_fp32(x[i].s);
    }
    *s = sumf;
}

void vec_dot_q5_0_q8_0(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q5_0* w = (const block_q5_0*)vw;
    const block_q8_0* x = (const block_q8_0*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        uint32_t qh;
        std::memcpy(&qh, w[i].qh, 4);
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            const int q0 = ((w[i].qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4)) - 16;
            const int q1 = ((w[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - 16;
            sumi += q0 * x[i].qs[j] + q1 * x[i].qs[j + 16];
        }
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d));
    }
    *s = sumf;
}

void vec_dot_q5_1_q8_1(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q5_1* w = (const block_q5_1*)vw;
    const block_q8_1* x = (const block_q8_1*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        uint32_t qh;
        std::memcpy(&qh, w[i].qh, 4);
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            const int q0 = (w[i].qs[j] & 0x0F) | (int)(((qh >> j) & 1) << 4);
            const int q1 = (w[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            sumi += q0 * x[i].qs[j] + q1 * x[i].qs[j + 16];
        }
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d)) +
                fp16_to_fp32(w[i].m) * fp16_to_fp32(x[i].s);
    }
    *s = sumf;
}

// IQ4_NL: table values against the codes, exact per block, then scaled as Q4_0's blocks are.
void vec_dot_iq4_nl_q8_0(int64_t n, float* s, const void* vw, const void* vx) {
    const block_iq4_nl* w = (const block_iq4_nl*)vw;
    const block_q8_0* x = (const block_q8_0*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            sumi += kIq4nlValues[w[i].qs[j] & 0x0F] * x[i].qs[j];
            sumi += kIq4nlValues[w[i].qs[j] >> 4] * x[i].qs[j + 16];
        }
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d));
    }
    *s = sumf;
}

// IQ4_XS: per super-block, the sub-blocks' integer dots times their six-bit scales, summed exactly, then
// times d_w * d_x (the SIMD kernels form the same integer).
void vec_dot_iq4_xs_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_iq4_xs* w = (const block_iq4_xs*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        int isum = 0;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t* qs = w[i].qs + 16 * ib;
            const int8_t* q8 = x[i].qs + 32 * ib;
            int sumi = 0;
            for (int j = 0; j < 16; j++) sumi += kIq4nlValues[qs[j] & 0x0F] * q8[j] + kIq4nlValues[qs[j] >> 4] * q8[j + 16];
            isum += iq4_xs_scale(w[i], ib) * sumi;
        }
        sumf += (x[i].d * fp16_to_fp32(w[i].d)) * (float)isum;
    }
    *s = sumf;
}

void vec_dot_q8_0_q8_0(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q8_0* w = (const block_q8_0*)vw;
    const block_q8_0* x = (const block_q8_0*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int sumi = 0;
        for (int j = 0; j < 32; j++) sumi += w[i].qs[j] * x[i].qs[j];
        sumf += (float)sumi * (fp16_to_fp32(w[i].d) * fp16_to_fp32(x[i].d));
    }
    *s = sumf;
}

// MXFP4: table values (the doubled E2M1 values, integers) against the codes, exact per block; the block
// scale is the E8M0 half-scale times d_x (exact: a power of two times an fp16).
void vec_dot_mxfp4_q8_0(int64_t n, float* s, const void* vw, const void* vx) {
    const block_mxfp4* w = (const block_mxfp4*)vw;
    const block_q8_0* x = (const block_q8_0*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            sumi += kMxfp4Values[w[i].qs[j] & 0x0F] * x[i].qs[j];
            sumi += kMxfp4Values[w[i].qs[j] >> 4] * x[i].qs[j + 16];
        }
        sumf += (float)sumi * (e8m0_to_fp32_half(w[i].e) * fp16_to_fp32(x[i].d));
    }
    *s = sumf;
}

// ---- k-quants · Q8_K ------------------------------------------------------------------------
// Codes of one 256-block are unpacked to q[0..256) in element order, then summed against Q8_K's
// codes per sub-block. The subtracted mins of Q2_K/Q4_K/Q5_K use Q8_K's bsums: the min term of a
// sub-block is m * sum(x codes), which bsums already holds.

// Sum of a[k]*b[k] for k < len.
inline int dot_i8(const int8_t* a, const int8_t* b, int len) {
    int s = 0;
    for (int k = 0; k < len; k++) s += a[k] * b[k];
    return s;
}

void vec_dot_q2_K_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q2_K* w = (const block_q2_K*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    int8_t q[QK];
    float sumf = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) q[h * 128 + k * 32 + l] = (int8_t)((w[i].qs[h * 32 + l] >> (2 * k)) & 3);
        int isum = 0, summs = 0;
        for (int j = 0; j < 16; j++) {
            isum += (w[i].scales[j] & 0xF) * dot_i8(q + 16 * j, x[i].qs + 16 * j, 16);
            summs += (w[i].scales[j] >> 4) * x[i].bsums[j];
        }
        const float dall = x[i].d * fp16_to_fp32(w[i].d);
        const float dmin = x[i].d * fp16_to_fp32(w[i].dmin);
        sumf += dall * (float)isum - dmin * (float)summs;
    }
    *s = sumf;
}

void vec_dot_q3_K_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q3_K* w = (const block_q3_K*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    int8_t q[QK], sc[16];
    float sumf = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        for (int h = 0; h < 2; h++)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 32; l++) {
                    const int e = h * 128 + k * 32 + l;
                    const int lo = (w[i].qs[h * 32 + l] >> (2 * k)) & 3;
                    const int hi = (w[i].hmask[l] >> (e / 32)) & 1;
                    q[e] = (int8_t)(lo - (hi ? 0 : 4));
                }
        q3_K_scales(w[i].scales, sc);
        int isum = 0;
        for (int j = 0; j < 16; j++) isum += sc[j] * dot_i8(q + 16 * j, x[i].qs + 16 * j, 16);
        sumf += (x[i].d * fp16_to_fp32(w[i].d)) * (float)isum;
    }
    *s = sumf;
}

// Q4_K and Q5_K differ only in the codes; hi == nullptr means no fifth bit.
inline float dot_q45_K_block(const block_q4_K* w4, const block_q5_K* w5, const block_q8_K& x) {
    const uint8_t* scales = w4 ? w4->scales : w5->scales;
    const uint8_t* ql = w4 ? w4->qs : w5->qs;
    int8_t q[QK];
    for (int j = 0; j < 4; j++) {
        for (int l = 0; l < 32; l++) {
            int lo = ql[32 * j + l] & 0xF, hi = ql[32 * j + l] >> 4;
            if (w5) {
                lo += ((w5->qh[l] >> (2 * j)) & 1) << 4;
                hi += ((w5->qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            q[64 * j + l] = (int8_t)lo;
            q[64 * j + 32 + l] = (int8_t)hi;
        }
    }
    int isum = 0, summs = 0;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        get_scale_min_k4(j, scales, &sc, &m);
        isum += sc * dot_i8(q + 32 * j, x.qs + 32 * j, 32);
        summs += m * (x.bsums[2 * j] + x.bsums[2 * j + 1]);
    }
    const fp16_t d = w4 ? w4->d : w5->d, dmin = w4 ? w4->dmin : w5->dmin;
    return (x.d * fp16_to_fp32(d)) * (float)isum - (x.d * fp16_to_fp32(dmin)) * (float)summs;
}

void vec_dot_q4_K_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q4_K* w = (const block_q4_K*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / QK; i++) sumf += dot_q45_K_block(&w[i], nullptr, x[i]);
    *s = sumf;
}

void vec_dot_q5_K_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q5_K* w = (const block_q5_K*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    float sumf = 0;
    for (int64_t i = 0; i < n / QK; i++) sumf += dot_q45_K_block(nullptr, &w[i], x[i]);
    *s = sumf;
}

void vec_dot_q6_K_q8_K(int64_t n, float* s, const void* vw, const void* vx) {
    const block_q6_K* w = (const block_q6_K*)vw;
    const block_q8_K* x = (const block_q8_K*)vx;
    int8_t q[QK];
    float sumf = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        const uint8_t* ql = w[i].ql;
        const uint8_t* qh = w[i].qh;
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            int8_t* o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l + 0] = (int8_t)(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int isum = 0;
        for (int j = 0; j < 16; j++) isum += w[i].scales[j] * dot_i8(q + 16 * j, x[i].qs + 16 * j, 16);
        sumf += (x[i].d * fp16_to_fp32(w[i].d)) * (float)isum;
    }
    *s = sumf;
}

}  // namespace
}  // namespace quant

void fill_kernels_scalar(KernelTable& t) {
    using namespace quant;
    t.vec_dot[TYPE_F32] = vec_dot_f32;
    t.vec_dot[TYPE_F16] = vec_dot_f16;
    t.vec_dot[TYPE_BF16] = vec_dot_bf16;
    t.vec_dot[TYPE_Q4_0] = vec_dot_q4_0_q8_0;
    t.vec_dot[TYPE_Q4_1] = vec_dot_q4_1_q8_1;
    t.vec_dot[TYPE_Q5_0] = vec_dot_q5_0_q8_0;
    t.vec_dot[TYPE_Q5_1] = vec_dot_q5_1_q8_1;
    t.vec_dot[TYPE_Q8_0] = vec_dot_q8_0_q8_0;
    t.vec_dot[TYPE_MXFP4] = vec_dot_mxfp4_q8_0;
    t.vec_dot[TYPE_IQ4_NL] = vec_dot_iq4_nl_q8_0;
    t.vec_dot[TYPE_IQ4_XS] = vec_dot_iq4_xs_q8_K;
    t.vec_dot[TYPE_Q2_K] = vec_dot_q2_K_q8_K;
    t.vec_dot[TYPE_Q3_K] = vec_dot_q3_K_q8_K;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K_q8_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K_q8_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K_q8_K;

    t.from_float[TYPE_F32] = copy_row_f32;
    t.from_float[TYPE_F16] = quantize_row_f16;
    t.from_float[TYPE_BF16] = quantize_row_bf16;
    t.from_float[TYPE_Q8_0] = activation_row_q8_0;
    t.from_float[TYPE_Q8_1] = activation_row_q8_1;
    t.from_float[TYPE_Q8_K] = quantize_row_q8_K;
}

}  // namespace optiml
