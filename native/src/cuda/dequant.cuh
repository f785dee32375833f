// Block dequantization for the CUDA kernels: values j..j+7 of one ggml block, per type.
// Written once for both sides (__host__ __device__ under nvcc, plain inline C++ elsewhere) so that
// every build, GPU or not, compiles and tests the exact code the kernels run: the Python module's
// _cuda_dequant_host walks blocks with it and the tests compare against gguf-py and the CPU library.
//
// Results equal optiml::dequantize_row bit for bit: each value is the same float operations in the
// same order as native/src/quant/. Every scale * code product there is exact in float32 (an fp16
// mantissa of 11 bits times codes and sub-scales of at most 13 bits together) and no intermediate is
// subnormal in float32, so neither nvcc's FMA contraction nor flush-to-zero can change a result.
#pragma once

#include <cstdint>
#include <cstddef>
#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

#include "optiml/ggml_types.h"

#if defined(__CUDACC__)
#define OPTIML_HD __host__ __device__ __forceinline__
#else
#define OPTIML_HD inline
#endif

namespace optiml {
namespace cudaq {

// ---- bit-level helpers (blocks are only 2-byte aligned: read bytes, little-endian as ggml) ----

OPTIML_HD float u32_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

OPTIML_HD uint32_t float_as_u32(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
#endif
}

OPTIML_HD uint16_t load_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

OPTIML_HD uint32_t load_u32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// Exact fp16 -> fp32 with integer operations only, so the result does not depend on the device's
// float modes. Same values as optiml::fp16_to_fp32; a NaN keeps its payload and gets the quiet bit,
// as the float multiply inside fp16_to_fp32 gives it on x86 and ARM.
OPTIML_HD float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
    } else if (exp != 0) {
        bits = ((exp + 112) << 23) | (mant << 13);  // rebias 15 -> 127
    } else if (mant != 0) {
        // Subnormal: mant * 2^-24. (float)mant is exact (11 bits) and normal, so lowering its exponent
        // by 24 gives the value exactly.
        bits = float_as_u32((float)mant) - (24u << 23);
    } else {
        bits = 0;
    }
    return u32_as_float(sign | bits);
}

OPTIML_HD float bf16_to_float(uint16_t h) { return u32_as_float((uint32_t)h << 16); }

// ggml's kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}, as
// int8 bytes packed into two 64-bit constants: a lookup is a shift in registers on both sides, with
// no table in (host-only or __constant__) memory.
OPTIML_HD int iq4nl_value(int i) {
    const uint64_t lo = 0xF6EADDCFBFAD9881ull;  // entries 0..7, entry 0 in the low byte
    const uint64_t hi = 0x7159453526190D01ull;  // entries 8..15
    return (int8_t)(uint8_t)(((i < 8 ? lo : hi) >> (8 * (i & 7))) & 0xFF);
}

// MXFP4's doubled E2M1 values (kMxfp4Values), as iq4nl_value packs them: entries 0..7 then 8..15.
OPTIML_HD int mxfp4_value(int i) {
    const uint64_t lo = 0x0C08060403020100ull;
    const uint64_t hi = 0xF4F8FAFCFDFEFF00ull;
    return (int8_t)(uint8_t)(((i < 8 ? lo : hi) >> (8 * (i & 7))) & 0xFF);
}

