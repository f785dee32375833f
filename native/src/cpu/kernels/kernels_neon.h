// aarch64 NEON kernel bodies, private to kernels_neon.cpp and kernels_dotprod_neon.cpp: every
// weight type's dot product (one token; for the 32-element formats also four tokens and several rows
// at a time) and the activation conversions.
//
// Everything lives in an anonymous namespace, so each including file gets its own copy compiled
// with its own -march: kernels_neon.cpp for the baseline (armv8-a), kernels_dotprod_neon.cpp with
// the dot-product extension; fill_kernels_neon picks one at run time (as simd_common.h does on x86).
// Int8 dots use vdotq_s32 when the file is compiled for dotprod (__ARM_FEATURE_DOTPROD), else
// widening multiplies (vmull_s8 + pairwise accumulate). Both give exact integer block sums; only the
// split of a block's sum across the four int32 lanes differs, so the two builds may differ in the
// last float bits, and both differ from the scalar reference only by float summation order. Within
// one build, vec_dot, vec_dot4 and vec_dot_rows run the same per-(row, token) arithmetic (dot_tile
// below), so they agree bit for bit as kernels.h requires. Activation conversions are bit-identical
// to the scalar reference. Tested against the scalar table by tests/native/test_kernels.cpp
// (tools/neon_check.sh, in CI).
#pragma once

#include "quant/quant_impl.h"
#include "simd_neon.h"

namespace optiml {

// The table of kernels_dotprod_neon.cpp (the same kernels built with the dot-product extension).
void fill_kernels_neon_dotprod(KernelTable& table);

namespace {

// acc += sums of 4 adjacent int8 products, per int32 lane.
inline int32x4_t dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// Integer dot of 32 codes (two vectors) with 32 int8 activations, as int32 lanes.
inline int32x4_t dot32(int8x16_t q0, int8x16_t q1, const int8_t* x) {
    return dot_s8(dot_s8(vdupq_n_s32(0), q0, vld1q_s8(x)), q1, vld1q_s8(x + 16));
}

inline int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }

// ---- float types -----------------------------------------------------------------------------
// fp16_t and bf16_t are both uint16_t, so the element loads are told apart by a tag type.
struct F32 {
    typedef float T;
    static float32x4_t load4(const float* p) { return vld1q_f32(p); }
    static float load1(const float* p) { return *p; }
};
struct F16 {
    typedef fp16_t T;
    static float32x4_t load4(const fp16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
    static float load1(const fp16_t* p) { return h2f(*p); }
};
struct BF16 {  // bf16 -> f32 is a 16-bit shift into the high half
    typedef bf16_t T;
    static float32x4_t load4(const bf16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
    static float load1(const bf16_t* p) { return bf16_to_fp32(*p); }
};

// Four accumulators over steps of 16, then a scalar tail.
template <typename E>
void vec_dot_float(int64_t n, float* s, const void* w, const void* x) {
    const typename E::T* a = (const typename E::T*)w;
    const typename E::T* b = (const typename E::T*)x;
    float32x4_t acc0 = vdupq_n_f32(0), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = vfmaq_f32(acc0, E::load4(a + i), E::load4(b + i));
        acc1 = vfmaq_f32(acc1, E::load4(a + i + 4), E::load4(b + i + 4));
        acc2 = vfmaq_f32(acc2, E::load4(a + i + 8), E::load4(b + i + 8));
        acc3 = vfmaq_f32(acc3, E::load4(a + i + 12), E::load4(b + i + 12));
    }
    for (; i + 4 <= n; i += 4) acc0 = vfmaq_f32(acc0, E::load4(a + i), E::load4(b + i));
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc0, acc1), vaddq_f32(acc2, acc3)));
    for (; i < n; i++) sum += E::load1(a + i) * E::load1(b + i);
    *s = sum;
}

// ---- 32-element block quants -------------------------------------------------------------------
// A weight block is unpacked once into 32 signed int8 codes (elements 0..15 and 16..31), then dotted
// with one or several activation blocks.
struct Codes {
    int8x16_t lo, hi;
};

