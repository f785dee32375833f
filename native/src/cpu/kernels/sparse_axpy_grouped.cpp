// Column-sparse down projection over grouped neuron-major rows (sparse.h): the lossless 4-bit copy of a
// Q4_0/Q4_1/Q4_K down matrix, whose scales are shared by the 32 neurons of a source block.
//
// The active neurons are sorted by group (stable, so neurons of a group stay in list order). Per group
// the coefficients are quantized to int8 with one scale (as llama.cpp quantizes a dense product's
// activations to Q8_0), the codes are summed with them in integers, exactly, and each output is scaled
// once: a group's scales are read once however many of its neurons fire, and no float is formed per
// neuron. The scalar kernels here are the reference; the SIMD ones compute the same integer sums and
// the same final float steps, so they give the same bits.
#include <algorithm>
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

// MIN: plus a minimum (Q4_1, Q4_K), else centred codes (Q4_0). S: the scales' type.
template <bool MIN, typename S>
void axpy_one_group_scalar(int64_t n, float* y, size_t off, const GroupTerms& g) {
    const S* d = (const S*)g.d;
    const S* m = (const S*)g.m;
    const int32_t centre = MIN ? 0 : 8 * g.q_sum;
    const float ms = g.s * (float)g.q_sum;
    for (int64_t r0 = 0; r0 < n; r0 += 32) {
        int32_t t[32] = {};
        for (int64_t i = 0; i < g.k; i++) {
            const uint8_t* c = (const uint8_t*)g.w[i] + off + r0 / 2;
            for (int b = 0; b < 16; b++) {
                t[b] += g.q[i] * (c[b] & 0x0F);
                t[b + 16] += g.q[i] * (c[b] >> 4);
            }
        }
        for (int j = 0; j < 32; j++) {
            float v = std::fma(scale_at(d, r0 + j) * g.s, (float)(t[j] - centre), y[r0 + j]);
            if (MIN) v = std::fma(scale_at(m, r0 + j), ms, v);
            y[r0 + j] = v;
        }
    }
}

template <bool MIN, typename S>
void axpy_group_scalar(int64_t n, float* y, size_t off, const GroupTerms* groups, int n_groups) {
    for (int g = 0; g < n_groups; g++) axpy_one_group_scalar<MIN, S>(n, y, off, groups[g]);
}

// A group's neurons in the sorted list: [start, start + len).
struct GroupRun {
    int64_t start, len;
    int64_t group;
    float s;  // the int8 coefficients' scale
    int32_t q_sum;
};

// Quantizes a run's coefficients to q (int8) as Q8_0 quantizes activations: s = max|a| / 127 and
// q = roundf(a * (1 / s)), so |q| <= 127. All zero: s = 0 (the run adds nothing). Non-finite: s = NaN
// and q = 0, so the run's outputs are NaN, as a float sum would have them.
void quantize_run(const float* a, int64_t len, int8_t* q, GroupRun& run) {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t i = 0; i < len; i++) {
        finite = finite && std::isfinite(a[i]);
        amax = std::max(amax, std::fabs(a[i]));
    }
    run.q_sum = 0;
    if (!finite || amax == 0.0f) {
        std::memset(q, 0, (size_t)len);
        run.s = finite ? 0.0f : NAN;
        return;
    }
    run.s = amax / 127.0f;
    const float id = 1.0f / run.s;
    for (int64_t i = 0; i < len; i++) {
        q[i] = (int8_t)std::round(a[i] * id);
        run.q_sum += q[i];
    }
}

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
    static thread_local std::vector<int8_t> qs;
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
        // A group's neurons, kMaxGroupRun at a time (more only when the list repeats neurons).
        for (int64_t at = 0; at < next[g + 1]; at += kMaxGroupRun)
            runs.push_back({next[g] + at, std::min(kMaxGroupRun, next[g + 1] - at), g, 0.0f, 0});
        next[g + 1] += next[g];
    }
    if ((int64_t)ptrs.size() < k) {
        ptrs.resize(k);
        coef.resize(k);
        qs.resize(k);
    }
    const uint8_t* base = d.bytes();
    for (int64_t i = 0; i < k; i++) {
        const int64_t at = next[d.group[idx[i]]]++;
        ptrs[at] = base + (size_t)idx[i] * d.row_bytes;
        coef[at] = a[i];
    }
    for (GroupRun& run : runs) quantize_run(coef.data() + run.start, run.len, qs.data() + run.start, run);

    // Each thread owns a slice of y in whole 32-dimension units: every y[r] sees the same operations
    // whatever the split.
    const int64_t n_units = (int64_t)dim / 32;
    // Locals: inside the workers, the thread_local names would mean the workers' own (empty) buffers.
    const void* const* p = ptrs.data();
    const int8_t* q = qs.data();
    const std::vector<GroupRun>& group_runs = runs;
    pool.run([&](int ith, int nth) {
        int64_t u0, u1;
        split_range(n_units, ith, nth, &u0, &u1);
        if (u1 <= u0) return;
        const int64_t r0 = u0 * 32, n = (u1 - u0) * 32;
        if (!accumulate) std::memset(y + r0, 0, sizeof(float) * n);
        // While a batch of groups runs, the start of the next batch's rows and scales is fetched: the
        // kernels prefetch that far ahead within a batch (kernels.h), and each batch is a fresh set of
        // streams.
        const size_t lead = (size_t)std::min<int64_t>(kGroupPrefetchDims, n);
        const size_t scale_lead = (size_t)std::min<int64_t>(kGroupScalePrefetchDims, n);
        auto prefetch = [&](const GroupTerms& g) {
            for (size_t b = 0; b < scale_lead * ss; b += 64) {
                __builtin_prefetch((const uint8_t*)g.d + b);
                if (has_min) __builtin_prefetch((const uint8_t*)g.m + b);
            }
            for (int64_t i = 0; i < g.k; i++)
                for (size_t b = 0; b < lead / 2; b += 64) __builtin_prefetch((const uint8_t*)g.w[i] + r0 / 2 + b);
        };
        GroupTerms batch[2][kGroupsPerCall];
        int n_batch[2] = {0, 0};
        int cur = 0;
        auto run = [&](int which) {
            if (n_batch[which]) kernel(n, y + r0, (size_t)r0 / 2, batch[which], n_batch[which]);
            n_batch[which] = 0;
        };
        for (const GroupRun& gr : group_runs) {
            if (gr.s == 0.0f) continue;  // every coefficient zero
            const size_t at = ((size_t)gr.group * dim + (size_t)r0) * ss;
            GroupTerms& g = batch[1 - cur][n_batch[1 - cur]++];
            g = {p + gr.start, q + gr.start, gr.len, gr.q_sum, gr.s, d.group_d.data() + at,
                 has_min ? d.group_m.data() + at : nullptr};
            prefetch(g);
            if (n_batch[1 - cur] == kGroupsPerCall) {  // the next batch is complete: run the current one
                run(cur);
                cur = 1 - cur;
            }
        }
        run(cur);
        run(1 - cur);
    });
}

}  // namespace optiml
