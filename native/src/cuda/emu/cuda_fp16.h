// __half for the CUDA emulator (see cuda_runtime.h beside this file): the bits of an IEEE half, converted
// with the core's exact routines (round to nearest even, as __float2half_rn).
#pragma once

#include <cstdint>

#include "optiml/ggml_types.h"

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) { return optiml::fp16_to_fp32(h.bits); }
inline __half __float2half_rn(float f) { return __half{optiml::fp32_to_fp16(f)}; }
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
