// AVX2 + FMA + F16C kernels: every weight type's dot product and the activation conversions.
// The bodies live in simd_common.h (shared with the AVX-512 build, which swaps in vpdpbusd).
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {

void fill_kernels_avx2(KernelTable& t) {
    t.vec_dot[TYPE_F32] = vec_dot_f32;
    t.vec_dot[TYPE_F16] = vec_dot_f16;
    t.vec_dot[TYPE_BF16] = vec_dot_bf16;
    fill_dots_32(t);
    t.vec_dot[TYPE_Q2_K] = vec_dot_q2_K;
    t.vec_dot[TYPE_Q3_K] = vec_dot_q3_K;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K;
    t.from_float[TYPE_Q8_0] = from_float_q8_0;
    t.from_float[TYPE_Q8_1] = from_float_q8_1;
    t.from_float[TYPE_Q8_K] = from_float_q8_K;
    t.from_float[TYPE_F16] = from_float_f16;
    t.from_float[TYPE_BF16] = from_float_bf16;
}

}  // namespace optiml
