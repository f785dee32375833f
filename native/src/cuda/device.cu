// Device discovery for the CUDA backend. cudart is linked statically, so this runs (and reports no
// devices) on machines without an NVIDIA driver.
#include <cuda_runtime.h>

#include "optiml/cuda.h"

namespace optiml {

bool cuda_compiled() { return true; }

std::vector<CudaDevice> cuda_devices(std::string* why_none) {
    std::vector<CudaDevice> out;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        if (why_none) *why_none = std::string("CUDA reports no usable device: ") + cudaGetErrorString(err);
        cudaGetLastError();  // clear the sticky error so later calls start clean
        return out;
    }
    // Free memory needs each device's context (cudaMemGetInfo is per current device); the caller's current
    // device is restored after, so asking does not move later work to the last GPU.
    int current = 0;
    const bool had_current = cudaGetDevice(&current) == cudaSuccess;
    for (int i = 0; i < count; i++) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
        CudaDevice d;
        d.id = i;
        d.name = prop.name;
        d.total_memory = prop.totalGlobalMem;
        d.free_memory = 0;
        size_t free_b = 0, total_b = 0;
        if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
            d.free_memory = free_b;
        d.compute_major = prop.major;
        d.compute_minor = prop.minor;
        d.multiprocessors = prop.multiProcessorCount;
        out.push_back(d);
    }
    if (count > 0 && had_current) cudaSetDevice(current);
    cudaGetLastError();  // (a device that failed above leaves no sticky error for the next call)
    if (out.empty() && why_none) *why_none = "CUDA found no GPU";
    return out;
}

}  // namespace optiml
