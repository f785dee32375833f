// The CUDA entry points of a CPU-only build.
#include "optiml/cuda.h"

#if !defined(OPTIML_CUDA)
namespace optiml {

bool cuda_compiled() { return false; }

std::vector<CudaDevice> cuda_devices(std::string* why_none) {
    if (why_none) *why_none = "this build has no CUDA backend (nvcc was not found when it was built)";
    return {};
}

}  // namespace optiml
#endif
