#include "optiml/matmul.h"

#include <atomic>
#include <vector>

#include "optiml/common.h"

namespace optiml {

void check_matmul_args(int32_t wtype, int64_t cols) {
    if (!type_is_known(wtype)) throw ArgumentError(format("unknown tensor type id %d", wtype));
    const TypeTraits& wt = type_traits(wtype);
    const KernelTable& scalar = kernel_table(SIMD_SCALAR);
    if (!scalar.vec_dot[wtype] || !scalar.from_float[wt.vec_dot_type])
        throw ArgumentError(format("no dot-product kernel for weight type %s", wt.name));
    const int64_t bs = type_traits(wt.vec_dot_type).block_size;
    const int64_t need = wt.block_size > bs ? wt.block_size : bs;
    if (cols <= 0 || cols % need != 0)
        throw ArgumentError(format("row length %lld is not a positive multiple of %lld, the block size of %s",
                                   (long long)cols, (long long)need, wt.name));
}

void matmul(ThreadPool& pool, const KernelTable& kt, int32_t wtype, const void* W, int64_t rows,
            int64_t cols, const float* X, int64_t n_tokens, float* Y) {
    check_matmul_args(wtype, cols);
    if (rows <= 0 || n_tokens <= 0) return;
    const TypeTraits& wt = type_traits(wtype);
    const int32_t xtype = wt.vec_dot_type;
    const size_t w_row = row_size(wtype, cols);
    const size_t x_row = row_size(xtype, cols);
    const vec_dot_fn dot = kt.vec_dot[wtype];
    const from_float_fn convert = kt.from_float[xtype];

    // Activations are converted once per call (F32 weights read X directly).
    const bool direct = xtype == TYPE_F32;
    std::vector<uint8_t> xq(direct ? 0 : x_row * n_tokens);
    const uint8_t* xbase = direct ? (const uint8_t*)X : xq.data();
    const uint8_t* wbase = (const uint8_t*)W;

    // Rows are handed out in chunks from a shared counter, so a thread slowed by the OS does not
    // hold the others up. A chunk of rows is applied to every token before moving on, keeping the
    // chunk's weights in cache across the batch.
    const int nth = pool.size();
    int64_t chunk = rows / (nth * 8);
    if (chunk < 16) chunk = 16;
    if (n_tokens > 1 && chunk > 64) chunk = 64;
    const int64_t n_chunks = (rows + chunk - 1) / chunk;
    std::atomic<int64_t> next{0};

    pool.run([&](int ith, int nth_run) {
        if (!direct) {
            int64_t t0, t1;
            split_range(n_tokens, ith, nth_run, &t0, &t1);
            for (int64_t t = t0; t < t1; t++) convert(X + t * cols, xq.data() + t * x_row, cols);
            pool.barrier();
        }
        for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
            const int64_t r0 = c * chunk;
            const int64_t r1 = r0 + chunk < rows ? r0 + chunk : rows;
            for (int64_t t = 0; t < n_tokens; t++) {
                const uint8_t* x = xbase + t * x_row;
                float* y = Y + t * rows;
                for (int64_t r = r0; r < r1; r++) dot(cols, &y[r], wbase + r * w_row, x);
            }
        }
    });
}

}  // namespace optiml
