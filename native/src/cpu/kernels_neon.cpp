// PLACEHOLDER until the SIMD helper lands.
#include "optiml/kernels.h"
namespace optiml {
void fill_kernels_neon(KernelTable& table) {}
}  // namespace optiml
