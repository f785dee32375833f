// AVX2 + FMA + F16C: every weight type's kernels and the activation conversions (simd_common.h).
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {

void fill_kernels_avx2(KernelTable& t) {
    fill_quant_kernels(t);
    fill_float_kernels<F32x8, 3, 3>(t);
    fill_convert_kernels(t);
}

}  // namespace optiml
