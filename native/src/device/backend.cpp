// What every backend shares: counted allocations and uploads of weights (native/include/optiml/backend.h).
#include "optiml/backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "optiml/common.h"
#include "optiml/cuda.h"
#include "optiml/model.h"
#include "optiml/quant.h"

namespace optiml {

void* Backend::alloc(size_t bytes, const char* what) {
    if (bytes == 0) bytes = 1;
    void* p = device_alloc(bytes);
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    blocks_.push_back({p, bytes, what});
    allocated_ += bytes;
    return p;
}

void Backend::release(void* p) {
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    for (size_t i = 0; i < blocks_.size(); i++) {
        if (blocks_[i].ptr != p) continue;
        const size_t bytes = blocks_[i].bytes;
        allocated_ -= bytes;
        blocks_.erase(blocks_.begin() + (ptrdiff_t)i);
        device_free(p, bytes);
        return;
    }
    throw Error("internal: releasing memory the backend did not allocate");
}

void Backend::free_all() {
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    for (const Allocation& a : blocks_) device_free(a.ptr, a.bytes);
    blocks_.clear();
    allocated_ = 0;
}

std::vector<std::pair<std::string, size_t>> Backend::allocation_summary() const {
    std::map<std::string, size_t> by_use;
    for (const Allocation& a : blocks_) by_use[a.what] += a.bytes;
    return {by_use.begin(), by_use.end()};
}

int device_index(const std::string& d, const char* prefix) {
    const size_t n = std::char_traits<char>::length(prefix);
    if (d.compare(0, n, prefix) != 0) return -1;
    if (d.size() == n) return 0;
    if (d[n] != ':' || d.size() == n + 1) return -1;
    char* end = nullptr;
    const long v = std::strtol(d.c_str() + n + 1, &end, 10);
    return *end || v < 0 ? -1 : (int)v;
}

std::unique_ptr<Backend> make_device_backend(const std::string& device, int n_threads) {
    if (device_index(device, "cuda") >= 0) return make_cuda_backend(device_index(device, "cuda"));
    if (device_index(device, "cpu") >= 0 && device.size() > 3)
        return make_cpu_device_backend(device_index(device, "cpu"), n_threads);
    throw ArgumentError(format("%s is not a device; use cuda[:N] or cpu:N", device.c_str()));
}

const char* span_kind_name(SpanKind k) {
    static const char* const names[] = {"embed", "norm", "attention", "ffn", "join", "logits",
                                        "copy_in", "copy_out", "copy", "wait"};
    return names[(int)k];
}

double trace_clock() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Backend::moe_ffn(const HParams&, int layer, const MoEWeights&, const float*, int32_t, float*, ActivationRecorder*) {
    throw UnsupportedModelError(format("%s: layer %d is a mixture of experts, and this device runs no experts in "
                                       "this build; keep them on the CPU (n_cpu_moe, --cpu-moe)", name_.c_str(), layer));
}

void Backend::moe_router(const HParams& hp, int layer, const MoEWeights& w, const float*, int32_t, float*) {
    Backend::moe_ffn(hp, layer, w, nullptr, 0, nullptr, nullptr);  // its refusal
}

void Backend::moe_experts(const HParams& hp, int layer, const MoEWeights& w, const float*, const MoEGroups&, float*) {
    Backend::moe_ffn(hp, layer, w, nullptr, 0, nullptr, nullptr);  // its refusal
}

void Backend::moe_shared(const HParams& hp, int layer, const MoEWeights& w, const float*, int32_t, float*, float*) {
    Backend::moe_ffn(hp, layer, w, nullptr, 0, nullptr, nullptr);  // its refusal
}

void Backend::moe_combine(const HParams&, int32_t, const float*, const int32_t*, const float*, const float*,
                          const float*, float*) {
    throw Error(format("internal: %s sums no mixture of experts", name_.c_str()));
}

void Backend::ffn_finish(const HParams&, const FFNShare&, const float*, const float*, const int32_t*, int64_t, int32_t,
                         float*, const StepScratch&) {
    throw Error(format("internal: %s finishes no split FFN (the host backend does)", name_.c_str()));
}

void Backend::trace_start() {
    synchronize();  // spans of work queued before the start would straddle it
    std::lock_guard<std::mutex> lock(trace_mutex_);
    spans_.clear();
    begin_spans();
    tracing_.store(true);
}

std::vector<Span> Backend::trace_stop() {
    tracing_.store(false);  // first: a failure below must not leave every later op timed
    synchronize();
    collect_spans();
    std::lock_guard<std::mutex> lock(trace_mutex_);
    std::vector<Span> out = std::move(spans_);
    spans_.clear();
    std::stable_sort(out.begin(), out.end(), [](const Span& a, const Span& b) { return a.t0 < b.t0; });
    return out;
}

void Backend::add_span(int layer, SpanKind kind, double t0, double t1) {
    std::lock_guard<std::mutex> lock(trace_mutex_);
    spans_.push_back({layer, kind, t0, t1});
}

Weight Backend::upload(const Weight& w, const char* what) {
    if (!w.present()) return w;
    Weight d = w;
    const size_t bytes = w.row_bytes * (size_t)w.rows;
    uint8_t* p = (uint8_t*)alloc(bytes, what);
    copy_from_host(p, w.data, bytes);
    d.data = p;
    return d;
}

Weight Backend::upload_rows(const Weight& w, const int32_t* rows, int64_t n_rows, const char* what) {
    Weight d = w;
    d.rows = n_rows;
    uint8_t* p = (uint8_t*)alloc(w.row_bytes * (size_t)n_rows, what);
    // Runs of consecutive rows go in one copy.
    for (int64_t i = 0; i < n_rows;) {
        int64_t j = i + 1;
        while (j < n_rows && rows[j] == rows[j - 1] + 1) j++;
        if (rows[i] < 0 || rows[j - 1] >= w.rows)
            throw ArgumentError(format("upload_rows: row %d of %s is outside [0, %lld)", rows[i], w.name,
                                       (long long)w.rows));
        copy_from_host(p + (size_t)i * w.row_bytes, w.row((int64_t)rows[i]), (size_t)(j - i) * w.row_bytes);
        i = j;
    }
    d.data = p;
    return d;
}

Weight Backend::upload_cols(const Weight& w, int64_t c0, int64_t c1, const char* what) {
    const int64_t bs = type_traits(w.type).block_size;
    if (c0 < 0 || c1 > w.cols || c0 >= c1 || c0 % bs || (c1 % bs && c1 != w.cols))
        throw ArgumentError(format("upload_cols: columns [%lld, %lld) of %s are not whole %lld-blocks", (long long)c0,
                                   (long long)c1, w.name, (long long)bs));
    Weight d = w;
    d.cols = c1 - c0;
    d.row_bytes = row_size(w.type, d.cols);
    const size_t off = row_size(w.type, c0);
    uint8_t* p = (uint8_t*)alloc(d.row_bytes * (size_t)w.rows, what);
    // Gathered on the host and copied once: a copy per row (4096 for a 7B down matrix) costs a GPU
    // launch each. A device's copy may read its source later (cpu:1's queue, pinned memory on a GPU): the
    // buffer lives until the device has it.
    std::vector<uint8_t> rows((size_t)d.row_bytes * (size_t)w.rows);
    for (int64_t r = 0; r < w.rows; r++) std::memcpy(rows.data() + (size_t)r * d.row_bytes, w.row(r) + off, d.row_bytes);
    copy_from_host(p, rows.data(), rows.size());
    synchronize();
    d.data = p;
    return d;
}

}  // namespace optiml
