// The CUDA kernels' block decoders (native/src/cuda/dequant.cuh) run on the host, in every build, so
// tests check the device code's arithmetic on machines without a GPU.
#include "bindings.h"

#include "dequant.cuh"
#include "optiml/common.h"

namespace {

using namespace optiml;

// Every value of n elements of `type` from `data`, block by block in groups of 8 through
// dequant8_any, as a kernel reads them.
nb::ndarray<nb::numpy, float> cuda_dequant_host_py(int32_t type, nb::bytes data, int64_t n) {
    const int bs = cudaq::block_size_of(type), bb = cudaq::block_bytes_of(type);
    if (bs == 0) {
        const char* name = type_traits(type).name;
        throw ArgumentError(name ? format("the CUDA dequantizer does not support %s", name)
                                 : format("unknown tensor type id %d", type));
    }
    const char* name = type_traits(type).name;
    if (n < 0 || n % bs != 0)
        throw ArgumentError(format("%lld elements of %s: not a whole number of blocks of %d", (long long)n, name, bs));
    const int64_t n_blocks = n / bs;
    const size_t need = (size_t)n_blocks * (size_t)bb;
    if (data.size() != need)
        throw ArgumentError(format("data holds %zu bytes, but %lld elements of %s take %zu", data.size(), (long long)n,
                                   name, need));
    auto out = new_array<float>({(size_t)n});
    const uint8_t* src = (const uint8_t*)data.c_str();
    float* dst = out.data();
    for (int64_t b = 0; b < n_blocks; b++)
        for (int j = 0; j < bs; j += 8) cudaq::dequant8_any(type, src + b * bb, j, dst + b * bs + j);
    return out;
}

}  // namespace

void bind_cuda_dequant(nb::module_& m) {
    m.def("_cuda_dequant_host", &cuda_dequant_host_py, nb::arg("type"), nb::arg("data"), nb::arg("n"),
          "n values of ggml type `type` from `data` (bytes), decoded on the host by the CUDA kernels' "
          "block code (dequant.cuh). For tests.");
}
