// AVX-512 F/BW/VL/DQ (every AVX-512 CPU from Skylake-X on): the float kernels of simd_float.h on
// 512-bit vectors. The quant kernels need nothing beyond AVX2 here; VNNI and BF16, which many AVX-512
// CPUs lack, have their own files (kernels_avx512vnni.cpp, kernels_avx512bf16.cpp) that the dispatcher
// adds one by one when the CPU has them.
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {

void fill_kernels_avx512(KernelTable& t) { fill_float_kernels<F32x16, 4, 4>(t); }

}  // namespace optiml
