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

}  // namespace optiml
