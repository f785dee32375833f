// Column-sparse down projection over grouped neuron-major rows (sparse.h): the lossless 4-bit copy of a
// Q4_0/Q4_1/Q4_K down matrix, whose scales are shared by the 32 neurons of a source block.
//
// The active neurons are sorted by group (stable, so neurons of a group stay in list order); per group
// the codes are summed with the neurons' coefficients, then scaled once: a group's scales are read once
// however many of its neurons fire. The scalar kernels here are the reference; the SIMD ones compute
// the same fma chains and give the same bits.
#include <cmath>
#include <cstring>
#include <vector>

#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {

inline float scale_at(const fp16_t* s, int64_t i) { return fp16_to_fp32(s[i]); }
inline float scale_at(const float* s, int64_t i) { return s[i]; }

// MIN: codes as they are plus a minimum (Q4_1, Q4_K); else centred codes (Q4_0). S: the scales' type.
template <bool MIN, typename S>
void axpy_group_scalar(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k,
                       const void* dv, const void* mv, float a_sum) {
    const S* d = (const S*)dv;
    const S* m = (const S*)mv;
    for (int64_t r0 = 0; r0 < n; r0 += 32) {
        float acc[32] = {};
        for (int64_t i = 0; i < k; i++) {
            const uint8_t* q = (const uint8_t*)w[i] + off + r0 / 2;
            for (int b = 0; b < 16; b++) {
                const int lo = q[b] & 0x0F, hi = q[b] >> 4;
                acc[b] = std::fma(a[i], (float)(MIN ? lo : lo - 8), acc[b]);
                acc[b + 16] = std::fma(a[i], (float)(MIN ? hi : hi - 8), acc[b + 16]);
            }
        }
        for (int t = 0; t < 32; t++) {
            float v = std::fma(scale_at(d, r0 + t), acc[t], y[r0 + t]);
            if (MIN) v = std::fma(scale_at(m, r0 + t), a_sum, v);
            y[r0 + t] = v;
        }
    }
}

// A group's neurons in the sorted list: [start, start + len).
struct GroupRun {
    int64_t start, len;
    int64_t group;
    float a_sum;
};

}  // namespace

void fill_sparse_grouped_scalar(KernelTable& t) {
    t.axpy_group[TYPE_Q4_0] = axpy_group_scalar<false, fp16_t>;
    t.axpy_group[TYPE_Q4_1] = axpy_group_scalar<true, fp16_t>;
    t.axpy_group[TYPE_Q4_K] = axpy_group_scalar<true, float>;
}

void axpy_rows_grouped(ThreadPool& pool, const KernelTable& kt, const NeuronMajor& d, const int32_t* idx,
                       const float* a, int64_t k, float* y, bool accumulate) {
    const bool has_min = d.type != TYPE_Q4_0;
    if (!d.grouped || !can_group_neuron_major(d.type, d.dim))
        throw ArgumentError("axpy_rows: grouped neuron-major rows must be Q4_0, Q4_1 or Q4_K with dim a multiple of 32");
    const size_t dim = (size_t)d.dim;
    const size_t ss = grouped_scale_size(d.type);
    if (d.row_bytes != dim / 2 || (!d.external && d.data.size() < d.row_bytes * (size_t)d.n_neurons) ||
        (int64_t)d.group.size() != d.n_neurons || d.group_d.size() != (size_t)d.n_groups * dim * ss ||
        d.group_m.size() != (has_min ? (size_t)d.n_groups * dim * ss : 0))
        throw ArgumentError("axpy_rows: the grouped neuron-major matrix's parts do not match its shape");
    if (k < 0) throw ArgumentError("axpy_rows: negative neuron count");
    const axpy_group_fn kernel = kt.axpy_group[d.type];
    if (!kernel) throw ArgumentError(format("axpy_rows: no kernel for grouped %s rows", type_traits(d.type).name));

    // Counting sort of the list by group, stable; buffers of the calling thread, reused across calls.
    static thread_local std::vector<int64_t> next;
    static thread_local std::vector<const void*> ptrs;
    static thread_local std::vector<float> coef;
    static thread_local std::vector<GroupRun> runs;
    next.assign(d.n_groups + 1, 0);
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] < 0 || idx[i] >= d.n_neurons)
            throw ArgumentError(format("axpy_rows: neuron index %d at position %lld is outside [0, %lld)", idx[i],
                                       (long long)i, (long long)d.n_neurons));
        const int32_t g = d.group[idx[i]];
        if (g < 0 || g >= d.n_groups) throw ArgumentError("axpy_rows: a row's group is outside the matrix's groups");
        next[g + 1]++;
    }
    runs.clear();
    for (int64_t g = 0; g < d.n_groups; g++) {
        if (next[g + 1]) runs.push_back({next[g], next[g + 1], g, 0.0f});  // start, count
        next[g + 1] += next[g];
    }
    if ((int64_t)ptrs.size() < k) {
        ptrs.resize(k);
        coef.resize(k);
    }
    const uint8_t* base = d.bytes();
    for (int64_t i = 0; i < k; i++) {
        const int64_t at = next[d.group[idx[i]]]++;
        ptrs[at] = base + (size_t)idx[i] * d.row_bytes;
        coef[at] = a[i];
    }
    for (GroupRun& run : runs) {
        float s = 0.0f;
        for (int64_t i = 0; i < run.len; i++) s += coef[run.start + i];
        run.a_sum = s;
    }

    // Each thread owns a slice of y in whole 32-dimension units: every y[r] sees the same operations
    // whatever the split.
    const int64_t n_units = (int64_t)dim / 32;
    // Locals: inside the workers, the thread_local names would mean the workers' own (empty) buffers.
    const void* const* p = ptrs.data();
    const float* c = coef.data();
    const std::vector<GroupRun>& group_runs = runs;
    pool.run([&](int ith, int nth) {
        int64_t u0, u1;
        split_range(n_units, ith, nth, &u0, &u1);
        if (u1 <= u0) return;
        const int64_t r0 = u0 * 32, n = (u1 - u0) * 32;
        if (!accumulate) std::memset(y + r0, 0, sizeof(float) * n);
        for (const GroupRun& run : group_runs) {
            const size_t at = ((size_t)run.group * dim + (size_t)r0) * ss;
            const uint8_t* gd = d.group_d.data() + at;
            const uint8_t* gm = has_min ? d.group_m.data() + at : nullptr;
            kernel(n, y + r0, p + run.start, (size_t)r0 / 2, c + run.start, run.len, gd, gm, run.a_sum);
        }
    });
}

}  // namespace optiml
