// Tensor element types and quantized block layouts, byte-for-byte as ggml/llama.cpp store them in GGUF
// files. This header is the one place these layouts are written down.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace optiml {

// Numbering is ggml's (it is what GGUF tensor infos store). Gaps are types ggml removed.
enum GGMLType : int32_t {
    TYPE_F32 = 0,
    TYPE_F16 = 1,
    TYPE_Q4_0 = 2,
    TYPE_Q4_1 = 3,
    TYPE_Q5_0 = 6,
    TYPE_Q5_1 = 7,
    TYPE_Q8_0 = 8,
    TYPE_Q8_1 = 9,
    TYPE_Q2_K = 10,
    TYPE_Q3_K = 11,
    TYPE_Q4_K = 12,
    TYPE_Q5_K = 13,
    TYPE_Q6_K = 14,
    TYPE_Q8_K = 15,
    TYPE_IQ2_XXS = 16,
    TYPE_IQ2_XS = 17,
    TYPE_IQ3_XXS = 18,
    TYPE_IQ1_S = 19,
    TYPE_IQ4_NL = 20,
    TYPE_IQ3_S = 21,
    TYPE_IQ2_S = 22,
    TYPE_IQ4_XS = 23,
    TYPE_I8 = 24,
    TYPE_I16 = 25,
    TYPE_I32 = 26,
    TYPE_I64 = 27,
    TYPE_F64 = 28,
    TYPE_IQ1_M = 29,
    TYPE_BF16 = 30,
    TYPE_TQ1_0 = 34,
    TYPE_TQ2_0 = 35,
    TYPE_MXFP4 = 39,
    TYPE_COUNT = 40,
};

struct TypeTraits {
    const char* name;       // ggml's name, e.g. "Q4_K"; nullptr for unknown type ids
    int64_t block_size;     // elements per block (1 for plain types)
    size_t type_size;       // bytes per block
    bool quantized;
    GGMLType vec_dot_type;  // what activations are converted to before a dot product with this type
};

// Traits of a type id; .name == nullptr when the id is not a ggml type.
const TypeTraits& type_traits(int32_t type);
bool type_is_known(int32_t type);
// Bytes of a row of n elements; n must be a multiple of the block size (checked by the callers).
inline size_t row_size(int32_t type, int64_t n) {
    const TypeTraits& t = type_traits(type);
    return (size_t)(n / t.block_size) * t.type_size;
}
// Looks a type up by ggml name ("q4_k" or "Q4_K"); returns -1 when unknown.
int32_t type_from_name(const char* name);

// ---- scalar half/bfloat16 conversion (exact, no rounding surprises) --------------------------
typedef uint16_t fp16_t;
typedef uint16_t bf16_t;

inline float fp32_from_bits(uint32_t w) { float f; std::memcpy(&f, &w, 4); return f; }
inline uint32_t fp32_to_bits(float f) { uint32_t w; std::memcpy(&w, &f, 4); return w; }

