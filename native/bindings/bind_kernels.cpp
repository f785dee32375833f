// Dot products and matrix products on numpy arrays, at a chosen SIMD level (tests compare levels).
#include "bindings.h"

#include <map>
#include <memory>
#include <cstring>
#include <mutex>
#include <string>

#include <nanobind/stl/string.h>

#include "optiml/bandwidth.h"
#include "optiml/common.h"
#include "optiml/kernels.h"
#include "optiml/matmul.h"
#include "optiml/paged_kv.h"
#include "optiml/rows16.h"
#include "optiml/threadpool.h"

namespace {

using namespace optiml;

using Bytes1D = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes2D = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Floats1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Floats2D = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

void check_row_bytes(int32_t wtype, int64_t cols, size_t have, const char* what) {
    check_matmul_args(wtype, cols);
    const size_t need = row_size(wtype, cols);
    if (have != need)
        throw ArgumentError(format("%s holds %zu bytes per row, but %lld elements of %s take %zu", what, have,
                                   (long long)cols, type_traits(wtype).name, need));
}

nb::ndarray<nb::numpy, uint8_t> convert_activation(Floats1D x, int32_t wtype, const std::string& simd) {
    const int64_t n = (int64_t)x.shape(0);
    check_matmul_args(wtype, n);
    const KernelTable& kt = table_for(simd);
    const int32_t xtype = type_traits(wtype).vec_dot_type;
    auto out = new_array<uint8_t>({row_size(xtype, n)});
    kt.from_float[xtype](x.data(), out.data(), n);
    return out;
}

float vec_dot_converted(int32_t wtype, Bytes1D w, Bytes1D xq, int64_t n, const std::string& simd) {
    check_row_bytes(wtype, n, w.shape(0), "the weight row");
    const int32_t xtype = type_traits(wtype).vec_dot_type;
    if (xq.shape(0) != row_size(xtype, n))
        throw ArgumentError(format("the converted activation holds %zu bytes, expected %zu for %lld elements of %s",
                                   (size_t)xq.shape(0), row_size(xtype, n), (long long)n, type_traits(xtype).name));
    float s = 0;
    table_for(simd).vec_dot[wtype](n, &s, w.data(), xq.data());
    return s;
}

// Attention's dot of each row of `rows` (F16 or F32 values, row_stride elements apart) with y, n
// elements each: by the level's many-row kernel when `together` (where it has one), else row by row.
nb::ndarray<nb::numpy, float> attn_dot_rows_py(int32_t type, Bytes1D rows, int64_t row_stride, Bytes1D y, int64_t n,
                                               int64_t n_rows, bool together, const std::string& simd) {
    if (type != TYPE_F16 && type != TYPE_F32) throw ArgumentError("attention dots take F16 or F32 rows");
    const KernelTable& kt = table_for(simd);
    const size_t elem = type_traits(type).type_size;
    if (n <= 0 || n_rows <= 0 || row_stride < n)
        throw ArgumentError(format("attn_dot_rows: n=%lld, n_rows=%lld, row_stride=%lld (need n, n_rows > 0 and "
                                   "row_stride >= n)", (long long)n, (long long)n_rows, (long long)row_stride));
    if ((size_t)y.shape(0) != n * elem || (size_t)rows.shape(0) < ((n_rows - 1) * row_stride + n) * elem)
        throw ArgumentError(format("attn_dot_rows: y holds %zu bytes (need %zu), rows %zu (need %zu)",
                                   (size_t)y.shape(0), (size_t)(n * elem), (size_t)rows.shape(0),
                                   (size_t)(((n_rows - 1) * row_stride + n) * elem)));
    auto out = new_array<float>({(size_t)n_rows});
    if (together && kt.attn_dot_rows[type]) {
        kt.attn_dot_rows[type](n, out.data(), rows.data(), row_stride * elem, y.data(), n_rows);
    } else {
        for (int64_t r = 0; r < n_rows; r++) kt.attn_dot[type](n, out.data() + r, rows.data() + r * row_stride * elem, y.data());
    }
    return out;
}

// The same dots for n_y vectors at once (ys: n_y rows of n F16 values), out[q, r] = dot(row r, y_q): by
// the level's heads kernel where it has one, else by attn_dot row by row and vector by vector.
nb::ndarray<nb::numpy, float> attn_dot_heads_py(Bytes1D rows, int64_t row_stride, Bytes1D ys, int64_t n, int64_t n_rows,
                                                int64_t n_y, const std::string& simd) {
    const KernelTable& kt = table_for(simd);
    const size_t elem = sizeof(fp16_t);
    if (n <= 0 || n_rows <= 0 || n_y <= 0 || row_stride < n)
        throw ArgumentError(format("attn_dot_heads: n=%lld, n_rows=%lld, n_y=%lld, row_stride=%lld (need n, n_rows, "
                                   "n_y > 0 and row_stride >= n)",
                                   (long long)n, (long long)n_rows, (long long)n_y, (long long)row_stride));
    if ((size_t)ys.shape(0) != n_y * n * elem || (size_t)rows.shape(0) < ((n_rows - 1) * row_stride + n) * elem)
        throw ArgumentError(format("attn_dot_heads: ys holds %zu bytes (need %zu), rows %zu (need %zu)",
                                   (size_t)ys.shape(0), (size_t)(n_y * n * elem), (size_t)rows.shape(0),
                                   (size_t)(((n_rows - 1) * row_stride + n) * elem)));
    auto out = new_array<float>({(size_t)n_y, (size_t)n_rows});
    if (kt.attn_dot_heads[TYPE_F16]) {
        kt.attn_dot_heads[TYPE_F16](n, out.data(), n_rows, rows.data(), row_stride * elem, ys.data(), n * elem, n_rows,
                                    (int)n_y);
        return out;
    }
    for (int64_t q = 0; q < n_y; q++)
        for (int64_t r = 0; r < n_rows; r++)
            kt.attn_dot[TYPE_F16](n, out.data() + q * n_rows + r, rows.data() + r * row_stride * elem,
                                  ys.data() + q * n * elem);
    return out;
}

using Ints1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void paged_store(PagedKV& kv, int32_t layer, int32_t seq, int32_t pos, Floats1D k, Floats1D v) {
    const size_t width = (size_t)kv.n_head_kv() * kv.head_dim();
    if (k.shape(0) != width || v.shape(0) != width)
        throw ArgumentError(format("PagedKV.store: k and v need %zu values each (n_head_kv * head_dim), got %zu and %zu",
                                   width, (size_t)k.shape(0), (size_t)v.shape(0)));
    kv.store(layer, seq, pos, k.data(), v.data());
}

nb::ndarray<nb::numpy, float> paged_attend(const PagedKV& kv, int32_t layer, Floats2D q, Ints1D seq, Ints1D pos,
                                           float scale, const std::string& simd, int n_threads) {
    const size_t n = q.shape(0);
    if (seq.shape(0) != n || pos.shape(0) != n)
        throw ArgumentError(format("PagedKV.attend: %zu query rows, %zu sequence ids and %zu positions", n,
                                   (size_t)seq.shape(0), (size_t)pos.shape(0)));
    if (q.shape(1) % kv.head_dim())
        throw ArgumentError(format("PagedKV.attend: query rows of %zu values are not whole heads of %d",
                                   (size_t)q.shape(1), kv.head_dim()));
    const int32_t n_head = (int32_t)(q.shape(1) / kv.head_dim());
    const KernelTable& kt = table_for(simd);
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    auto out = new_array<float>({n, (size_t)q.shape(1)});
    {
        nb::gil_scoped_release release;
        kv.attend(*pool, kt, layer, n_head, q.data(), seq.data(), pos.data(), (int32_t)n, scale, out.data());
    }
    return out;
}

nb::ndarray<nb::numpy, float> matmul_py(Bytes2D w, int32_t wtype, Floats2D x, const std::string& simd,
                                     int n_threads, bool rows16) {
    const int64_t rows = (int64_t)w.shape(0), cols = (int64_t)x.shape(1), n_tokens = (int64_t)x.shape(0);
    check_row_bytes(wtype, cols, w.shape(1), "the weight matrix");
    const KernelTable& kt = table_for(simd);
    if (rows16 && !rows16_fits(wtype, rows, cols))
        throw ArgumentError("rows16: the matrix must be Q4_0, Q4_1 or Q8_0 with a multiple of 16 rows");
    if (rows16 && !kt.gemm_rows16[wtype])
        throw ArgumentError(format("the %s kernels have no rows16 product", simd_level_name(kt.level)));
    std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
    auto y = new_array<float>({(size_t)n_tokens, (size_t)rows});
    {
        nb::gil_scoped_release release;
        const WeightMatrix m{wtype, rows, cols, w.data(), rows16};
        float* out = y.data();
        matmul_many(*pool, kt, &m, &out, 1, x.data(), n_tokens);
    }
    return y;
}

// A copy of row-layout matrix w in the rows16 layout (to_rows16) or back.
nb::ndarray<nb::numpy, uint8_t> rows16_py(Bytes2D w, int32_t wtype, int64_t cols, bool to_rows16) {
    const int64_t rows = (int64_t)w.shape(0);
    check_row_bytes(wtype, cols, w.shape(1), "the weight matrix");
    auto out = new_array<uint8_t>({(size_t)rows, w.shape(1)});
    std::memcpy(out.data(), w.data(), (size_t)rows * w.shape(1));
    if (to_rows16) repack_rows16(wtype, out.data(), rows, cols);
    else unpack_rows16(wtype, out.data(), rows, cols);
    return out;
}

nb::ndarray<nb::numpy, float> rows16_row_py(Bytes2D w, int32_t wtype, int64_t cols, int64_t r) {
    const int64_t rows = (int64_t)w.shape(0);
    check_row_bytes(wtype, cols, w.shape(1), "the weight matrix");
    if (!rows16_fits(wtype, rows, cols)) throw ArgumentError("not a matrix the rows16 layout takes");
    if (r < 0 || r >= rows) throw ArgumentError(format("row %lld of a %lld-row matrix", (long long)r, (long long)rows));
    auto out = new_array<float>({(size_t)cols});
    dequantize_rows16_row(wtype, w.data(), r, cols, out.data());
    return out;
}

}  // namespace

