// Kernels of the activation-sparse FFN, down(act(gate(x)) * up(x)) with most neurons skipped:
//   * matmul_rows computes gate/up for the active neurons only (rows of a row-major weight matrix);
//   * repack_neuron_major copies the down matrix at load time so that a neuron's n_embd weights
//     (a column of down) are one contiguous row;
//   * axpy_rows accumulates the down projection over the active neurons' rows.
// Every result is independent of the thread count, bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optiml/huge_pages.h"
#include "optiml/kernels.h"
#include "optiml/matmul.h"
#include "optiml/threadpool.h"

namespace optiml {

// Y[t * W.rows + rows[i]] = dot(W row rows[i], X[t]) for i < n_rows, t < n_tokens; entries of Y not
// listed are left untouched. Each value is bit-identical to what matmul_many gives for that row and
// token. rows must lie in [0, W.rows) (checked: ArgumentError); duplicates are allowed but wasteful.
void matmul_rows(ThreadPool& pool, const KernelTable& kt, const WeightMatrix& W, const int32_t* rows,
                 int64_t n_rows, const float* X, int64_t n_tokens, float* Y);
// matmul_rows for n_mats matrices of the same shape and vec_dot_type over the same rows and
// input, in one job: Ys[m] gets Ws[m]'s rows.
void matmul_rows_many(ThreadPool& pool, const KernelTable& kt, const WeightMatrix* Ws, float* const* Ys, int n_mats,
                      const int32_t* rows, int64_t n_rows, const float* X, int64_t n_tokens);
// Gate and up rows of the same neurons: one matmul_rows_many job where the two matrices allow it,
// else two matmul_rows calls.
void matmul_rows_gate_up(ThreadPool& pool, const KernelTable& kt, const WeightMatrix& gate, float* y_gate,
                         const WeightMatrix& up, float* y_up, const int32_t* rows, int64_t n_rows, const float* X,
                         int64_t n_tokens);

// The down matrix stored neuron-major: row j holds the dim = n_embd weights of neuron j (column j of
// down) in `type` (F32, F16 or Q8_0), rows row_bytes apart.
//
// Grouped (a lossless copy of a Q4_0, Q4_1 or Q4_K down matrix, `type` saying which): row j holds
// neuron j's dim 4-bit codes, 32 dimensions per 16 bytes in Q4_0's nibble order, and the scales (and
// minimums) of the source's 32-value blocks or sub-blocks stay shared by those 32 neurons, as in the
// file: row j's weight for dimension r is d[g * dim + r] * (code - 8) for Q4_0 and d[...] * code +
// m[...] otherwise, with g = group[j]. Scales are fp16 as in the file for Q4_0/Q4_1, and float for
// Q4_K (a sub-block's scale is an fp16 times a 6-bit integer: exact in float, not in fp16; its
// minimum is stored negated). No weight is rounded again.
struct NeuronMajor {
    int32_t type = TYPE_Q8_0;
    int64_t n_neurons = 0;
    int64_t dim = 0;
    size_t row_bytes = 0;
    HugePageVector<uint8_t> data;  // rows read at random: huge pages where possible
    // [dim] or empty. Q8_0 rows are stored divided by a per-dimension scale (the largest |weight| of
    // that output dimension): the residual stream's outlier dimensions have down weights far larger
    // than the rest, and would otherwise set the scale of every 32-block they fall in, drowning the
    // other 31 values in rounding. axpy_rows multiplies the sums back.
    std::vector<float> dim_scale;
    bool grouped = false;
    int64_t n_groups = 0;
    std::vector<int32_t> group;     // [n_neurons]: the group of each row
    std::vector<uint8_t> group_d;   // [n_groups * dim] scales of grouped_scale_size(type) bytes
    std::vector<uint8_t> group_m;   // the same for minimums (Q4_1, Q4_K), else empty
    // When set, the rows live there (a device's memory) instead of in `data`, and a copy of dim_scale
    // beside them (kernels that cannot read host memory use it).
    const uint8_t* external = nullptr;
    const float* external_dim_scale = nullptr;
    const uint8_t* bytes() const { return external ? external : data.data(); }
    const uint8_t* row(int64_t j) const { return bytes() + (size_t)j * row_bytes; }
};

// Types a NeuronMajor may hold.
bool neuron_major_type_ok(int32_t type);
// Checks that (type, n_neurons, dim) describe a valid NeuronMajor; throws ArgumentError naming the problem.
void check_neuron_major(int32_t type, int64_t n_neurons, int64_t dim);

// Transposes `down` ([rows = n_embd, cols = n_ff], any dequantizable type) into n_ff rows of n_embd
// values of `type`, quantized along n_embd with quantize_row. Multithreaded, tile by tile.
NeuronMajor repack_neuron_major(ThreadPool& pool, const WeightMatrix& down, int32_t type = TYPE_Q8_0);

// Bytes of one grouped scale or minimum: 2 (fp16) for Q4_0/Q4_1, 4 (float) for Q4_K.
inline size_t grouped_scale_size(int32_t type) { return type == TYPE_Q4_K ? 4 : 2; }
// Can a down matrix of this type be copied grouped (lossless)? Q4_0, Q4_1 and Q4_K with a dim that
// is a multiple of 32.
bool can_group_neuron_major(int32_t type, int64_t dim);
// The grouped neuron-major copy of `down` (Q4_0, Q4_1 or Q4_K; ArgumentError otherwise): codes and scales
// moved, never requantized. Multithreaded; the result does not depend on the thread count.
NeuronMajor repack_neuron_major_grouped(ThreadPool& pool, const WeightMatrix& down);
// The compact neuron-major copy of a down matrix: grouped (lossless, about the matrix's size) where the
// type allows it, else 8-bit rows.
NeuronMajor neuron_major_copy(ThreadPool& pool, const WeightMatrix& down);
// Rows rows[0..n) of `full` in list order (a neuron subset, e.g. the host's share of a split layer);
// a grouped copy keeps the scales of the groups those rows use.
NeuronMajor gather_neuron_major(const NeuronMajor& full, const int32_t* rows, int64_t n_rows);

// y[r] = (accumulate ? y[r] : 0) + sum_i a[i] * d.row(idx[i])[r] for r < d.dim, the sum taken in list
// order with one fused multiply-add per neuron. The output range is split across threads in
// 32-aligned slices. idx must lie in [0, d.n_neurons) (checked: ArgumentError).
// Grouped rows: the neurons are taken group by group (groups in ascending order, neurons of a group in
// list order, at most kMaxGroupRun at a time); per group the coefficients are quantized to int8 with
// one scale, s = max|a| / 127 and q = roundf(a * (1 / s)) (Q8_0's rounding: llama.cpp's dense product
// quantizes the activations the same way), and summed with the 4-bit codes in integers, then scaled
// (kernels.h, axpy_group_fn): y gets the file's weights times the quantized coefficients, rounded only
// in the final float steps. A group whose coefficients are all zero adds nothing; a non-finite
// coefficient makes its group's contribution NaN.
void axpy_rows(ThreadPool& pool, const KernelTable& kt, const NeuronMajor& d, const int32_t* idx, const float* a,
               int64_t k, float* y, bool accumulate);
// axpy_rows for grouped rows (native/src/cpu/kernels/sparse_axpy_grouped.cpp).
void axpy_rows_grouped(ThreadPool& pool, const KernelTable& kt, const NeuronMajor& d, const int32_t* idx,
                       const float* a, int64_t k, float* y, bool accumulate);
// The scalar reference kernels of grouped rows (kt.axpy_group).
void fill_sparse_grouped_scalar(KernelTable& t);
void fill_sparse_grouped_avx2(KernelTable& t);  // x86 builds only
void fill_sparse_grouped_neon(KernelTable& t);  // aarch64 builds only
// The same over neuron-major rows held elsewhere (n_neurons rows, row_size(type, dim) bytes apart,
// at `data`), e.g. in a numpy array or a mapped file.
// dim_scale: nullptr, or [dim] factors each y[r] sum is multiplied by (see NeuronMajor).
void axpy_rows_raw(ThreadPool& pool, const KernelTable& kt, int32_t type, int64_t n_neurons, int64_t dim,
                   const uint8_t* data, const int32_t* idx, const float* a, int64_t k, float* y, bool accumulate,
                   const float* dim_scale = nullptr);

}  // namespace optiml