// 16 packed bytes -> low nibbles (elements 0..15) and high nibbles (16..31).
inline Codes nibbles(const uint8_t* qs) {
    const uint8x16_t v = vld1q_u8(qs);
    return Codes{s8(vandq_u8(v, vdupq_n_u8(0x0F))), s8(vshrq_n_u8(v, 4))};
}

// Bits 0..15 of (b0 | b1 << 8) -> 16 bytes, byte j = 0xFF if bit j is set else 0.
inline uint8x16_t bits_to_bytes_16(uint8_t b0, uint8_t b1) {
    const uint8x16_t sel = vreinterpretq_u8_u64(vdupq_n_u64(0x8040201008040201ULL));
    return vtstq_u8(vcombine_u8(vdup_n_u8(b0), vdup_n_u8(b1)), sel);
}

inline Codes codes(const block_q8_0& a) { return Codes{vld1q_s8(a.qs), vld1q_s8(a.qs + 16)}; }
// Q4_0: q - 8 in [-8, 7].
inline Codes codes(const block_q4_0& a) {
    const Codes c = nibbles(a.qs);
    return Codes{vsubq_s8(c.lo, vdupq_n_s8(8)), vsubq_s8(c.hi, vdupq_n_s8(8))};
}
// Q4_1: unsigned nibbles (the min is added separately).
inline Codes codes(const block_q4_1& a) { return nibbles(a.qs); }
// Q5_0: q - 16 = nibble | (fifth bit ? 0 : 0xF0) as a signed byte.
inline Codes codes(const block_q5_0& a) {
    const Codes c = nibbles(a.qs);
    const uint8x16_t f0 = vdupq_n_u8(0xF0);
    const uint8x16_t h0 = vbicq_u8(f0, bits_to_bytes_16(a.qh[0], a.qh[1]));
    const uint8x16_t h1 = vbicq_u8(f0, bits_to_bytes_16(a.qh[2], a.qh[3]));
    return Codes{vorrq_s8(c.lo, s8(h0)), vorrq_s8(c.hi, s8(h1))};
}
// Q5_1: unsigned q = nibble | (fifth bit ? 0x10 : 0).
inline Codes codes(const block_q5_1& a) {
    const Codes c = nibbles(a.qs);
    const uint8x16_t b = vdupq_n_u8(0x10);
    const uint8x16_t h0 = vandq_u8(b, bits_to_bytes_16(a.qh[0], a.qh[1]));
    const uint8x16_t h1 = vandq_u8(b, bits_to_bytes_16(a.qh[2], a.qh[3]));
    return Codes{vorrq_s8(c.lo, s8(h0)), vorrq_s8(c.hi, s8(h1))};
}

// MXFP4: each nibble looked up in the table of doubled E2M1 values (signed, -12..12).
inline Codes codes(const block_mxfp4& a) {
    const Codes c = nibbles(a.qs);
    const int8x16_t table = vld1q_s8(kMxfp4Values);
    return Codes{vqtbl1q_s8(table, vreinterpretq_u8_s8(c.lo)), vqtbl1q_s8(table, vreinterpretq_u8_s8(c.hi))};
}

// IQ4_NL: each nibble looked up in its table of 16 signed levels.
inline Codes codes(const block_iq4_nl& a) {
    const Codes c = nibbles(a.qs);
    const int8x16_t table = vld1q_s8(kIq4nlValues);
    return Codes{vqtbl1q_s8(table, vreinterpretq_u8_s8(c.lo)), vqtbl1q_s8(table, vreinterpretq_u8_s8(c.hi))};
}

// A weight block's scale: its fp16 d, or MXFP4's E8M0 half-scale.
template <typename WBlock>
inline float scale_of(const WBlock& a) { return h2f(a.d); }
inline float scale_of(const block_mxfp4& a) { return e8m0_to_fp32_half(a.e); }

// The min term of Q4_1/Q5_1 (m_w * s_x, s_x = d_x * sum(q_x) stored in Q8_1), one fma per block in
// block order; nothing for the other formats.
template <typename WBlock, typename XBlock>
inline void add_min(float&, const WBlock&, const XBlock&) {}
inline void add_min(float& m, const block_q4_1& a, const block_q8_1& b) { m = std::fma(h2f(a.m), h2f(b.s), m); }
inline void add_min(float& m, const block_q5_1& a, const block_q8_1& b) { m = std::fma(h2f(a.m), h2f(b.s), m); }

