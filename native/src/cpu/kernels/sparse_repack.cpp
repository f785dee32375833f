// Load-time transpose of the FFN down matrix into neuron-major rows (sparse.h).
//
// down is [n_embd rows, n_ff cols] in blocks along n_ff; the column-sparse down projection wants
// each neuron's n_embd weights contiguous. The transpose goes tile by tile: TILE_R rows by TILE_C
// columns are dequantized (whole source blocks), transposed through a buffer that stays in L1/L2,
// and each of the TILE_C output segments of TILE_R values is quantized with quantize_row, which is
// exact segment by segment because TILE_R is a multiple of the target block size. Tiles are handed
// out from an atomic counter; each writes a disjoint part of the output, so the result does not
// depend on the thread count.
#include <atomic>
#include <cmath>
#include <vector>

#include "optiml/common.h"
#include "optiml/quant.h"
#include "optiml/sparse.h"

namespace optiml {

namespace {
constexpr int64_t TILE_R = 64;   // output elements per segment: a multiple of 32 (Q8_0 blocks)
constexpr int64_t TILE_C = 256;  // source columns per tile: a multiple of every source block size
}  // namespace

bool neuron_major_type_ok(int32_t type) { return type == TYPE_F32 || type == TYPE_F16 || type == TYPE_Q8_0; }

void check_neuron_major(int32_t type, int64_t n_neurons, int64_t dim) {
    if (!neuron_major_type_ok(type))
        throw ArgumentError(format("neuron-major rows must be F32, F16 or Q8_0, not %s",
                                   type_is_known(type) ? type_traits(type).name : "an unknown type"));
    if (n_neurons < 0) throw ArgumentError("neuron-major: negative neuron count");
    const int64_t bs = type_traits(type).block_size;
    if (dim <= 0 || dim % bs != 0)
        throw ArgumentError(format("neuron-major: dim %lld is not a positive multiple of %lld, the block size of %s",
                                   (long long)dim, (long long)bs, type_traits(type).name));
}

NeuronMajor repack_neuron_major(ThreadPool& pool, const WeightMatrix& down, int32_t type) {
    if (down.rows16) throw Error("internal: a neuron-major copy is made from plain rows, not the rows16 layout");
    if (!type_is_known(down.type) || !can_dequantize(down.type))
        throw ArgumentError(format("repack_neuron_major: cannot dequantize weight type %s",
                                   type_is_known(down.type) ? type_traits(down.type).name : "(unknown)"));
    const int64_t src_bs = type_traits(down.type).block_size;
    if (down.cols <= 0 || down.cols % src_bs != 0)
        throw ArgumentError(format("repack_neuron_major: %lld columns are not a positive multiple of %lld, the "
                                   "block size of %s",
                                   (long long)down.cols, (long long)src_bs, type_traits(down.type).name));
    check_neuron_major(type, down.cols, down.rows);

    NeuronMajor nm;
    nm.type = type;
    nm.n_neurons = down.cols;
    nm.dim = down.rows;
    nm.row_bytes = row_size(type, nm.dim);
    nm.data.resize(nm.row_bytes * (size_t)nm.n_neurons);

    const size_t src_row = row_size(down.type, down.cols);
    // Q8_0: each output dimension (a row of down) scaled to a largest |weight| of 1 first (see sparse.h).
    if (type == TYPE_Q8_0) {
        nm.dim_scale.assign(nm.dim, 1.0f);
        pool.run([&](int ith, int nth) {
            std::vector<float> row(down.cols);
            int64_t r0, r1;
            split_range(nm.dim, ith, nth, &r0, &r1);
            for (int64_t r = r0; r < r1; r++) {
                dequantize_row(down.type, (const uint8_t*)down.data + r * src_row, row.data(), down.cols);
                float amax = 0.0f;
                for (float v : row) amax = std::fabs(v) > amax ? std::fabs(v) : amax;
                if (amax > 0 && std::isfinite(amax)) nm.dim_scale[r] = amax;
            }
        });
    }
    const float* scale = nm.dim_scale.empty() ? nullptr : nm.dim_scale.data();
    const int64_t n_tr = (nm.dim + TILE_R - 1) / TILE_R;
    const int64_t n_tc = (nm.n_neurons + TILE_C - 1) / TILE_C;
    const int64_t n_tiles = n_tr * n_tc;
    std::atomic<int64_t> next{0};

    // The SIMD activation converter (llama.cpp's x86 rounding: id = 127/amax, ties to even) rather
    // than the reference quantizer: 20x faster, and a code differs from the reference's only where
    // x/d sits within a rounding error of a tie.
    const from_float_fn to_type = kernel_table().from_float[type];
    pool.run([&](int, int) {
        std::vector<float> in(TILE_R * TILE_C), out(TILE_C * TILE_R);
        for (int64_t tile = next.fetch_add(1); tile < n_tiles; tile = next.fetch_add(1)) {
            // Column tiles vary fastest: consecutive tiles read the same source rows (one stream
            // per row) and write neighbouring output rows.
            const int64_t r0 = (tile / n_tc) * TILE_R, c0 = (tile % n_tc) * TILE_C;
            const int64_t nr = nm.dim - r0 < TILE_R ? nm.dim - r0 : TILE_R;
            const int64_t nc = nm.n_neurons - c0 < TILE_C ? nm.n_neurons - c0 : TILE_C;
            const size_t c_off = row_size(down.type, c0);  // c0 and nc are whole source blocks
            for (int64_t r = 0; r < nr; r++) {
                dequantize_row(down.type, (const uint8_t*)down.data + (r0 + r) * src_row + c_off, &in[r * TILE_C], nc);
                if (scale) {
                    const float inv = 1.0f / scale[r0 + r];
                    for (int64_t c = 0; c < nc; c++) in[r * TILE_C + c] *= inv;
                }
            }
            // out[c][r] = in[r][c], in 8x8 sub-blocks so both sides touch few cache lines at a time.
            for (int64_t rb = 0; rb < nr; rb += 8)
                for (int64_t cb = 0; cb < nc; cb += 8)
                    for (int64_t r = rb; r < rb + 8 && r < nr; r++)
                        for (int64_t c = cb; c < cb + 8 && c < nc; c++) out[c * TILE_R + r] = in[r * TILE_C + c];
            const size_t r_off = row_size(type, r0);  // r0 and nr are whole target blocks
            for (int64_t c = 0; c < nc; c++)
                to_type(&out[c * TILE_R], nm.data.data() + (size_t)(c0 + c) * nm.row_bytes + r_off, nr);
        }
    });
    return nm;
}

}  // namespace optiml
