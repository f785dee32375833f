// The NEON kernels of kernels_neon.h built with the dot-product extension (vdotq_s32):
// CMakeLists.txt compiles this file with -march=armv8.2-a+dotprod, and fill_kernels_neon uses this
// table when the CPU reports dotprod (cpu_features().neon_dotprod).
#if !defined(__ARM_FEATURE_DOTPROD)
#error "kernels_dotprod_neon.cpp needs the dot-product extension (-march=armv8.2-a+dotprod)"
#endif

#include "kernels_neon.h"

namespace optiml {

void fill_kernels_neon_dotprod(KernelTable& t) { fill_neon_table(t); }

}  // namespace optiml