// s[r * NT + t] = dot(row r, token t) for NR weight rows w[r] and NT activation rows x[t], nb
// blocks each. Per (row, token), block after block: the exact integer block dot, converted to float
// lanes and multiply-added (scale d_w * d_x) into one vector; then a horizontal sum plus the min
// terms. Every NR/NT gives the same bits for a (row, token). `ahead` (NR rows, or null) are
// prefetched block by block in step: the rows a matrix-vector product reads next.
template <int NR, int NT, typename WBlock, typename XBlock>
inline void dot_tile(int64_t nb, float* s, const void* const* w, const void* const* x, const void* const* ahead) {
    const WBlock* a[NR];
    const XBlock* b[NT];
    float32x4_t acc[NR][NT];
    float mins[NR][NT];
    for (int r = 0; r < NR; r++) a[r] = (const WBlock*)w[r];
    for (int t = 0; t < NT; t++) b[t] = (const XBlock*)x[t];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) {
            acc[r][t] = vdupq_n_f32(0);
            mins[r][t] = 0.0f;
        }
    for (int64_t i = 0; i < nb; i++) {
        if (ahead)
            for (int r = 0; r < NR; r++) __builtin_prefetch((const WBlock*)ahead[r] + i, 0, 2);
        for (int r = 0; r < NR; r++) {
            const Codes q = codes(a[r][i]);
            const float dw = scale_of(a[r][i]);
            for (int t = 0; t < NT; t++) {
                const int32x4_t p = dot32(q.lo, q.hi, b[t][i].qs);
                acc[r][t] = vfmaq_n_f32(acc[r][t], vcvtq_f32_s32(p), dw * h2f(b[t][i].d));
                add_min(mins[r][t], a[r][i], b[t][i]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) s[r * NT + t] = vaddvq_f32(acc[r][t]) + mins[r][t];
}

template <typename WBlock, typename XBlock>
void vec_dot_32(int64_t n, float* s, const void* w, const void* x) {
    dot_tile<1, 1, WBlock, XBlock>(n / 32, s, &w, &x, nullptr);
}

template <typename WBlock, typename XBlock>
void vec_dot4_32(int64_t n, float* s, const void* w, const void* x, size_t x_stride) {
    const void* xs[4];
    for (int t = 0; t < 4; t++) xs[t] = (const uint8_t*)x + t * x_stride;
    dot_tile<1, 4, WBlock, XBlock>(n / 32, s, &w, xs, nullptr);
}

// Several rows against one activation row; rows holds n_rows + 8 pointers (kernels.h), so the NR
// rows after each group are there to prefetch.
template <typename WBlock, typename XBlock>
void vec_dot_rows_32(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    int64_t r = 0;
    for (; r + 8 <= n_rows; r += 8) dot_tile<8, 1, WBlock, XBlock>(n / 32, s + r, rows + r, &x, rows + r + 8);
    for (; r + 4 <= n_rows; r += 4) dot_tile<4, 1, WBlock, XBlock>(n / 32, s + r, rows + r, &x, rows + r + 4);
    for (; r < n_rows; r++) dot_tile<1, 1, WBlock, XBlock>(n / 32, s + r, rows + r, &x, rows + r + 1);
}

// ---- k-quants (256-element super-blocks, activations in Q8_K) ----------------------------------
// Integer sums per super-block are exact (int32 lanes, scaled per sub-block with vmlaq), then
// combined with the float scales as the scalar reference does.

// The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales (sc[0..7]) and 8 six-bit mins (mn[0..7]).
inline void unpack_scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        mn[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// sum over the 8 sub-blocks of 32: mn[j] * (bsums[2j] + bsums[2j+1]).
inline int mins_dot_bsums(const uint8_t* mn, const int16_t* bsums) {
    const int16x8_t pair = vpaddq_s16(vld1q_s16(bsums), vld1q_s16(bsums + 8));  // |.| <= 32 * 128
    const int16x8_t m = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mn)));
    return vaddvq_s32(vmlal_high_s16(vmull_s16(vget_low_s16(m), vget_low_s16(pair)), m, pair));
}

