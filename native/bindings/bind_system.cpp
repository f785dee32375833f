// system_info() and thread settings.
#include "bindings.h"

#include <nanobind/stl/string.h>

#include "optiml/common.h"
#include "optiml/cpu_features.h"
#include "optiml/cuda.h"
#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace {

nb::dict system_info() {
    using namespace optiml;
    nb::dict info;
    info["simd"] = simd_level_name(best_simd_level());
    nb::list levels;
    for (int l = 0; l < SIMD_LEVEL_COUNT; l++)
        if (simd_level_available((SimdLevel)l)) levels.append(simd_level_name((SimdLevel)l));
    info["simd_available"] = levels;

    const CpuFeatures& f = cpu_features();
    nb::dict feats;
    feats["avx2"] = f.avx2;
    feats["fma"] = f.fma;
    feats["f16c"] = f.f16c;
    feats["avx512f"] = f.avx512f;
    feats["avx512bw"] = f.avx512bw;
    feats["avx512vl"] = f.avx512vl;
    feats["avx512vnni"] = f.avx512vnni;
    feats["avx512bf16"] = f.avx512bf16;
    feats["neon"] = f.neon;
    feats["neon_dotprod"] = f.neon_dotprod;
    info["cpu_features"] = feats;

    info["n_threads"] = default_pool()->size();
    info["physical_cores"] = physical_core_count();

    info["cuda_compiled"] = cuda_compiled();
    std::string why;
    nb::list devices;
    for (const CudaDevice& d : cuda_devices(&why)) {
        nb::dict dev;
        dev["id"] = d.id;
        dev["name"] = d.name;
        dev["total_memory"] = d.total_memory;
        dev["free_memory"] = d.free_memory;
        dev["compute_capability"] = nb::make_tuple(d.compute_major, d.compute_minor);
        dev["multiprocessors"] = d.multiprocessors;
        devices.append(dev);
    }
    info["cuda_devices"] = devices;
    if (devices.size() == 0) info["cuda_note"] = why;
#if defined(__clang__)
    info["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
    info["compiler"] = "gcc " __VERSION__;
#else
    info["compiler"] = "unknown";
#endif
    return info;
}

}  // namespace

void bind_system(nb::module_& m) {
    m.def("system_info", &system_info, "What this build and machine offer: SIMD, threads, CUDA devices.");
    m.def(
        "set_num_threads",
        [](int n) {
            if (n < 0) throw optiml::ArgumentError("number of threads must be >= 0 (0 = physical cores)");
            optiml::set_default_threads(n);
        },
        nb::arg("n"), "Size of the default CPU thread pool (0 = physical cores).");
    m.def("get_num_threads", [] { return optiml::default_pool()->size(); });
    m.def("physical_core_count", &optiml::physical_core_count);
}
