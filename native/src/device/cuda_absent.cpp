// The CUDA entry points of a CPU-only build.
#include "optiml/cuda.h"

#include "optiml/backend.h"
#include "optiml/common.h"

#if !defined(OPTIML_CUDA)
namespace optiml {

#if defined(OPTIML_CUDA_OFF_BY_CHOICE)
static const char* kNoCuda = "this build has no CUDA backend (it was built with OPTIML_CUDA=OFF, as the portable "
                             "CPU wheel is; build from source where nvcc is installed for one)";
#else
static const char* kNoCuda = "this build has no CUDA backend (nvcc was not found when it was built)";
#endif

bool cuda_compiled() { return false; }

std::vector<CudaDevice> cuda_devices(std::string* why_none) {
    if (why_none) *why_none = kNoCuda;
    return {};
}

bool cuda_reads_type(int32_t) { return false; }
void cuda_use_one_token_kernels(bool) {}
bool cuda_one_token_kernels() { return false; }

std::unique_ptr<Backend> make_cuda_backend(int index) { throw ArgumentError(format("cuda:%d: %s", index, kNoCuda)); }

CudaProductTiming cuda_time_product(int, int32_t, int64_t, int64_t, int32_t, const std::string&, int, int64_t) {
    throw ArgumentError(kNoCuda);
}
double cuda_copy_bandwidth(int, int64_t, int) { throw ArgumentError(kNoCuda); }

}  // namespace optiml
#endif
