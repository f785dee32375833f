// Column-sparse down projection: y = sum over active neurons of a[i] * (neuron-major row idx[i]).
//
// The scalar kernels here are the reference. Every level computes each y[r] as a chain of fused
// multiply-adds, one per neuron in list order (for Q8_0: fma(a[i] * d_block, q, y)); an fma rounds
// once, so the SIMD kernels (any width, any number of neurons per pass) give the very same bits.
#include <cmath>
#include <cstring>
#include <vector>

#include "optiml/common.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {

void axpy_f32_scalar(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const float* x = (const float*)((const uint8_t*)w[i] + off);
        for (int64_t r = 0; r < n; r++) y[r] = std::fma(a[i], x[r], y[r]);
    }
}

void axpy_f16_scalar(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const fp16_t* x = (const fp16_t*)((const uint8_t*)w[i] + off);
        for (int64_t r = 0; r < n; r++) y[r] = std::fma(a[i], fp16_to_fp32(x[r]), y[r]);
    }
}

void axpy_q8_0_scalar(int64_t n, float* y, const void* const* w, size_t off, const float* a, int64_t k) {
    for (int64_t i = 0; i < k; i++) {
        const block_q8_0* b = (const block_q8_0*)((const uint8_t*)w[i] + off);
        for (int64_t j = 0; j < n / OPTIML_QK8_0; j++) {
            const float s = a[i] * fp16_to_fp32(b[j].d);
            float* yj = y + j * OPTIML_QK8_0;
            for (int q = 0; q < OPTIML_QK8_0; q++) yj[q] = std::fma(s, (float)b[j].qs[q], yj[q]);
        }
    }
}

}  // namespace

void fill_sparse_scalar(KernelTable& t) {
    t.axpy[TYPE_F32] = axpy_f32_scalar;
    t.axpy[TYPE_F16] = axpy_f16_scalar;
    t.axpy[TYPE_Q8_0] = axpy_q8_0_scalar;
    fill_sparse_grouped_scalar(t);
}

void axpy_rows(ThreadPool& pool, const KernelTable& kt, const NeuronMajor& d, const int32_t* idx, const float* a,
               int64_t k, float* y, bool accumulate) {
    if (d.grouped) return axpy_rows_grouped(pool, kt, d, idx, a, k, y, accumulate);
    check_neuron_major(d.type, d.n_neurons, d.dim);
    if (d.row_bytes != row_size(d.type, d.dim) || (!d.external && d.data.size() < d.row_bytes * (size_t)d.n_neurons))
        throw ArgumentError("axpy_rows: the neuron-major matrix holds fewer bytes than its shape needs");
    if (!d.dim_scale.empty() && (int64_t)d.dim_scale.size() != d.dim)
        throw ArgumentError("axpy_rows: the neuron-major matrix's dim_scale does not match its dim");
    axpy_rows_raw(pool, kt, d.type, d.n_neurons, d.dim, d.bytes(), idx, a, k, y, accumulate,
                  d.dim_scale.empty() ? nullptr : d.dim_scale.data());
}

void axpy_rows_raw(ThreadPool& pool, const KernelTable& kt, int32_t type, int64_t n_neurons, int64_t dim,
                   const uint8_t* data, const int32_t* idx, const float* a, int64_t k, float* y, bool accumulate,
                   const float* dim_scale) {
    check_neuron_major(type, n_neurons, dim);
    if (k < 0) throw ArgumentError("axpy_rows: negative neuron count");
    const axpy_fn axpy = kt.axpy[type];
    if (!axpy) throw ArgumentError(format("axpy_rows: no kernel for %s rows", type_traits(type).name));
    const size_t row_bytes = row_size(type, dim);

    // Row pointers resolved (and checked) once, shared by all threads; the buffer belongs to the
    // calling thread and is reused across calls.
    static thread_local std::vector<const void*> ptr_buf;
    if ((int64_t)ptr_buf.size() < k) ptr_buf.resize(k);
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] < 0 || idx[i] >= n_neurons)
            throw ArgumentError(format("axpy_rows: neuron index %d at position %lld is outside [0, %lld)", idx[i],
                                       (long long)i, (long long)n_neurons));
        ptr_buf[i] = data + (size_t)idx[i] * row_bytes;
    }
    const void* const* ptrs = ptr_buf.data();

    // Each thread owns a slice of y made of whole 32-element units (whole Q8_0 blocks, whole cache
    // lines of y): no two threads write the same line, and each y[r] sees the same operations in the
    // same order whatever the split.
    const int64_t n_units = (dim + 31) / 32;
    pool.run([&](int ith, int nth) {
        int64_t u0, u1;
        split_range(n_units, ith, nth, &u0, &u1);
        const int64_t r0 = u0 * 32, r1 = u1 * 32 < dim ? u1 * 32 : dim;
        if (r1 <= r0) return;
        if (!dim_scale) {
            if (!accumulate) std::memset(y + r0, 0, sizeof(float) * (r1 - r0));
            if (k > 0) axpy(r1 - r0, y + r0, ptrs, row_size(type, r0), a, k);
            return;
        }
        static thread_local std::vector<float> sum;
        sum.assign(r1 - r0, 0.0f);
        if (k > 0) axpy(r1 - r0, sum.data(), ptrs, row_size(type, r0), a, k);
        for (int64_t r = r0; r < r1; r++) y[r] = (accumulate ? y[r] : 0.0f) + dim_scale[r] * sum[r - r0];
    });
}

}  // namespace optiml