// Shared with the other kernel bindings (bindings.h).
const optiml::KernelTable& table_for(const std::string& simd) {
    if (simd.empty()) return kernel_table();
    for (int l = 0; l < SIMD_LEVEL_COUNT; l++)
        if (simd == simd_level_name((SimdLevel)l)) return kernel_table((SimdLevel)l);
    throw ArgumentError(format("unknown SIMD level '%s' (expected scalar, avx2, avx512 or neon)", simd.c_str()));
}

// Pools of a given size, kept so that benchmarks at 1 and 2 threads do not create threads per call.
std::shared_ptr<optiml::ThreadPool> pool_for(int n_threads) {
    if (n_threads < 0) throw ArgumentError("n_threads must be >= 0 (0 = the default pool)");
    if (n_threads == 0) return default_pool();
    static std::mutex mu;
    static std::map<int, std::shared_ptr<ThreadPool>> pools;
    std::lock_guard<std::mutex> lk(mu);
    auto& p = pools[n_threads];
    if (!p || p->stale()) p = std::make_shared<ThreadPool>(n_threads);  // (stale: made before a fork)
    return p;
}

void bind_kernels(nb::module_& m) {
    m.def(
        "measure_read_bandwidth",
        [](size_t bytes, int repeats, int n_threads) {
            if (bytes < 4096 || repeats < 1) throw ArgumentError("need bytes >= 4096 and repeats >= 1");
            std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
            nb::gil_scoped_release release;
            return measure_read_bandwidth(*pool, bytes, repeats);
        },
        nb::arg("bytes") = (size_t)1 << 30, nb::arg("repeats") = 5, nb::arg("n_threads") = 0,
        "Best memory read bandwidth in bytes/s over `repeats` passes of a buffer of `bytes`.");
    m.def(
        "measure_scattered_read_bandwidth",
        [](size_t row_bytes, double fraction, size_t bytes, int repeats, int n_threads, uint64_t seed) {
            std::shared_ptr<ThreadPool> pool = pool_for(n_threads);
            nb::gil_scoped_release release;
            return measure_scattered_read_bandwidth(*pool, bytes, row_bytes, fraction, repeats, seed);
        },
        nb::arg("row_bytes"), nb::arg("fraction"), nb::arg("bytes") = (size_t)1 << 30, nb::arg("repeats") = 5,
        nb::arg("n_threads") = 0, nb::arg("seed") = 1,
        "Best bytes/s reading a random `fraction` of the `row_bytes`-byte rows of a buffer of `bytes`, in\n"
        "ascending order, as the row-sparse FFN kernels read weights, with no arithmetic.");
    m.def(
        "has_rows16", [](const std::string& simd) { return table_for(simd).gemm_rows16[TYPE_Q4_0] != nullptr; },
        nb::arg("simd") = "", "Whether the kernels of a SIMD level (default: the one in use) have the rows16 product.");
    m.def("simd_levels", [] {
        nb::list out;
        for (int l = 0; l < SIMD_LEVEL_COUNT; l++)
            if (simd_level_available((SimdLevel)l)) out.append(simd_level_name((SimdLevel)l));
        return out;
    });
    m.def("convert_activation", &convert_activation, nb::arg("x"), nb::arg("wtype"), nb::arg("simd") = "",
          "Converts float32 activations to the type that a dot product with `wtype` weights uses.");
    m.def("vec_dot_converted", &vec_dot_converted, nb::arg("wtype"), nb::arg("w"), nb::arg("xq"), nb::arg("n"),
          nb::arg("simd") = "", "Dot product of one weight row with an already converted activation row.");
    m.def("attn_dot_rows", &attn_dot_rows_py, nb::arg("type"), nb::arg("rows"), nb::arg("row_stride"), nb::arg("y"),
          nb::arg("n"), nb::arg("n_rows"), nb::arg("together") = true, nb::arg("simd") = "",
          "Attention's dot products of F16/F32 rows with y, many rows at once or row by row.");
    m.def("attn_dot_heads", &attn_dot_heads_py, nb::arg("rows"), nb::arg("row_stride"), nb::arg("ys"), nb::arg("n"),
          nb::arg("n_rows"), nb::arg("n_y"), nb::arg("simd") = "",
          "Attention's F16 dot products of rows with several vectors at once (the heads of one KV head).");
    m.def("matmul", &matmul_py, nb::arg("w"), nb::arg("wtype"), nb::arg("x"), nb::arg("simd") = "",
          nb::arg("n_threads") = 0, nb::arg("rows16") = false,
          "Y[t, r] = dot(W[r], X[t]) for weight rows W (bytes, or the rows16 layout) and activations X.");
    m.def("rows16", &rows16_py, nb::arg("w"), nb::arg("wtype"), nb::arg("cols"), nb::arg("to_rows16") = true,
          "A copy of matrix w repacked into the rows16 layout (optiml/rows16.h), or back with to_rows16=False.");
    m.def("rows16_row", &rows16_row_py, nb::arg("w"), nb::arg("wtype"), nb::arg("cols"), nb::arg("r"),
          "Row r of a rows16 matrix, dequantized.");

    nb::class_<PagedKV>(m, "PagedKV", "A KV cache in host memory in blocks of 32 positions (optiml/paged_kv.h).")
        .def(nb::init<int32_t, int32_t, int32_t, int32_t, int32_t, int32_t>(), nb::arg("n_layer"), nb::arg("n_head_kv"),
             nb::arg("head_dim"), nb::arg("n_blocks"), nb::arg("type_k") = (int32_t)TYPE_F16, nb::arg("type_v") = -1)
        .def("store", &paged_store, nb::arg("layer"), nb::arg("seq"), nb::arg("pos"), nb::arg("k"), nb::arg("v"))
        .def("free", &PagedKV::free_seq, nb::arg("seq"))
        .def("length", &PagedKV::length, nb::arg("seq"))
        .def_prop_ro("blocks_free", &PagedKV::blocks_free)
        .def_prop_ro("bytes", &PagedKV::bytes)
        .def("attend", &paged_attend, nb::arg("layer"), nb::arg("q"), nb::arg("seq"), nb::arg("pos"),
             nb::arg("scale"), nb::arg("simd") = "", nb::arg("n_threads") = 0);
}
