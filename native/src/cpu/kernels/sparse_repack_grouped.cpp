// The lossless neuron-major copy of a Q4_0, Q4_1 or Q4_K down matrix (sparse.h, NeuronMajor::grouped).
//
// down is [n_embd rows, n_ff cols], each row in blocks (Q4_K: sub-blocks) of 32 neurons. A block's 4-bit
// codes move to the rows of its 32 neurons; its scale (and minimum) is kept once, for the group of
// those neurons: the copy is about the file matrix's size, where the 8-bit copy costs twice as much
// and rounds every weight a second time.
#include <cstring>

#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/quant.h"
#include "optiml/sparse.h"
#include "quant/quant_impl.h"

namespace optiml {

namespace {

// The 32 codes (in Q4_0's nibble order: code i of byte i's low nibble, code i + 16 of its high one),
// scale and minimum of the 32-neuron group g of one source row.
struct Q4Group {
    uint8_t code[32];
    float d, m;
};

Q4Group source_group(int32_t type, const uint8_t* row, int64_t g) {
    Q4Group out;
    if (type == TYPE_Q4_0 || type == TYPE_Q4_1) {
        const uint8_t* qs;
        if (type == TYPE_Q4_0) {
            const block_q4_0& b = ((const block_q4_0*)row)[g];
            qs = b.qs;
            out.d = fp16_to_fp32(b.d);
            out.m = 0.0f;
        } else {
            const block_q4_1& b = ((const block_q4_1*)row)[g];
            qs = b.qs;
            out.d = fp16_to_fp32(b.d);
            out.m = fp16_to_fp32(b.m);
        }
        for (int q = 0; q < 16; q++) {
            out.code[q] = qs[q] & 0x0F;
            out.code[q + 16] = qs[q] >> 4;
        }
        return out;
    }
    // Q4_K: sub-block s of a 256-value block; sub-blocks 2t and 2t + 1 share qs[32t .. 32t + 31], the
    // first in the low nibbles. Value = d * sc * code - dmin * m: both products exact in float.
    const block_q4_K& b = ((const block_q4_K*)row)[g / 8];
    const int s = (int)(g % 8);
    uint8_t sc, m;
    quant::get_scale_min_k4(s, b.scales, &sc, &m);
    out.d = fp16_to_fp32(b.d) * sc;
    out.m = -(fp16_to_fp32(b.dmin) * m);
    const uint8_t* qs = b.qs + 32 * (s / 2);
    for (int i = 0; i < 32; i++) out.code[i] = s % 2 ? qs[i] >> 4 : qs[i] & 0x0F;
    return out;
}

}  // namespace

bool can_group_neuron_major(int32_t type, int64_t dim) {
    return (type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q4_K) && dim > 0 && dim % 32 == 0;
}

NeuronMajor repack_neuron_major_grouped(ThreadPool& pool, const WeightMatrix& down) {
    if (down.rows16) throw Error("internal: a neuron-major copy is made from plain rows, not the rows16 layout");
    if (!can_group_neuron_major(down.type, down.rows))
        throw ArgumentError(format("a grouped neuron-major copy needs a Q4_0, Q4_1 or Q4_K matrix with a multiple of 32 "
                                   "rows, not %s with %lld rows",
                                   type_is_known(down.type) ? type_traits(down.type).name : "(unknown type)",
                                   (long long)down.rows));
    const int64_t bs = type_traits(down.type).block_size;
    if (down.cols <= 0 || down.cols % bs != 0)
        throw ArgumentError(format("repack_neuron_major_grouped: %lld columns are not a positive multiple of %lld",
                                   (long long)down.cols, (long long)bs));
    const bool has_min = down.type != TYPE_Q4_0;
    NeuronMajor nm;
    nm.type = down.type;
    nm.grouped = true;
    nm.n_neurons = down.cols;
    nm.dim = down.rows;
    nm.row_bytes = (size_t)nm.dim / 2;
    nm.n_groups = down.cols / 32;
    nm.data.resize(nm.row_bytes * (size_t)nm.n_neurons);
    nm.group.resize(nm.n_neurons);
    for (int64_t j = 0; j < nm.n_neurons; j++) nm.group[j] = (int32_t)(j / 32);
    const size_t ss = grouped_scale_size(down.type);
    nm.group_d.resize((size_t)nm.n_groups * nm.dim * ss);
    if (has_min) nm.group_m.resize((size_t)nm.n_groups * nm.dim * ss);
    // fp16 scales come from the file's fp16 fields: converting them back is exact.
    auto put = [ss](std::vector<uint8_t>& v, size_t at, float x) {
        if (ss == 2) {
            const fp16_t h = fp32_to_fp16(x);
            std::memcpy(v.data() + at * 2, &h, 2);
        } else {
            std::memcpy(v.data() + at * 4, &x, 4);
        }
    };

    const size_t src_row = row_size(down.type, down.cols);
    const int64_t n_chunks = nm.dim / 32;
    // One task per group: it reads block g of every row and writes its own 32 rows and scale row.
    pool.run([&](int ith, int nth) {
        int64_t g0, g1;
        split_range(nm.n_groups, ith, nth, &g0, &g1);
        uint8_t codes[32][32];  // [dimension within the chunk][neuron within the group]
        for (int64_t g = g0; g < g1; g++) {
            for (int64_t c = 0; c < n_chunks; c++) {
                for (int i = 0; i < 32; i++) {
                    const int64_t r = c * 32 + i;
                    const Q4Group src = source_group(down.type, (const uint8_t*)down.data + r * src_row, g);
                    put(nm.group_d, (size_t)(g * nm.dim + r), src.d);
                    if (has_min) put(nm.group_m, (size_t)(g * nm.dim + r), src.m);
                    std::memcpy(codes[i], src.code, 32);
                }
                for (int n = 0; n < 32; n++) {
                    uint8_t* dst = nm.data.data() + (size_t)(g * 32 + n) * nm.row_bytes + c * 16;
                    for (int q = 0; q < 16; q++) dst[q] = (uint8_t)(codes[q][n] | codes[q + 16][n] << 4);
                }
            }
        }
    });
    return nm;
}

NeuronMajor neuron_major_copy(ThreadPool& pool, const WeightMatrix& down) {
    if (can_group_neuron_major(down.type, down.rows) && down.cols % 32 == 0)
        return repack_neuron_major_grouped(pool, down);
    return repack_neuron_major(pool, down, TYPE_Q8_0);
}

NeuronMajor gather_neuron_major(const NeuronMajor& full, const int32_t* rows, int64_t n_rows) {
    if (full.external) throw ArgumentError("gather_neuron_major: the rows are in a device's memory");
    for (int64_t i = 0; i < n_rows; i++)
        if (rows[i] < 0 || rows[i] >= full.n_neurons)
            throw ArgumentError(format("gather_neuron_major: row %d is outside [0, %lld)", rows[i],
                                       (long long)full.n_neurons));
    NeuronMajor nm;
    nm.type = full.type;
    nm.dim = full.dim;
    nm.row_bytes = full.row_bytes;
    nm.dim_scale = full.dim_scale;
    nm.n_neurons = n_rows;
    nm.data.resize(nm.row_bytes * (size_t)n_rows);
    for (int64_t i = 0; i < n_rows; i++)
        std::memcpy(nm.data.data() + (size_t)i * nm.row_bytes, full.row(rows[i]), nm.row_bytes);
    if (!full.grouped) return nm;
    // Only the groups the subset uses, in the full copy's order: axpy then sums the same neurons in the
    // same order through either copy, and gets the same bits.
    nm.grouped = true;
    std::vector<char> used(full.n_groups, 0);
    for (int64_t i = 0; i < n_rows; i++) used[full.group[rows[i]]] = 1;
    std::vector<int32_t> renumber(full.n_groups, -1);  // -1: unused
    for (int64_t g = 0; g < full.n_groups; g++)
        if (used[g]) renumber[g] = (int32_t)nm.n_groups++;
    nm.group.resize(n_rows);
    for (int64_t i = 0; i < n_rows; i++) nm.group[i] = renumber[full.group[rows[i]]];
    const size_t row = (size_t)nm.dim * grouped_scale_size(nm.type);  // bytes of one group's scales
    nm.group_d.resize(nm.n_groups * row);
    if (!full.group_m.empty()) nm.group_m.resize(nm.n_groups * row);
    for (int64_t g = 0; g < full.n_groups; g++) {
        if (renumber[g] < 0) continue;
        std::memcpy(&nm.group_d[renumber[g] * row], &full.group_d[g * row], row);
        if (!full.group_m.empty()) std::memcpy(&nm.group_m[renumber[g] * row], &full.group_m[g * row], row);
    }
    return nm;
}

}  // namespace optiml