// sumi + scale * (16 signed codes q . the 16 int8 activations at x): the step of the k-quants with a
// scale per 16 elements (Q2_K, Q3_K, Q6_K).
inline int32x4_t add_group16(int32x4_t sumi, int8x16_t q, const int8_t* x, int32_t scale) {
    return vmlaq_n_s32(sumi, dot_s8(vdupq_n_s32(0), q, vld1q_s8(x)), scale);
}

// The k-quant vec_dot: the super-blocks' terms, each from the type's block function (always inlined, so
// the frame compiles as one loop), summed in block order.
template <typename WBlock, float (*block_dot)(const WBlock&, const block_q8_K&)>
void vec_dot_K(int64_t n, float* s, const void* w, const void* x) {
    const WBlock* a = (const WBlock*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    float sum = 0;
    for (int64_t i = 0; i < n / OPTIML_QK_K; i++) sum += block_dot(a[i], b[i]);
    *s = sum;
}

// IQ4_XS: each sub-block's codes (IQ4_NL's table) dotted with its 32 activations, times its six-bit scale,
// summed exactly; then times d_w * d_x (the scalar kernel's integer).
__attribute__((always_inline)) inline float dot_iq4_xs(const block_iq4_xs& a, const block_q8_K& b) {
    const int8x16_t table = vld1q_s8(kIq4nlValues);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    int32x4_t sumi = vdupq_n_s32(0);
    for (int ib = 0; ib < 8; ib++) {
        const uint8x16_t v = vld1q_u8(a.qs + 16 * ib);
        const int8x16_t lo = vqtbl1q_s8(table, vandq_u8(v, m4)), hi = vqtbl1q_s8(table, vshrq_n_u8(v, 4));
        sumi = vmlaq_n_s32(sumi, dot32(lo, hi, b.qs + 32 * ib), iq4_xs_scale(a, ib));
    }
    return (b.d * h2f(a.d)) * (float)vaddvq_s32(sumi);
}

__attribute__((always_inline)) inline float dot_q4_K(const block_q4_K& a, const block_q8_K& b) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    uint8_t sc[8], mn[8];
    unpack_scales_mins_k4(a.scales, sc, mn);
    const float d = b.d * h2f(a.d);
    const float dmin = b.d * h2f(a.dmin);
    int32x4_t sumi = vdupq_n_s32(0);
    for (int j = 0; j < 4; j++) {
        // 32 bytes hold sub-block 2j in the low nibbles and 2j+1 in the high nibbles.
        const uint8x16_t v0 = vld1q_u8(a.qs + 32 * j), v1 = vld1q_u8(a.qs + 32 * j + 16);
        const int8_t* q8 = b.qs + 64 * j;
        sumi = vmlaq_n_s32(sumi, dot32(s8(vandq_u8(v0, m4)), s8(vandq_u8(v1, m4)), q8), sc[2 * j]);
        sumi = vmlaq_n_s32(sumi, dot32(s8(vshrq_n_u8(v0, 4)), s8(vshrq_n_u8(v1, 4)), q8 + 32), sc[2 * j + 1]);
    }
    return d * (float)vaddvq_s32(sumi) - dmin * (float)mins_dot_bsums(mn, b.bsums);
}