inline float fp16_to_fp32(fp16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = fp32_from_bits(0x7800000u);
    const float normalized = fp32_from_bits((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = fp32_from_bits((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = 1u << 27;
    const uint32_t result = sign | (two_w < denormalized_cutoff ? fp32_to_bits(denormalized)
                                                                : fp32_to_bits(normalized));
    return fp32_from_bits(result);
}

// Round-to-nearest-even, as numpy's astype(float16) and F16C do.
inline fp16_t fp32_to_fp16(float f) {
    const float scale_to_inf = fp32_from_bits(0x77800000u);
    const float scale_to_zero = fp32_from_bits(0x08800000u);
    float base = ((f < 0 ? -f : f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = fp32_to_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = fp32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = fp32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (fp16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

inline float bf16_to_fp32(bf16_t h) { return fp32_from_bits((uint32_t)h << 16); }

// Half of the E8M0 scale e (2^(e - 127) / 2 = 2^(e - 128)), as ggml's GGML_E8M0_TO_FP32_HALF: the MXFP4
// table below stores the E2M1 values doubled. e = 0 and 1 give the denormals 2^-128 and 2^-127; e = 255
// gives 2^127 (ggml does not treat it as NaN, nor does this).
inline float e8m0_to_fp32_half(uint8_t e) {
    return fp32_from_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

// Round-to-nearest-even; NaN stays NaN (as ggml and gguf-py do).
inline bf16_t fp32_to_bf16(float f) {
    uint32_t u = fp32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 64);
    return (bf16_t)((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

// ---- block layouts ---------------------------------------------------------------------------
#define OPTIML_QK4_0 32
#define OPTIML_QK4_1 32
#define OPTIML_QK5_0 32
#define OPTIML_QK5_1 32
#define OPTIML_QK8_0 32
#define OPTIML_QK8_1 32
#define OPTIML_QK_MXFP4 32
#define OPTIML_QK_K 256
#define OPTIML_K_SCALE_SIZE 12

struct block_q4_0 { fp16_t d; uint8_t qs[16]; };
struct block_q4_1 { fp16_t d; fp16_t m; uint8_t qs[16]; };
struct block_q5_0 { fp16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct block_q5_1 { fp16_t d; fp16_t m; uint8_t qh[4]; uint8_t qs[16]; };
struct block_q8_0 { fp16_t d; int8_t qs[32]; };
// MXFP4 (OCP microscaling FP4): an E8M0 scale e and 32 E2M1 codes, element j (j < 16) in the low nibble
// of qs[j], element j + 16 in the high one; value = kMxfp4Values[code] * e8m0_to_fp32_half(e).
struct block_mxfp4 { uint8_t e; uint8_t qs[16]; };
// The E2M1 values doubled (ggml's kvalues_mxfp4): codes 8..15 are the negatives of 0..7 (8 is -0).
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// IQ4_NL: 32 codes indexing the non-linear table kIq4nlValues, nibbles laid out as Q4_0's (element j in the
// low nibble of qs[j], j + 16 in the high one); value = kIq4nlValues[code] * d.
struct block_iq4_nl { fp16_t d; uint8_t qs[16]; };
// ggml's kvalues_iq4nl: the 16 levels, denser near zero where weights are.
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// Activation format paired with Q4_1/Q5_1: s = d * sum(qs).
struct block_q8_1 { fp16_t d; fp16_t s; int8_t qs[32]; };

struct block_q2_K { uint8_t scales[16]; uint8_t qs[64]; fp16_t d; fp16_t dmin; };
struct block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; fp16_t d; };
struct block_q4_K { fp16_t d; fp16_t dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct block_q5_K { fp16_t d; fp16_t dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; fp16_t d; };
// IQ4_XS: 256 values as 8 sub-blocks of 32 with IQ4_NL's codes and table, each sub-block ib scaled by
// d * (ls - 32), ls six bits: the low four in scales_l[ib / 2] (nibble ib % 2), the high two bits 2ib, 2ib+1
// of scales_h; sub-block ib's codes are qs[16 ib .. 16 ib + 15], nibbles as IQ4_NL's.
struct block_iq4_xs { fp16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };
inline int iq4_xs_scale(const block_iq4_xs& b, int ib) {
    return (((b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((b.scales_h >> (2 * ib)) & 3) << 4)) - 32;
}
// Activation format paired with the k-quants: bsums[j] = sum of qs[16j .. 16j+15].
struct block_q8_K { float d; int8_t qs[256]; int16_t bsums[16]; };

static_assert(sizeof(block_q4_0) == 18, "block_q4_0 layout");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 layout");
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 layout");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 layout");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 layout");
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 layout");
static_assert(sizeof(block_mxfp4) == 17, "block_mxfp4 layout");
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl layout");
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs layout");
static_assert(sizeof(block_q2_K) == 84, "block_q2_K layout");
static_assert(sizeof(block_q3_K) == 110, "block_q3_K layout");
static_assert(sizeof(block_q4_K) == 144, "block_q4_K layout");
static_assert(sizeof(block_q5_K) == 176, "block_q5_K layout");
static_assert(sizeof(block_q6_K) == 210, "block_q6_K layout");
static_assert(sizeof(block_q8_K) == 292, "block_q8_K layout");

}  // namespace optiml
