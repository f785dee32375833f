// system_info() and thread settings.
#include "bindings.h"

#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

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
#if defined(OPTIML_CUDA_SETTING)
    info["cuda_build"] = OPTIML_CUDA_SETTING;  // how the build was asked for CUDA: AUTO, ON, OFF or EMU
#endif
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

// Exercises the pool the way kernels do (many short jobs, barriers between phases, an exception from
// a worker) and reports what it saw, so the tests can check the pool from Python.
nb::dict threadpool_selftest(int n_threads, int n_jobs) {
    using namespace optiml;
    if (n_threads < 1 || n_jobs < 1) throw ArgumentError("need n_threads >= 1 and n_jobs >= 1");
    ThreadPool pool(n_threads);
    std::vector<int64_t> shares(n_threads, 0);  // times each share ran
    std::atomic<int64_t> bad_nth{0};
    std::atomic<int64_t> ran{0};
    int64_t short_jobs = 0;  // jobs that returned before all their shares had run
    {
        nb::gil_scoped_release release;
        for (int j = 0; j < n_jobs; j++) {
            ran.store(0);
            pool.run([&](int ith, int nth) {
                shares[ith] += 1;  // each share runs once per job, so no two threads write one slot
                if (nth != n_threads) bad_nth++;
                // Now and then a share is slow, as a descheduled worker would be.
                if (j % 97 == ith) std::this_thread::sleep_for(std::chrono::microseconds(200));
                ran.fetch_add(1);
            });
            if (ran.load() != n_threads) short_jobs++;
        }
    }
    // Workers asleep (idle long enough to stop spinning): a short job does not wait for them to wake
    // up, the caller runs every share itself. Counted over a few tries, each after an idle pause.
    int64_t caller_ran_all = 0;
    if (n_threads > 1) {
        nb::gil_scoped_release release;
        const std::thread::id caller = std::this_thread::get_id();
        for (int k = 0; k < 20; k++) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            std::atomic<int> on_caller{0};
            pool.run([&](int, int) {
                if (std::this_thread::get_id() == caller) on_caller.fetch_add(1);
            });
            if (on_caller.load() == n_threads) caller_ran_all++;
        }
    }
    bool propagated = false;
    try {
        pool.run([&](int ith, int nth) {
            if (ith == nth - 1) throw ArgumentError("thrown by the last share");
        });
    } catch (const ArgumentError&) {
        propagated = true;
    }
    // The pool must still work after a job threw.
    std::atomic<int> after{0};
    pool.run([&](int, int) { after.fetch_add(1); });

    nb::dict out;
    nb::list per_share;
    for (int64_t c : shares) per_share.append(c);
    out["runs_per_share"] = per_share;
    out["bad_nth"] = bad_nth.load();
    out["short_jobs"] = short_jobs;
    out["caller_ran_all"] = caller_ran_all;
    out["exception_propagated"] = propagated;
    out["shares_after_exception"] = after.load();
    return out;
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
    m.attr("MAX_THREADS") = optiml::kMaxThreads;
    m.def("physical_core_count", &optiml::physical_core_count);
    m.def("_threadpool_selftest", &threadpool_selftest, nb::arg("n_threads"), nb::arg("n_jobs"));
}
