// The CUDA entry points of a CPU-only build.
#include "optiml/cuda.h"

#include "optiml/backend.h"
#include "optiml/common.h"

#if !defined(OPTIML_CUDA)
namespace optiml {

bool cuda_compiled() { return false; }

std::vector<CudaDevice> cuda_devices(std::string* why_none) {
    if (why_none) *why_none = "this build has no CUDA backend (nvcc was not found when it was built)";
    return {};
}

bool cuda_reads_type(int32_t) { return false; }

std::unique_ptr<Backend> make_cuda_backend(int index) {
    throw ArgumentError(format("cuda:%d: this build has no CUDA backend (nvcc was not found when it was built)", index));
}

}  // namespace optiml
#endif