// Half of an E8M0 scale (e8m0_to_fp32_half): 2^(e - 128), the denormals 2^-128 and 2^-127 for e < 2.
OPTIML_HD float e8m0_half(uint8_t e) { return u32_as_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

// 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (12 packed bytes), as get_scale_min_k4.
OPTIML_HD void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// Signed 6-bit scale s (0..15) of a Q3_K block, stored biased by 32, as q3_K_scales.
OPTIML_HD int q3_K_scale(int s, const uint8_t* p) {
    const int lo = s < 8 ? (p[s] & 0xF) : (p[s - 8] >> 4);
    const int hi = (p[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

// ---- per-type block decoders ----------------------------------------------------------------
// QType<T>::dequant8(blk, j, out) writes values j..j+7 of the block at blk (j % 8 == 0,
// 0 <= j < block_size). F32/F16/BF16 use 8-element "blocks" so kernels step all types in 8s.

template <int TYPE>
struct QType;

template <>
struct QType<TYPE_F32> {
    static constexpr int block_size = 8;
    static constexpr int block_bytes = 8 * 4;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        for (int i = 0; i < 8; i++) out[i] = u32_as_float(load_u32(blk + 4 * (j + i)));
    }
};

template <>
struct QType<TYPE_F16> {
    static constexpr int block_size = 8;
    static constexpr int block_bytes = 8 * 2;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        for (int i = 0; i < 8; i++) out[i] = half_to_float(load_u16(blk + 2 * (j + i)));
    }
};

template <>
struct QType<TYPE_BF16> {
    static constexpr int block_size = 8;
    static constexpr int block_bytes = 8 * 2;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        for (int i = 0; i < 8; i++) out[i] = bf16_to_float(load_u16(blk + 2 * (j + i)));
    }
};

// 32-element formats: value l < 16 is the low nibble of qs[l], value l + 16 the high nibble.

template <>
struct QType<TYPE_Q4_0> {
    static constexpr int block_size = OPTIML_QK4_0;
    static constexpr int block_bytes = (int)sizeof(block_q4_0);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q4_0, d)));
        const uint8_t* qs = blk + offsetof(block_q4_0, qs) + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) out[i] = (float)(((qs[i] >> shift) & 0x0F) - 8) * d;
    }
};

template <>
struct QType<TYPE_Q4_1> {
    static constexpr int block_size = OPTIML_QK4_1;
    static constexpr int block_bytes = (int)sizeof(block_q4_1);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q4_1, d)));
        const float m = half_to_float(load_u16(blk + offsetof(block_q4_1, m)));
        const uint8_t* qs = blk + offsetof(block_q4_1, qs) + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) out[i] = d * (float)((qs[i] >> shift) & 0x0F) + m;
    }
};

// Q5: bit 4 of value l is bit l of qh.
template <>
struct QType<TYPE_Q5_0> {
    static constexpr int block_size = OPTIML_QK5_0;
    static constexpr int block_bytes = (int)sizeof(block_q5_0);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q5_0, d)));
        const uint32_t qh = load_u32(blk + offsetof(block_q5_0, qh)) >> j;
        const uint8_t* qs = blk + offsetof(block_q5_0, qs) + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) {
            const int q = ((qs[i] >> shift) & 0x0F) | (int)(((qh >> i) & 1) << 4);
            out[i] = (float)(q - 16) * d;
        }
    }
};

template <>
struct QType<TYPE_Q5_1> {
    static constexpr int block_size = OPTIML_QK5_1;
    static constexpr int block_bytes = (int)sizeof(block_q5_1);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q5_1, d)));
        const float m = half_to_float(load_u16(blk + offsetof(block_q5_1, m)));
        const uint32_t qh = load_u32(blk + offsetof(block_q5_1, qh)) >> j;
        const uint8_t* qs = blk + offsetof(block_q5_1, qs) + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) {
            const int q = ((qs[i] >> shift) & 0x0F) | (int)(((qh >> i) & 1) << 4);
            out[i] = d * (float)q + m;
        }
    }
};

template <>
struct QType<TYPE_Q8_0> {
    static constexpr int block_size = OPTIML_QK8_0;
    static constexpr int block_bytes = (int)sizeof(block_q8_0);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q8_0, d)));
        const uint8_t* qs = blk + offsetof(block_q8_0, qs) + j;
        for (int i = 0; i < 8; i++) out[i] = (float)(int8_t)qs[i] * d;
    }
};

// 256-element k-quants. Sub-blocks are 16 or 32 values, so one group of 8 has one sub-scale.
// 2-bit codes (Q2_K, Q3_K): value e lives in 128-half e/128 at byte (e%128)%32, bits 2*((e%128)/32).

template <>
struct QType<TYPE_Q2_K> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = (int)sizeof(block_q2_K);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q2_K, d)));
        const float dmin = half_to_float(load_u16(blk + offsetof(block_q2_K, dmin)));
        const int sc = blk[offsetof(block_q2_K, scales) + j / 16];
        const float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
        const int p = j % 128;
        const uint8_t* qs = blk + offsetof(block_q2_K, qs) + (j / 128) * 32 + p % 32;
        const int shift = 2 * (p / 32);
        for (int i = 0; i < 8; i++) out[i] = dl * (float)((qs[i] >> shift) & 3) - ml;
    }
};

