// aarch64 NEON kernels for the baseline architecture (armv8-a, widening-multiply int8 dots), and
// the choice, at run time, of the dot-product build (kernels_dotprod_neon.cpp) on CPUs that have it.
// The bodies are in kernels_neon.h.
#include "kernels_neon.h"

#include "optiml/cpu_features.h"

namespace optiml {

void fill_kernels_neon(KernelTable& t) {
#if !defined(__ARM_FEATURE_DOTPROD)
    if (cpu_features().neon_dotprod) {
        fill_kernels_neon_dotprod(t);
        return;
    }
#endif
    fill_neon_table(t);  // (a whole build targeting dotprod already has vdotq here)
}

}  // namespace optiml
