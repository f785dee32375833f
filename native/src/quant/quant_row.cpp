// dequantize_row / quantize_row: dispatch by type id to the per-format scalar code.
#include "optiml/common.h"
#include "optiml/quant.h"
#include "quant_impl.h"

namespace optiml {

namespace {

typedef void (*to_float_fn)(const void* x, float* y, int64_t n);
typedef void (*quantize_fn)(const float* x, void* y, int64_t n);

to_float_fn to_float_for(int32_t type) {
    using namespace quant;
    switch (type) {
        case TYPE_F32: return dequantize_row_f32;
        case TYPE_F16: return dequantize_row_f16;
        case TYPE_BF16: return dequantize_row_bf16;
        case TYPE_Q4_0: return dequantize_row_q4_0;
        case TYPE_Q4_1: return dequantize_row_q4_1;
        case TYPE_Q5_0: return dequantize_row_q5_0;
        case TYPE_Q5_1: return dequantize_row_q5_1;
        case TYPE_Q8_0: return dequantize_row_q8_0;
        case TYPE_Q8_1: return dequantize_row_q8_1;
        case TYPE_MXFP4: return dequantize_row_mxfp4;
        case TYPE_IQ4_NL: return dequantize_row_iq4_nl;
        case TYPE_IQ4_XS: return dequantize_row_iq4_xs;
        case TYPE_Q2_K: return dequantize_row_q2_K;
        case TYPE_Q3_K: return dequantize_row_q3_K;
        case TYPE_Q4_K: return dequantize_row_q4_K;
        case TYPE_Q5_K: return dequantize_row_q5_K;
        case TYPE_Q6_K: return dequantize_row_q6_K;
        case TYPE_Q8_K: return dequantize_row_q8_K;
        default: return nullptr;
    }
}

quantize_fn quantize_for(int32_t type) {
    using namespace quant;
    switch (type) {
        case TYPE_F32: return copy_row_f32;
        case TYPE_F16: return quantize_row_f16;
        case TYPE_BF16: return quantize_row_bf16;
        case TYPE_Q4_0: return quantize_row_q4_0;
        case TYPE_Q4_1: return quantize_row_q4_1;
        case TYPE_Q5_0: return quantize_row_q5_0;
        case TYPE_Q5_1: return quantize_row_q5_1;
        case TYPE_Q8_0: return quantize_row_q8_0;
        case TYPE_Q8_1: return quantize_row_q8_1;
        case TYPE_MXFP4: return quantize_row_mxfp4;
        case TYPE_IQ4_NL: return quantize_row_iq4_nl;
        case TYPE_IQ4_XS: return quantize_row_iq4_xs;
        case TYPE_Q2_K: return quantize_row_q2_K;
        case TYPE_Q3_K: return quantize_row_q3_K;
        case TYPE_Q4_K: return quantize_row_q4_K;
        case TYPE_Q5_K: return quantize_row_q5_K;
        case TYPE_Q6_K: return quantize_row_q6_K;
        case TYPE_Q8_K: return quantize_row_q8_K;
        default: return nullptr;
    }
}

void check_row(int32_t type, int64_t n, const char* what) {
    const TypeTraits& t = type_traits(type);
    if (!t.name) throw ArgumentError(format("unknown tensor type id %d", type));
    if (n < 0 || n % t.block_size != 0)
        throw ArgumentError(format("cannot %s %lld elements of %s: not a multiple of its block size %lld", what,
                                   (long long)n, t.name, (long long)t.block_size));
}

}  // namespace

bool can_dequantize(int32_t type) { return to_float_for(type) != nullptr; }
bool can_quantize(int32_t type) { return quantize_for(type) != nullptr; }

void dequantize_row(int32_t type, const void* src, float* dst, int64_t n) {
    check_row(type, n, "dequantize");
    to_float_fn f = to_float_for(type);
    if (!f) throw ArgumentError(format("dequantizing %s is not supported", type_traits(type).name));
    f(src, dst, n);
}

void quantize_row(int32_t type, const float* src, void* dst, int64_t n) {
    check_row(type, n, "quantize");
    quantize_fn f = quantize_for(type);
    if (!f) throw ArgumentError(format("quantizing to %s is not supported", type_traits(type).name));
    f(src, dst, n);
}

}  // namespace optiml
