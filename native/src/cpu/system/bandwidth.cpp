#include "optiml/bandwidth.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "optiml/common.h"
#include "optiml/huge_pages.h"

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

uint64_t xorshift64(uint64_t& s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
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

double measure_scattered_read_bandwidth(ThreadPool& pool, size_t bytes, size_t row_bytes, double fraction,
                                        int repeats, uint64_t seed) {
    if (row_bytes < 64 || row_bytes % 64 != 0)
        throw ArgumentError(format("scattered read: row_bytes must be a multiple of 64 (one cache line), got %zu", row_bytes));
    if (!(fraction > 0.0 && fraction <= 1.0))
        throw ArgumentError(format("scattered read: fraction must be in (0, 1], got %g", fraction));
    if (repeats < 1) throw ArgumentError("scattered read: repeats must be >= 1");
    const int64_t n_rows = (int64_t)(bytes / row_bytes);
    if (n_rows < 64) throw ArgumentError(format("scattered read: %zu bytes hold fewer than 64 rows of %zu", bytes, row_bytes));
    HugePageVector<uint64_t> buf((size_t)n_rows * row_bytes / sizeof(uint64_t));
    uint64_t* words = buf.data();
    const size_t row_words = row_bytes / sizeof(uint64_t);
    pool.run([&](int ith, int nth) {  // map every page before timing
        int64_t b, e;
        split_range(n_rows, ith, nth, &b, &e);
        for (size_t i = (size_t)b * row_words; i < (size_t)e * row_words; i++) words[i] = i;
    });
    std::vector<int64_t> rows;
    rows.reserve((size_t)n_rows);
    uint64_t state = seed ? seed : 1;
    const uint64_t cut = (uint64_t)(fraction * 18446744073709551615.0);
    double best = 0;
    volatile uint64_t sink = 0;
    for (int r = 0; r < repeats; r++) {
        rows.clear();
        for (int64_t i = 0; i < n_rows; i++)
            if (fraction >= 1.0 || xorshift64(state) < cut) rows.push_back(i);
        if (rows.empty()) rows.push_back(0);
        const int64_t n = (int64_t)rows.size();
        auto t0 = std::chrono::steady_clock::now();
        // Chunks of the list from a shared counter, as matmul_rows hands them out.
        int64_t chunk = n / ((int64_t)pool.size() * 8);
        chunk = chunk < 16 ? 16 : (chunk + 7) / 8 * 8;
        std::atomic<int64_t> next{0};
        pool.run([&](int, int) {
            uint64_t acc = 0;
            for (int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) {
                const int64_t e = b + chunk < n ? b + chunk : n;
                // Eight rows at a time, line by line, the same line of the next eight fetched alongside:
                // the row-sparse kernels' order (several short streams at once keep more misses in
                // flight than one row after another).
                int64_t i = b;
                for (; i + 8 <= e; i += 8) {
                    const uint64_t* p[8];
                    const char* q[8];
                    for (int k = 0; k < 8; k++) {
                        p[k] = words + (size_t)rows[i + k] * row_words;
                        q[k] = (const char*)(words + (size_t)rows[i + 8 + k < n ? i + 8 + k : n - 1] * row_words);
                    }
                    for (size_t w = 0; w < row_words; w += 8) {
                        for (int k = 0; k < 8; k++) __builtin_prefetch(q[k] + w * 8, 0, 2);
                        for (int k = 0; k < 8; k++) acc += sum_words(p[k] + w, 8);
                    }
                }
                for (; i < e; i++) acc += sum_words(words + (size_t)rows[i] * row_words, row_words);
            }
            sink = sink + acc;
        });
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const double bw = (double)n * (double)row_bytes / s;
        if (bw > best) best = bw;
    }
    return best;
}

}  // namespace optiml
