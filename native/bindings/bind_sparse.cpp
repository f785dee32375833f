// The sparse FFN kernels (sparse.h) on numpy arrays, at a chosen SIMD level and thread count, for
// tests and benchmarks. Weights come in as raw bytes plus (type, rows, cols), as GGUF stores them.
#include "bindings.h"

#include <cstring>
#include <optional>
#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "optiml/common.h"
#include "optiml/quant.h"
#include "optiml/sparse.h"

namespace {

using namespace optiml;

using BytesND = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using Ints1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats2D = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A weight matrix over the bytes of w, after checking that they are exactly rows x cols of qtype.
WeightMatrix weight_matrix(const BytesND& w, int32_t qtype, int64_t rows, int64_t cols) {
    if (!type_is_known(qtype)) throw ArgumentError(format("unknown tensor type id %d", qtype));
    const TypeTraits& t = type_traits(qtype);
    if (rows < 0 || cols <= 0 || cols % t.block_size != 0)
        throw ArgumentError(format("a %lld x %lld matrix of %s: rows must be >= 0 and cols a positive multiple of %lld",
                                   (long long)rows, (long long)cols, t.name, (long long)t.block_size));
    const size_t need = row_size(qtype, cols) * (size_t)rows;
    if (w.size() != need)
        throw ArgumentError(format("the weights hold %zu bytes, but %lld x %lld of %s take %zu", (size_t)w.size(),
                                   (long long)rows, (long long)cols, t.name, need));
    return WeightMatrix{qtype, rows, cols, w.data()};
}

// An axpy's coefficients: one per neuron index.
void check_coefficients(const Ints1D& idx, const Floats1D& a) {
    if (a.shape(0) != idx.shape(0))
        throw ArgumentError(format("%zu coefficients for %zu neuron indices", (size_t)a.shape(0), (size_t)idx.shape(0)));
}

// An axpy's output of dim values: a copy of y0 (checked to hold dim values) to add into, or zeros.
nb::ndarray<nb::numpy, float> axpy_output(const std::optional<Floats1D>& y0, int64_t dim) {
    if (y0 && (int64_t)y0->shape(0) != dim)
        throw ArgumentError(format("y holds %zu values, expected dim = %lld", (size_t)y0->shape(0), (long long)dim));
    auto y = new_array<float>({(size_t)dim});
    if (y0) std::memcpy(y.data(), y0->data(), sizeof(float) * dim);
    return y;
}

nb::ndarray<nb::numpy, float> matmul_rows_py(BytesND w, int32_t qtype, int64_t rows, int64_t cols, Ints1D idx,
                                             Floats2D x, int n_threads, const std::optional<std::string>& simd) {
    const WeightMatrix W = weight_matrix(w, qtype, rows, cols);
    check_matmul_args(qtype, cols);
    if ((int64_t)x.shape(1) != cols)
        throw ArgumentError(format("x has rows of %zu values, the weights have %lld columns", (size_t)x.shape(1),
                                   (long long)cols));
    const KernelTable& kt = table_for(simd.value_or(""));
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    const int64_t n_tokens = (int64_t)x.shape(0);
    auto y = new_array<float>({(size_t)n_tokens, (size_t)rows});  // zeros: unlisted rows stay 0
    {
        nb::gil_scoped_release release;
        matmul_rows(*pool, kt, W, idx.data(), (int64_t)idx.shape(0), x.data(), n_tokens, y.data());
    }
    return y;
}

nb::tuple repack_py(BytesND w, int32_t qtype, int64_t rows, int64_t cols, int32_t type, int n_threads) {
    const WeightMatrix W = weight_matrix(w, qtype, rows, cols);
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    NeuronMajor nm;
    {
        nb::gil_scoped_release release;
        nm = repack_neuron_major(*pool, W, type);
    }
    auto out = new_array<uint8_t>({(size_t)nm.n_neurons, nm.row_bytes});
    if (!nm.data.empty()) std::memcpy(out.data(), nm.data.data(), nm.data.size());
    if (nm.dim_scale.empty()) return nb::make_tuple(out, nm.row_bytes, nb::none());
    auto scale = new_array<float>({nm.dim_scale.size()});
    std::memcpy(scale.data(), nm.dim_scale.data(), sizeof(float) * nm.dim_scale.size());
    return nb::make_tuple(out, nm.row_bytes, scale);
}

nb::ndarray<nb::numpy, float> axpy_rows_py(BytesND d, int32_t type, int64_t n_neurons, int64_t dim, Ints1D idx,
                                           Floats1D a, std::optional<Floats1D> y0, int n_threads,
                                           const std::optional<std::string>& simd,
                                           std::optional<Floats1D> dim_scale) {
    check_neuron_major(type, n_neurons, dim);
    const size_t need = row_size(type, dim) * (size_t)n_neurons;
    if (d.size() != need)
        throw ArgumentError(format("the neuron-major rows hold %zu bytes, but %lld rows of %lld %s values take %zu",
                                   (size_t)d.size(), (long long)n_neurons, (long long)dim, type_traits(type).name,
                                   need));
    check_coefficients(idx, a);
    auto y = axpy_output(y0, dim);
    if (dim_scale && (int64_t)dim_scale->shape(0) != dim)
        throw ArgumentError(format("dim_scale holds %zu values, expected dim = %lld", (size_t)dim_scale->shape(0),
                                   (long long)dim));
    const KernelTable& kt = table_for(simd.value_or(""));
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    {
        nb::gil_scoped_release release;
        axpy_rows_raw(*pool, kt, type, n_neurons, dim, d.data(), idx.data(), a.data(), (int64_t)idx.shape(0),
                      y.data(), y0.has_value(), dim_scale ? dim_scale->data() : nullptr);
    }
    return y;
}

nb::tuple repack_grouped_py(BytesND w, int32_t qtype, int64_t rows, int64_t cols, int n_threads) {
    const WeightMatrix W = weight_matrix(w, qtype, rows, cols);
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    NeuronMajor nm;
    {
        nb::gil_scoped_release release;
        nm = repack_neuron_major_grouped(*pool, W);
    }
    auto codes = new_array<uint8_t>({(size_t)nm.n_neurons, nm.row_bytes});
    std::memcpy(codes.data(), nm.data.data(), nm.data.size());
    auto group = new_array<int32_t>({nm.group.size()});
    std::memcpy(group.data(), nm.group.data(), 4 * nm.group.size());
    // Scales and minimums as float32, whatever their stored width.
    auto scales = [&](const std::vector<uint8_t>& v) {
        auto out = new_array<float>({(size_t)nm.n_groups, (size_t)nm.dim});
        const size_t n = (size_t)nm.n_groups * nm.dim;
        for (size_t i = 0; i < n; i++) {
            if (grouped_scale_size(nm.type) == 2) {
                fp16_t h;
                std::memcpy(&h, v.data() + 2 * i, 2);
                out.data()[i] = fp16_to_fp32(h);
            } else {
                std::memcpy(out.data() + i, v.data() + 4 * i, 4);
            }
        }
        return out;
    };
    if (nm.group_m.empty()) return nb::make_tuple(codes, group, scales(nm.group_d), nb::none());
    return nb::make_tuple(codes, group, scales(nm.group_d), scales(nm.group_m));
}

// axpy over the grouped copy of W (optionally of its neuron subset `rows`, idx then indexing the subset).
nb::ndarray<nb::numpy, float> axpy_grouped_py(BytesND w, int32_t qtype, int64_t rows, int64_t cols, Ints1D idx,
                                              Floats1D a, std::optional<Floats1D> y0, std::optional<Ints1D> subset,
                                              int n_threads, const std::optional<std::string>& simd) {
    const WeightMatrix W = weight_matrix(w, qtype, rows, cols);
    check_coefficients(idx, a);
    auto y = axpy_output(y0, rows);
    const KernelTable& kt = table_for(simd.value_or(""));
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    {
        nb::gil_scoped_release release;
        NeuronMajor nm = repack_neuron_major_grouped(*pool, W);
        if (subset) nm = gather_neuron_major(nm, subset->data(), (int64_t)subset->shape(0));
        axpy_rows(*pool, kt, nm, idx.data(), a.data(), (int64_t)idx.shape(0), y.data(), y0.has_value());
    }
    return y;
}

// A down matrix's neuron-major copy as the engine makes it (grouped where the type allows, else 8-bit
// rows; or 8-bit rows on request), kept between calls: what the benchmarks time.
struct PyNeuronMajor {
    NeuronMajor nm;
};

PyNeuronMajor* make_neuron_major(BytesND w, int32_t qtype, int64_t rows, int64_t cols, bool grouped, int n_threads) {
    const WeightMatrix W = weight_matrix(w, qtype, rows, cols);
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    auto* p = new PyNeuronMajor;
    nb::gil_scoped_release release;
    p->nm = grouped ? neuron_major_copy(*pool, W) : repack_neuron_major(*pool, W, TYPE_Q8_0);
    return p;
}

nb::ndarray<nb::numpy, float> neuron_major_axpy(const PyNeuronMajor& p, Ints1D idx, Floats1D a, int n_threads,
                                                const std::optional<std::string>& simd) {
    check_coefficients(idx, a);
    const KernelTable& kt = table_for(simd.value_or(""));
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    auto y = axpy_output(std::nullopt, p.nm.dim);
    {
        nb::gil_scoped_release release;
        axpy_rows(*pool, kt, p.nm, idx.data(), a.data(), (int64_t)idx.shape(0), y.data(), false);
    }
    return y;
}

}  // namespace