// Bit 2 of value e is bit e/32 of hmask[e%32]; a clear bit means the code is lowered by 4.
template <>
struct QType<TYPE_Q3_K> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = (int)sizeof(block_q3_K);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q3_K, d)));
        const float dl = d * (float)q3_K_scale(j / 16, blk + offsetof(block_q3_K, scales));
        const int p = j % 128;
        const uint8_t* qs = blk + offsetof(block_q3_K, qs) + (j / 128) * 32 + p % 32;
        const int shift = 2 * (p / 32);
        const uint8_t* hm = blk + offsetof(block_q3_K, hmask) + j % 32;
        const int hbit = j / 32;
        for (int i = 0; i < 8; i++) {
            const int lo = (qs[i] >> shift) & 3;
            const int hi = (hm[i] >> hbit) & 1;
            out[i] = dl * (float)(lo - (hi ? 0 : 4));
        }
    }
};

// Q4_K/Q5_K: 8 sub-blocks of 32; sub-blocks 2k and 2k+1 are the low and high nibbles of qs[32k..32k+31].
template <>
struct QType<TYPE_Q4_K> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = (int)sizeof(block_q4_K);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q4_K, d)));
        const float dmin = half_to_float(load_u16(blk + offsetof(block_q4_K, dmin)));
        const int sb = j / 32;
        int sc, m;
        scale_min_k4(sb, blk + offsetof(block_q4_K, scales), &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t* qs = blk + offsetof(block_q4_K, qs) + (sb / 2) * 32 + j % 32;
        const int shift = (sb & 1) * 4;
        for (int i = 0; i < 8; i++) out[i] = d1 * (float)((qs[i] >> shift) & 0xF) - m1;
    }
};

// Bit 4 of value e is bit e/32 of qh[e%32].
template <>
struct QType<TYPE_Q5_K> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = (int)sizeof(block_q5_K);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q5_K, d)));
        const float dmin = half_to_float(load_u16(blk + offsetof(block_q5_K, dmin)));
        const int sb = j / 32;
        int sc, m;
        scale_min_k4(sb, blk + offsetof(block_q5_K, scales), &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        const uint8_t* ql = blk + offsetof(block_q5_K, qs) + (sb / 2) * 32 + j % 32;
        const uint8_t* qh = blk + offsetof(block_q5_K, qh) + j % 32;
        const int shift = (sb & 1) * 4;
        for (int i = 0; i < 8; i++) {
            const int q = ((ql[i] >> shift) & 0xF) + (((qh[i] >> sb) & 1) << 4);
            out[i] = d1 * (float)q - m1;
        }
    }
};

// Q6_K: per 128-half, quarter k (32 values) takes nibble k/2 of ql[32*(k&1) + l] and bits 2k of qh[l].
template <>
struct QType<TYPE_Q6_K> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = (int)sizeof(block_q6_K);
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk + offsetof(block_q6_K, d)));
        const float dl = d * (float)(int8_t)blk[offsetof(block_q6_K, scales) + j / 16];
        const int h = j / 128, k = (j % 128) / 32, l = j % 32;
        const uint8_t* ql = blk + offsetof(block_q6_K, ql) + h * 64 + (k & 1) * 32 + l;
        const uint8_t* qh = blk + offsetof(block_q6_K, qh) + h * 32 + l;
        const int lshift = (k >> 1) * 4, hshift = 2 * k;
        for (int i = 0; i < 8; i++) {
            const int q = (((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4)) - 32;
            out[i] = dl * (float)q;
        }
    }
};

// IQ4_NL/IQ4_XS (block_iq4_nl, block_iq4_xs in ggml_types.h; read here from raw bytes as the other types):
//   block_iq4_nl { fp16 d; uint8 qs[16]; }                                          18 bytes
//   block_iq4_xs { fp16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]; }    136 bytes
// Codes index kvalues_iq4nl; nibbles are laid out as in Q4_0, per 32-value sub-block for IQ4_XS.
template <>
struct QType<TYPE_IQ4_NL> {
    static constexpr int block_size = 32;
    static constexpr int block_bytes = 18;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk));
        const uint8_t* qs = blk + 2 + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) out[i] = d * (float)iq4nl_value((qs[i] >> shift) & 0xF);
    }
};