__attribute__((always_inline)) inline float dot_q5_K(const block_q5_K& a, const block_q8_K& b) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    uint8_t sc[8], mn[8];
    unpack_scales_mins_k4(a.scales, sc, mn);
    const float d = b.d * h2f(a.d);
    const float dmin = b.d * h2f(a.dmin);
    // qh byte l holds the fifth bit of element l of each sub-block: bit j for sub-block j.
    uint8x16_t h0 = vld1q_u8(a.qh), h1 = vld1q_u8(a.qh + 16);
    int32x4_t sumi = vdupq_n_s32(0);
    for (int j = 0; j < 4; j++) {
        const uint8x16_t v0 = vld1q_u8(a.qs + 32 * j), v1 = vld1q_u8(a.qs + 32 * j + 16);
        const int8_t* q8 = b.qs + 64 * j;
        const uint8x16_t lo0 = vorrq_u8(vandq_u8(v0, m4), vshlq_n_u8(vandq_u8(h0, one), 4));
        const uint8x16_t lo1 = vorrq_u8(vandq_u8(v1, m4), vshlq_n_u8(vandq_u8(h1, one), 4));
        const uint8x16_t hi0 = vorrq_u8(vshrq_n_u8(v0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h0, 1), one), 4));
        const uint8x16_t hi1 = vorrq_u8(vshrq_n_u8(v1, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(h1, 1), one), 4));
        h0 = vshrq_n_u8(h0, 2);
        h1 = vshrq_n_u8(h1, 2);
        sumi = vmlaq_n_s32(sumi, dot32(s8(lo0), s8(lo1), q8), sc[2 * j]);
        sumi = vmlaq_n_s32(sumi, dot32(s8(hi0), s8(hi1), q8 + 32), sc[2 * j + 1]);
    }
    return d * (float)vaddvq_s32(sumi) - dmin * (float)mins_dot_bsums(mn, b.bsums);
}

// Q6_K: q in 0..63 (value q - 32), one signed scale per 16 elements. Codes are made signed before
// the dot (-32..31 fits int8), so no bsums correction is needed.
__attribute__((always_inline)) inline float dot_q6_K(const block_q6_K& a, const block_q8_K& b) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
    const int8x16_t off = vdupq_n_s8(32);
    const float d = b.d * h2f(a.d);
    int32x4_t sumi = vdupq_n_s32(0);
    for (int h = 0; h < 2; h++) {
        const uint8_t* ql = a.ql + 64 * h;
        const uint8_t* qh = a.qh + 32 * h;
        const int8_t* q8 = b.qs + 128 * h;
        const int8_t* sc = a.scales + 8 * h;
        for (int c = 0; c < 2; c++) {  // 16 elements per vector, each a scale group of its own
            const uint8x16_t l0 = vld1q_u8(ql + 16 * c), l1 = vld1q_u8(ql + 32 + 16 * c);
            const uint8x16_t hb = vld1q_u8(qh + 16 * c);
            const uint8x16_t q0 = vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4));
            const uint8x16_t q1 = vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4));
            const uint8x16_t q2 = vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4));
            const uint8x16_t q3 = vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4));
            const int8_t* xc = q8 + 16 * c;
            sumi = add_group16(sumi, vsubq_s8(s8(q0), off), xc, sc[c + 0]);
            sumi = add_group16(sumi, vsubq_s8(s8(q1), off), xc + 32, sc[c + 2]);
            sumi = add_group16(sumi, vsubq_s8(s8(q2), off), xc + 64, sc[c + 4]);
            sumi = add_group16(sumi, vsubq_s8(s8(q3), off), xc + 96, sc[c + 6]);
        }
    }
    return d * (float)vaddvq_s32(sumi);
}

// The 2-bit codes of Q2_K and Q3_K against the activations x: element 128h + 32j + l is bits 2j..2j+1 of
// qs[32h + l]; Q3 adds a third bit, bit 4h + j of hmask[l], and subtracts 4 (codes -4..3). sc: the 16
// group scales. Returns the groups' scaled integer sums.
template <bool Q3, typename Scale>
__attribute__((always_inline)) inline int32x4_t sum_2bit_groups(const uint8_t* qs, const uint8_t* hmask,
                                                                const Scale* sc, const int8_t* x) {
    const uint8x16_t m3 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    const int8x16_t four = vdupq_n_s8(4);
    uint8x16_t hm0 = vdupq_n_u8(0), hm1 = hm0;
    if constexpr (Q3) {
        hm0 = vld1q_u8(hmask);
        hm1 = vld1q_u8(hmask + 16);
    }
    int32x4_t sumi = vdupq_n_s32(0);
    for (int h = 0; h < 2; h++) {
        uint8x16_t q0 = vld1q_u8(qs + 32 * h), q1 = vld1q_u8(qs + 32 * h + 16);
        const int8_t* q8 = x + 128 * h;
        const Scale* sg = sc + 8 * h;
        for (int j = 0; j < 4; j++) {
            int8x16_t v0 = s8(vandq_u8(q0, m3)), v1 = s8(vandq_u8(q1, m3));
            if constexpr (Q3) {
                v0 = vsubq_s8(s8(vorrq_u8(vandq_u8(q0, m3), vshlq_n_u8(vandq_u8(hm0, one), 2))), four);
                v1 = vsubq_s8(s8(vorrq_u8(vandq_u8(q1, m3), vshlq_n_u8(vandq_u8(hm1, one), 2))), four);
                hm0 = vshrq_n_u8(hm0, 1);
                hm1 = vshrq_n_u8(hm1, 1);
            }
            sumi = add_group16(sumi, v0, q8 + 32 * j, sg[2 * j]);
            sumi = add_group16(sumi, v1, q8 + 32 * j + 16, sg[2 * j + 1]);
            q0 = vshrq_n_u8(q0, 2);
            q1 = vshrq_n_u8(q1, 2);
        }
    }
    return sumi;
}

