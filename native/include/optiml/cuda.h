// The CUDA backend as the rest of the core sees it. Everything here works in a CPU-only build and on
// machines with no NVIDIA driver: it then reports no devices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace optiml {

class Backend;

struct CudaDevice {
    int id;
    std::string name;
    size_t total_memory;
    size_t free_memory;
    int compute_major, compute_minor;
    int multiprocessors;
};

// Was the CUDA backend compiled into this build?
bool cuda_compiled();
// Devices usable now; empty with no driver or no GPU. `why_none` (optional) says why it is empty.
std::vector<CudaDevice> cuda_devices(std::string* why_none = nullptr);
// The backend of CUDA device `index` (native/src/cuda/backend_cuda.cu); ArgumentError when there is no
// such device or the build has no CUDA backend.
std::unique_ptr<Backend> make_cuda_backend(int index);
// Whether the CUDA backend's products read weights of `type` (false in a CPU-only build).
bool cuda_reads_type(int32_t type);
// Whether launches of one token a matrix take the decode kernels built for one token (the default), or those
// built for batches (the same bits; OPTIML_CUDA_ONE_TOKEN=0, read by each CUDA backend as it is made, for
// comparisons on a GPU). Process-wide: the last backend made sets it, and cuda_time_product's "decode"
// follows it. False in a CPU-only build.
void cuda_use_one_token_kernels(bool on);
bool cuda_one_token_kernels();

// One product kernel timed alone on device `device` (native/src/cuda/product_timing.cu): random weights of
// `type`, rows x cols, copied until they span span_bytes; n tokens; kernel "decode" (the decode kernels:
// the integer one where the rows allow it, else the float one), "decode-batch" (the same built for
// batches, at any n), "exact" (a split share's) or "tiles" (the tensor-core tiles of a prompt: Q4_0, Q4_1,
// Q8_0, Q4_K, Q5_K, Q6_K). Seconds per launch over `reps` launches after one untimed.
struct CudaProductTiming {
    double seconds = 0;
    int64_t weight_bytes = 0;  // of one matrix
    const char* kernel = "";   // the kernel that ran (cuda_kernel_name)
};
CudaProductTiming cuda_time_product(int device, int32_t type, int64_t rows, int64_t cols, int32_t n,
                                    const std::string& kernel, int reps, int64_t span_bytes);
// Device-to-device copy bandwidth (bytes read plus written per second) over a buffer of `bytes`.
double cuda_copy_bandwidth(int device, int64_t bytes, int reps);

}  // namespace optiml
