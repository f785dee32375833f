// The CUDA product kernels timed alone (native/src/cuda/product_timing.cu), for tools/bench/gpu_kernels.py.
#include "bindings.h"

#include <nanobind/stl/string.h>

#include "optiml/cuda.h"

namespace {

using namespace optiml;

nb::dict time_product_py(int device, int32_t type, int64_t rows, int64_t cols, int32_t n, const std::string& kernel,
                         int reps, int64_t span_bytes) {
    CudaProductTiming t;
    {
        nb::gil_scoped_release release;
        t = cuda_time_product(device, type, rows, cols, n, kernel, reps, span_bytes);
    }
    nb::dict d;
    d["seconds"] = t.seconds;
    d["weight_bytes"] = t.weight_bytes;
    d["kernel"] = std::string(t.kernel);
    return d;
}

double copy_bandwidth_py(int device, int64_t bytes, int reps) {
    nb::gil_scoped_release release;
    return cuda_copy_bandwidth(device, bytes, reps);
}

}  // namespace

void bind_cuda_timing(nb::module_& m) {
    m.def("_cuda_time_product", &time_product_py, nb::arg("device"), nb::arg("type"), nb::arg("rows"), nb::arg("cols"),
          nb::arg("n"), nb::arg("kernel"), nb::arg("reps"), nb::arg("span_bytes"),
          "Seconds per launch of one CUDA product kernel over random weights (tools/bench/gpu_kernels.py).");
    m.def("_cuda_one_token_kernels", &cuda_one_token_kernels,
          "Whether batch-1 decode takes the CUDA product kernels built for one token (OPTIML_CUDA_ONE_TOKEN).");
    m.def("_cuda_copy_bandwidth", &copy_bandwidth_py, nb::arg("device"), nb::arg("bytes"), nb::arg("reps"),
          "Device-to-device copy bandwidth of CUDA device `device`, bytes read plus written per second.");
}
