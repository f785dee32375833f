// AVX-VNNI (the 256-bit VEX form of vpdpbusd/vpdpwssd, e.g. Intel cores from Alder Lake on, which
// have no AVX-512): the AVX2 quant kernels with the VNNI integer primitives (simd_x86.h). They form
// the same integer lanes, so they give the AVX2 kernels' bits.
#include "optiml/kernels.h"

#include "simd_common.h"

namespace optiml {

void fill_kernels_avxvnni(KernelTable& t) { fill_quant_kernels(t); }

}  // namespace optiml