// Q2_K: 2-bit q, 16 groups of 16 with a 4-bit scale (low nibble) and a 4-bit min (high nibble).
__attribute__((always_inline)) inline float dot_q2_K(const block_q2_K& a, const block_q8_K& b) {
    const float d = b.d * h2f(a.d);
    const float dmin = b.d * h2f(a.dmin);
    const uint8x16_t sc8 = vld1q_u8(a.scales);
    // min term: sum over the 16 groups of min_g * bsums_g
    const int16x8_t mn0 = vreinterpretq_s16_u16(vmovl_u8(vshr_n_u8(vget_low_u8(sc8), 4)));
    const int16x8_t mn1 = vreinterpretq_s16_u16(vmovl_high_u8(vshrq_n_u8(sc8, 4)));
    const int16x8_t bs0 = vld1q_s16(b.bsums), bs1 = vld1q_s16(b.bsums + 8);
    int32x4_t pm = vmull_s16(vget_low_s16(mn0), vget_low_s16(bs0));
    pm = vmlal_high_s16(pm, mn0, bs0);
    pm = vmlal_s16(pm, vget_low_s16(mn1), vget_low_s16(bs1));
    pm = vmlal_high_s16(pm, mn1, bs1);
    uint8_t scl[16];
    vst1q_u8(scl, vandq_u8(sc8, vdupq_n_u8(0x0F)));
    const int32x4_t sumi = sum_2bit_groups<false>(a.qs, nullptr, scl, b.qs);
    return d * (float)vaddvq_s32(sumi) - dmin * (float)vaddvq_s32(pm);
}

// Q3_K: value = (2 low bits | high bit << 2) - 4, 16 six-bit scales (minus 32). Codes are made
// signed (-4..3) before the dot.
__attribute__((always_inline)) inline float dot_q3_K(const block_q3_K& a, const block_q8_K& b) {
    const float d = b.d * h2f(a.d);
    uint32_t aux[4];  // the 16 six-bit scales, biased by 32
    quant::q3_K_scale_bytes(a.scales, aux);
    int8_t sc[16];
    vst1q_s8(sc, vsubq_s8(vreinterpretq_s8_u32(vld1q_u32(aux)), vdupq_n_s8(32)));
    return d * (float)vaddvq_s32(sum_2bit_groups<true>(a.qs, a.hmask, sc, b.qs));
}

// ---- activation conversion (bit-identical to the scalar reference) ---------------------------
// One 32-block of activations as the scalar activation_row_q8_0: d = amax/127, q = x * (127/amax)
// rounded to nearest even (vcvtnq, like nearbyint). Returns d; *qsum = sum of the codes.
inline float quantize_block_q8(const float* x, int8_t* qs, int* qsum) {
    float32x4_t v[8];
    float32x4_t mx = vdupq_n_f32(0);
    for (int k = 0; k < 8; k++) {
        v[k] = vld1q_f32(x + 4 * k);
        mx = vmaxq_f32(mx, vabsq_f32(v[k]));
    }
    const float amax = vmaxvq_f32(mx);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32x4_t sum = vdupq_n_s32(0);
    for (int k = 0; k < 8; k += 2) {
        const int32x4_t i0 = vcvtnq_s32_f32(vmulq_n_f32(v[k], id));
        const int32x4_t i1 = vcvtnq_s32_f32(vmulq_n_f32(v[k + 1], id));
        sum = vaddq_s32(sum, vaddq_s32(i0, i1));
        vst1_s8(qs + 4 * k, vqmovn_s16(vcombine_s16(vqmovn_s32(i0), vqmovn_s32(i1))));
    }
    if (qsum) *qsum = vaddvq_s32(sum);
    return d;
}

