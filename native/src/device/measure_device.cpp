#include "optiml/measure_device.h"

#include <algorithm>
#include <vector>

#include "optiml/common.h"

namespace optiml {

namespace {

template <typename F>
double median_seconds(int reps, F&& fn) {
    std::vector<double> t(reps);
    for (int i = 0; i < reps; i++) {
        const double t0 = trace_clock();
        fn();
        t[i] = trace_clock() - t0;
    }
    std::nth_element(t.begin(), t.begin() + reps / 2, t.end());
    return t[reps / 2];
}

template <typename F>
double best_seconds(int reps, F&& fn) {
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        const double t0 = trace_clock();
        fn();
        best = std::min(best, trace_clock() - t0);
    }
    return best;
}

}  // namespace

DeviceMeasurements measure_device(Backend& be, size_t bytes, size_t small_bytes) {
    if (bytes < 4096 || small_bytes < 4 || small_bytes > bytes)
        throw ArgumentError("measure_device: need bytes >= 4096 and 4 <= small_bytes <= bytes");
    // Device buffers are counted by the backend and freed with it; the host buffer is ordinary memory.
    uint8_t* a = (uint8_t*)be.alloc(bytes, "measure");
    uint8_t* b = (uint8_t*)be.alloc(bytes, "measure");
    std::vector<uint8_t> host(bytes, 1);
    DeviceMeasurements m;
    be.synchronize();

    be.host_wait(be.record());  // first use: lazy setup out of the timings
    m.sync_s = median_seconds(101, [&] { be.host_wait(be.record()); });
    m.transfer_latency_s = median_seconds(101, [&] {
        be.copy_from_host(a, host.data(), small_bytes);
        be.host_wait(be.record());
    });
    m.h2d_bytes_per_s = bytes / best_seconds(5, [&] {
        be.copy_from_host(a, host.data(), bytes);
        be.host_wait(be.record());
    });
    m.d2h_bytes_per_s = bytes / best_seconds(5, [&] {
        be.copy_to_host(host.data(), a, bytes);
        be.host_wait(be.record());
    });
    m.device_bytes_per_s = 2.0 * bytes / best_seconds(5, [&] {
        be.copy(b, a, bytes);
        be.host_wait(be.record());
    });
    constexpr int kOps = 1000;
    m.op_s = best_seconds(3, [&] {
                 for (int i = 0; i < kOps; i++) be.copy(b + (i % 64) * 4, a + (i % 64) * 4, 4);
                 be.host_wait(be.record());
             }) / kOps;
    return m;
}

}  // namespace optiml