void bind_sparse(nb::module_& m) {
    nb::class_<PyNeuronMajor>(m, "NeuronMajor")
        .def(nb::new_(&make_neuron_major), nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
             nb::arg("grouped") = true, nb::arg("n_threads") = 0,
             "The neuron-major copy of a rows x cols down matrix (raw bytes of qtype) as the sparse FFN keeps "
             "it: grouped (lossless) for Q4_0/Q4_1/Q4_K when `grouped`, else 8-bit rows.")
        .def_prop_ro("grouped", [](const PyNeuronMajor& p) { return p.nm.grouped; })
        .def_prop_ro("nbytes", [](const PyNeuronMajor& p) {
            return p.nm.data.size() + p.nm.group_d.size() + p.nm.group_m.size() + 4 * p.nm.dim_scale.size();
        })
        .def("axpy", &neuron_major_axpy, nb::arg("idx"), nb::arg("a"), nb::arg("n_threads") = 0,
             nb::arg("simd").none() = nb::none(), "sum_i a[i] * (column idx[i] of the down matrix), float32 [rows].");
    m.def("repack_neuron_major_grouped", &repack_grouped_py, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"),
          nb::arg("cols"), nb::arg("n_threads") = 0,
          "The lossless grouped neuron-major copy of a Q4_0/Q4_1/Q4_K rows x cols matrix: returns (codes: "
          "uint8 [cols, rows / 2], group: int32 [cols], scales: float32 [groups, rows], minimums: the same "
          "for Q4_1/Q4_K (Q4_K's negated), else None).");
    m.def("axpy_rows_grouped", &axpy_grouped_py, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
          nb::arg("idx"), nb::arg("a"), nb::arg("y").none() = nb::none(), nb::arg("subset").none() = nb::none(),
          nb::arg("n_threads") = 0, nb::arg("simd").none() = nb::none(),
          "sum_i a[i] * column idx[i] of W (Q4_0/Q4_1/Q4_K raw bytes), through its grouped neuron-major copy "
          "(of the columns in `subset` when given, idx then indexing the subset); added to a copy of y.");
    m.def("matmul_rows", &matmul_rows_py, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
          nb::arg("idx"), nb::arg("x"), nb::arg("n_threads") = 0, nb::arg("simd").none() = nb::none(),
          "Y[t, r] = dot(W[r], X[t]) for the rows r listed in idx (int32); other entries of Y are 0. "
          "W is rows x cols of qtype as raw bytes, X float32 [n_tokens, cols].");
    m.def("repack_neuron_major", &repack_py, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
          nb::arg("type") = (int32_t)TYPE_Q8_0, nb::arg("n_threads") = 0,
          "Column j of the rows x cols matrix W (raw bytes of qtype) as row j of `type` (F32, F16, Q8_0): "
          "returns (uint8 [cols, row_bytes], row_bytes, dim_scale: float32 [rows] for Q8_0, else None).");
    m.def("axpy_rows", &axpy_rows_py, nb::arg("d"), nb::arg("type"), nb::arg("n_neurons"), nb::arg("dim"),
          nb::arg("idx"), nb::arg("a"), nb::arg("y").none() = nb::none(), nb::arg("n_threads") = 0,
          nb::arg("simd").none() = nb::none(), nb::arg("dim_scale").none() = nb::none(),
          "sum_i a[i] * d[idx[i]] over neuron-major rows d (raw bytes of `type`), float32 [dim], times "
          "dim_scale when given; added to a copy of y when given.");
}