void from_float_q8_0(const float* x, void* y, int64_t n) {
    block_q8_0* out = (block_q8_0*)y;
    for (int64_t i = 0; i < n / 32; i++) out[i].d = fp32_to_fp16(quantize_block_q8(x + 32 * i, out[i].qs, nullptr));
}

void from_float_q8_1(const float* x, void* y, int64_t n) {
    block_q8_1* out = (block_q8_1*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        int qsum;
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, &qsum);
        out[i].d = fp32_to_fp16(d);
        out[i].s = fp32_to_fp16(d * (float)qsum);
    }
}

// Q8_K: scale from the first element of largest magnitude (keeping its sign); q = x * iscale
// rounded to nearest even (vrndnq), clamped to 127.
void from_float_q8_K(const float* x, void* y, int64_t n) {
    block_q8_K* out = (block_q8_K*)y;
    for (int64_t i = 0; i < n / OPTIML_QK_K; i++) {
        const float* xb = x + OPTIML_QK_K * i;
        float32x4_t mx = vdupq_n_f32(0);
        for (int k = 0; k < OPTIML_QK_K; k += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + k)));
        const float amax = vmaxvq_f32(mx);
        if (amax == 0.0f) {
            std::memset(&out[i], 0, sizeof(block_q8_K));
            continue;
        }
        float max = 0;
        for (int k = 0; k < OPTIML_QK_K; k++)
            if (std::fabs(xb[k]) == amax) {
                max = xb[k];
                break;
            }
        const float iscale = -127.f / max;
        const int32x4_t lim = vdupq_n_s32(127);
        for (int k = 0; k < OPTIML_QK_K; k += 16) {
            int32x4_t q[4];
            for (int t = 0; t < 4; t++)
                q[t] = vminq_s32(vcvtq_s32_f32(vrndnq_f32(vmulq_n_f32(vld1q_f32(xb + k + 4 * t), iscale))), lim);
            const int16x8_t a16 = vcombine_s16(vqmovn_s32(q[0]), vqmovn_s32(q[1]));
            const int16x8_t b16 = vcombine_s16(vqmovn_s32(q[2]), vqmovn_s32(q[3]));
            vst1q_s8(out[i].qs + k, vcombine_s8(vqmovn_s16(a16), vqmovn_s16(b16)));
            out[i].bsums[k / 16] = (int16_t)vaddvq_s16(vaddq_s16(a16, b16));
        }
        out[i].d = 1 / iscale;
    }
}

// Round to nearest even by the hardware conversion (FPCR default mode), like fp32_to_fp16.
void from_float_f16(const float* x, void* y, int64_t n) {
    fp16_t* out = (fp16_t*)y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const float16x8_t h = vcombine_f16(vcvt_f16_f32(vld1q_f32(x + i)), vcvt_f16_f32(vld1q_f32(x + i + 4)));
        vst1q_u16(out + i, vreinterpretq_u16_f16(h));
    }
    for (; i < n; i++) out[i] = fp32_to_fp16(x[i]);
}

// The scalar fp32_to_bf16 in integer lanes: round to nearest even, NaN stays NaN (quiet bit set).
inline uint16x4_t bf16x4(float32x4_t v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t isnan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    const uint32x4_t hi = vshrq_n_u32(u, 16);
    const uint32x4_t odd = vandq_u32(hi, vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), odd)), 16);
    return vmovn_u32(vbslq_u32(isnan, vorrq_u32(hi, vdupq_n_u32(64)), r));
}

