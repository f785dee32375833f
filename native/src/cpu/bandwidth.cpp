#include "optiml/bandwidth.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>

namespace optiml {

namespace {
// Independent accumulators let the compiler vectorize and keep several loads in flight.
uint64_t sum_words(const uint64_t* p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += p[i + 0]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
}  // namespace

double measure_read_bandwidth(ThreadPool& pool, size_t bytes, int repeats) {
    const size_t n = bytes / sizeof(uint64_t);
    std::unique_ptr<uint64_t[]> buf(new uint64_t[n]);
    // Touch every page first, so pages are mapped before timing starts.
    pool.run([&](int ith, int nth) {
        int64_t b, e;
        split_range((int64_t)n, ith, nth, &b, &e);
        for (int64_t i = b; i < e; i++) buf[i] = (uint64_t)i;
    });
    double best = 0;
    volatile uint64_t sink = 0;
    for (int r = 0; r < repeats; r++) {
        auto t0 = std::chrono::steady_clock::now();
        pool.run([&](int ith, int nth) {
            int64_t b, e;
            split_range((int64_t)n, ith, nth, &b, &e);
            sink = sink + sum_words(buf.get() + b, (size_t)(e - b));
        });
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double bw = (double)(n * sizeof(uint64_t)) / s;
        if (bw > best) best = bw;
    }
    return best;
}

}  // namespace optiml
