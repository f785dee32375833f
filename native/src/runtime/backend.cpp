// What every backend shares: counted allocations and uploads of weights (native/include/optiml/backend.h).
#include "optiml/backend.h"

#include <map>

#include "optiml/common.h"
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

void Backend::free_all() {
    std::lock_guard<std::mutex> lock(alloc_mutex_);
    for (const Allocation& a : blocks_) device_free(a.ptr);
    blocks_.clear();
    allocated_ = 0;
}

std::vector<std::pair<std::string, size_t>> Backend::allocation_summary() const {
    std::map<std::string, size_t> by_use;
    for (const Allocation& a : blocks_) by_use[a.what] += a.bytes;
    return {by_use.begin(), by_use.end()};
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
    for (int64_t r = 0; r < w.rows; r++) copy_from_host(p + (size_t)r * d.row_bytes, w.row(r) + off, d.row_bytes);
    d.data = p;
    return d;
}

}  // namespace optiml