void from_float_bf16(const float* x, void* y, int64_t n) {
    bf16_t* out = (bf16_t*)y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vst1q_u16(out + i, vcombine_u16(bf16x4(vld1q_f32(x + i)), bf16x4(vld1q_f32(x + i + 4))));
    for (; i < n; i++) out[i] = fp32_to_bf16(x[i]);
}

// Registers this build's kernels in a table.
inline void fill_neon_table(KernelTable& t) {
    t.vec_dot[TYPE_F32] = vec_dot_float<F32>;
    t.vec_dot[TYPE_F16] = vec_dot_float<F16>;
    t.vec_dot[TYPE_BF16] = vec_dot_float<BF16>;

    t.vec_dot[TYPE_Q8_0] = vec_dot_32<block_q8_0, block_q8_0>;
    t.vec_dot[TYPE_Q4_0] = vec_dot_32<block_q4_0, block_q8_0>;
    t.vec_dot[TYPE_Q4_1] = vec_dot_32<block_q4_1, block_q8_1>;
    t.vec_dot[TYPE_Q5_0] = vec_dot_32<block_q5_0, block_q8_0>;
    t.vec_dot[TYPE_Q5_1] = vec_dot_32<block_q5_1, block_q8_1>;
    t.vec_dot[TYPE_MXFP4] = vec_dot_32<block_mxfp4, block_q8_0>;
    t.vec_dot[TYPE_IQ4_NL] = vec_dot_32<block_iq4_nl, block_q8_0>;
    t.vec_dot4[TYPE_Q8_0] = vec_dot4_32<block_q8_0, block_q8_0>;
    t.vec_dot4[TYPE_Q4_0] = vec_dot4_32<block_q4_0, block_q8_0>;
    t.vec_dot4[TYPE_Q4_1] = vec_dot4_32<block_q4_1, block_q8_1>;
    t.vec_dot4[TYPE_Q5_0] = vec_dot4_32<block_q5_0, block_q8_0>;
    t.vec_dot4[TYPE_Q5_1] = vec_dot4_32<block_q5_1, block_q8_1>;
    t.vec_dot4[TYPE_MXFP4] = vec_dot4_32<block_mxfp4, block_q8_0>;
    t.vec_dot4[TYPE_IQ4_NL] = vec_dot4_32<block_iq4_nl, block_q8_0>;
    t.vec_dot_rows[TYPE_Q8_0] = vec_dot_rows_32<block_q8_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q4_0] = vec_dot_rows_32<block_q4_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q4_1] = vec_dot_rows_32<block_q4_1, block_q8_1>;
    t.vec_dot_rows[TYPE_Q5_0] = vec_dot_rows_32<block_q5_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q5_1] = vec_dot_rows_32<block_q5_1, block_q8_1>;
    t.vec_dot_rows[TYPE_MXFP4] = vec_dot_rows_32<block_mxfp4, block_q8_0>;
    t.vec_dot_rows[TYPE_IQ4_NL] = vec_dot_rows_32<block_iq4_nl, block_q8_0>;

    t.vec_dot[TYPE_Q2_K] = vec_dot_K<block_q2_K, dot_q2_K>;
    t.vec_dot[TYPE_Q3_K] = vec_dot_K<block_q3_K, dot_q3_K>;
    t.vec_dot[TYPE_Q4_K] = vec_dot_K<block_q4_K, dot_q4_K>;
    t.vec_dot[TYPE_Q5_K] = vec_dot_K<block_q5_K, dot_q5_K>;
    t.vec_dot[TYPE_Q6_K] = vec_dot_K<block_q6_K, dot_q6_K>;
    t.vec_dot[TYPE_IQ4_XS] = vec_dot_K<block_iq4_xs, dot_iq4_xs>;

    t.from_float[TYPE_Q8_0] = from_float_q8_0;
    t.from_float[TYPE_Q8_1] = from_float_q8_1;
    t.from_float[TYPE_Q8_K] = from_float_q8_K;
    t.from_float[TYPE_F16] = from_float_f16;
    t.from_float[TYPE_BF16] = from_float_bf16;
}

}  // namespace
}  // namespace optiml