//   block_mxfp4 { uint8 e; uint8 qs[16]; }   17 bytes: codes index the doubled E2M1 table, nibbles as Q4_0's
template <>
struct QType<TYPE_MXFP4> {
    static constexpr int block_size = 32;
    static constexpr int block_bytes = 17;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = e8m0_half(blk[0]);
        const uint8_t* qs = blk + 1 + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        for (int i = 0; i < 8; i++) out[i] = d * (float)mxfp4_value((qs[i] >> shift) & 0xF);
    }
};

// Sub-block ib has a 6-bit scale (stored biased by 32): low 4 bits in scales_l, high 2 in scales_h.
template <>
struct QType<TYPE_IQ4_XS> {
    static constexpr int block_size = OPTIML_QK_K;
    static constexpr int block_bytes = 136;
    OPTIML_HD static void dequant8(const uint8_t* blk, int j, float* out) {
        const float d = half_to_float(load_u16(blk));
        const int ib = j / 32;
        const int scales_h = load_u16(blk + 2);
        const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const uint8_t* qs = blk + 8 + ib * 16 + (j & 15);
        const int shift = (j & 16) ? 4 : 0;
        for (int i = 0; i < 8; i++) out[i] = dl * (float)iq4nl_value((qs[i] >> shift) & 0xF);
    }
};

// ---- runtime dispatch -------------------------------------------------------------------------

// X(TYPE_xxx) for every type above: host code switches over a type id to launch one kernel
// template instance per type, e.g.
//   #define CASE(T) case T: my_kernel<T><<<g, b>>>(...); break;
//   switch (type) { OPTIML_CUDA_FOR_EACH_TYPE(CASE) default: ... }
#define OPTIML_CUDA_FOR_EACH_TYPE(X) \
    X(TYPE_F32)                      \
    X(TYPE_F16)                      \
    X(TYPE_BF16)                     \
    X(TYPE_Q4_0)                     \
    X(TYPE_Q4_1)                     \
    X(TYPE_Q5_0)                     \
    X(TYPE_Q5_1)                     \
    X(TYPE_Q8_0)                     \
    X(TYPE_Q2_K)                     \
    X(TYPE_Q3_K)                     \
    X(TYPE_Q4_K)                     \
    X(TYPE_Q5_K)                     \
    X(TYPE_Q6_K)                     \
    X(TYPE_IQ4_NL)                   \
    X(TYPE_IQ4_XS)                   \
    X(TYPE_MXFP4)

// Elements per block (8 for F32/F16/BF16); 0 for a type without a decoder here.
OPTIML_HD int block_size_of(int32_t type) {
    switch (type) {
#define OPTIML_CUDAQ_CASE(T) \
    case T: return QType<T>::block_size;
        OPTIML_CUDA_FOR_EACH_TYPE(OPTIML_CUDAQ_CASE)
#undef OPTIML_CUDAQ_CASE
        default: return 0;
    }
}

// Bytes per block; 0 for a type without a decoder here.
OPTIML_HD int block_bytes_of(int32_t type) {
    switch (type) {
#define OPTIML_CUDAQ_CASE(T) \
    case T: return QType<T>::block_bytes;
        OPTIML_CUDA_FOR_EACH_TYPE(OPTIML_CUDAQ_CASE)
#undef OPTIML_CUDAQ_CASE
        default: return 0;
    }
}

// QType<type>::dequant8 chosen at run time; false (out untouched) for a type without a decoder.
OPTIML_HD bool dequant8_any(int32_t type, const uint8_t* blk, int j, float* out) {
    switch (type) {
#define OPTIML_CUDAQ_CASE(T)              \
    case T:                               \
        QType<T>::dequant8(blk, j, out);  \
        return true;
        OPTIML_CUDA_FOR_EACH_TYPE(OPTIML_CUDAQ_CASE)
#undef OPTIML_CUDAQ_CASE
        default: return false;
    }
}

}  // namespace cudaq
}  // namespace optiml
