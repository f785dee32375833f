// quantize()/dequantize() of whole numpy arrays (rows of floats <-> rows of block bytes) and the
// type table. Big arrays are split over the default thread pool with the GIL released: the model
// converter quantizes whole tensors through this.
#include "bindings.h"

#include <string>

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "optiml/common.h"
#include "optiml/quant.h"
#include "optiml/threadpool.h"

namespace {

using namespace optiml;

using Bytes2D = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Floats2D = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// Below this many elements threads cost more than they save.
constexpr int64_t kParallelMin = 1 << 16;

const TypeTraits& checked_type(int32_t type) {
    const TypeTraits& t = type_traits(type);
    if (!t.name) throw ArgumentError(format("unknown tensor type id %d", type));
    return t;
}

void check_cols(const TypeTraits& t, int64_t n) {
    if (n % t.block_size != 0)
        throw ArgumentError(format("row length %lld is not a multiple of %lld, the block size of %s", (long long)n,
                                   (long long)t.block_size, t.name));
}

// Calls fn(first_block, n_blocks) over [0, n_blocks) with the GIL released, in parallel when the work is
// big. Every block is independent in every format, and C-contiguous rows make the whole array one long row
// of blocks.
template <typename Fn>
void for_blocks(int64_t n_blocks, int64_t block_size, Fn fn) {
    nb::gil_scoped_release release;
    if (n_blocks * block_size < kParallelMin) {
        fn(0, n_blocks);
        return;
    }
    std::shared_ptr<ThreadPool> pool = default_pool();
    pool->run([&](int ith, int nth) {
        int64_t b0, b1;
        split_range(n_blocks, ith, nth, &b0, &b1);
        if (b1 > b0) fn(b0, b1 - b0);
    });
}

nb::ndarray<nb::numpy, uint8_t> quantize_py(Floats2D x, int32_t type) {
    const TypeTraits& t = checked_type(type);
    if (!can_quantize(type)) throw ArgumentError(format("quantizing to %s is not supported", t.name));
    const int64_t rows = (int64_t)x.shape(0), cols = (int64_t)x.shape(1);
    check_cols(t, cols);
    const size_t rb = row_size(type, cols);
    auto out = new_array<uint8_t>({(size_t)rows, rb});
    for_blocks(rows * (cols / t.block_size), t.block_size, [&](int64_t b0, int64_t nb_) {
        quantize_row(type, x.data() + b0 * t.block_size, out.data() + b0 * t.type_size, nb_ * t.block_size);
    });
    return out;
}

nb::ndarray<nb::numpy, float> dequantize_py(Bytes2D data, int32_t type, int64_t n) {
    const TypeTraits& t = checked_type(type);
    if (!can_dequantize(type)) throw ArgumentError(format("dequantizing %s is not supported", t.name));
    if (n < 0) throw ArgumentError("n must be >= 0");
    check_cols(t, n);
    const int64_t rows = (int64_t)data.shape(0);
    const size_t rb = row_size(type, n);
    if ((size_t)data.shape(1) != rb)
        throw ArgumentError(format("rows hold %zu bytes, but %lld elements of %s take %zu", (size_t)data.shape(1),
                                   (long long)n, t.name, rb));
    auto out = new_array<float>({(size_t)rows, (size_t)n});
    for_blocks(rows * (n / t.block_size), t.block_size, [&](int64_t b0, int64_t nb_) {
        dequantize_row(type, data.data() + b0 * t.type_size, out.data() + b0 * t.block_size, nb_ * t.block_size);
    });
    return out;
}

}  // namespace

void bind_quant(nb::module_& m) {
    m.def("quantize", &quantize_py, nb::arg("x"), nb::arg("qtype"),
          "Rows of float32 (2-D, C-contiguous) -> rows of `qtype` bytes, shape (rows, row_bytes).");
    m.def("dequantize", &dequantize_py, nb::arg("data"), nb::arg("qtype"), nb::arg("n"),
          "Rows of `qtype` bytes (2-D uint8, C-contiguous) holding n elements each -> float32 (rows, n).");
    m.def("can_quantize", &optiml::can_quantize, nb::arg("qtype"));
    m.def("can_dequantize", &optiml::can_dequantize, nb::arg("qtype"));
    m.def("type_from_name", [](const std::string& name) { return optiml::type_from_name(name.c_str()); },
          nb::arg("name"), "ggml type id for a name such as 'q4_k' or 'Q4_K'; -1 when unknown.");
    m.def(
        "type_traits",
        [](int32_t type) {
            const optiml::TypeTraits& t = checked_type(type);
            return std::make_tuple(std::string(t.name), t.block_size, (int64_t)t.type_size, t.quantized,
                                   (int32_t)t.vec_dot_type);
        },
        nb::arg("qtype"), "(name, block_size, type_size, quantized, vec_dot_type) of a ggml type id.");
}
