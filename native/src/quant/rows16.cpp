// The rows16 layout (optiml/rows16.h): 16 rows' blocks gathered into one block per column block, and back.
#include "optiml/rows16.h"

#include <cstring>
#include <type_traits>
#include <vector>

#include "optiml/common.h"
#include "optiml/quant.h"
#include "optiml/threadpool.h"

namespace optiml {

namespace {

// Block i of panel `base` (16 rows of nb blocks): where its codes, scales and mins lie.
struct PanelBlock {
    uint8_t* q;  // code part k at q + 64 k, row r at byte 4 r of each part
    fp16_t* d;   // d[r]
    fp16_t* m;   // m[r] (Q4_1)
};
inline PanelBlock panel_block(int32_t type, uint8_t* base, int64_t nb, int64_t i) {
    const size_t cb = rows16_code_bytes(type);
    uint8_t* scales = base + nb * cb;
    return {base + i * cb, (fp16_t*)(scales + i * 32), (fp16_t*)(scales + nb * 32 + i * 32)};
}

// One format's codes: put(p, r, b) stores row r's block b into panel block p, get(p, r) gives it back.
// Q4_0 and Q4_1 move their packed nibbles a dword at a time (and Q4_1 its min beside the scale).
template <class B>
struct NibbleCodes {
    typedef B Block;
    static constexpr bool has_min = std::is_same<B, block_q4_1>::value;
    static void put(const PanelBlock& p, int r, const Block& b) {
        p.d[r] = b.d;
        if constexpr (has_min) p.m[r] = b.m;
        for (int k = 0; k < 4; k++) std::memcpy(p.q + 64 * k + 4 * r, b.qs + 4 * k, 4);
    }
    static Block get(const PanelBlock& p, int r) {
        Block b;
        b.d = p.d[r];
        if constexpr (has_min) b.m = p.m[r];
        for (int k = 0; k < 4; k++) std::memcpy(b.qs + 4 * k, p.q + 64 * k + 4 * r, 4);
        return b;
    }
};
typedef NibbleCodes<block_q4_0> Q4_0Codes;
typedef NibbleCodes<block_q4_1> Q4_1Codes;
// Q8_0's codes are stored + 128 (the unsigned operand of vpdpbusd), so the kernel does not add it.
struct Q8_0Codes {
    typedef block_q8_0 Block;
    static void put(const PanelBlock& p, int r, const Block& b) {
        p.d[r] = b.d;
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < 4; j++) p.q[64 * k + 4 * r + j] = (uint8_t)b.qs[4 * k + j] ^ 0x80;
    }
    static Block get(const PanelBlock& p, int r) {
        Block b;
        b.d = p.d[r];
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < 4; j++) b.qs[4 * k + j] = (int8_t)(p.q[64 * k + 4 * r + j] ^ 0x80);
        return b;
    }
};

// Panels [p0, p1) of a matrix, each through a buffer of its 16 rows' bytes.
template <class F, bool ToRows16>
void convert_panels(int32_t type, uint8_t* data, int64_t nb, int64_t p0, int64_t p1) {
    typedef typename F::Block Block;
    std::vector<uint8_t> buf(16 * nb * sizeof(Block));
    for (int64_t p = p0; p < p1; p++) {
        uint8_t* base = data + (size_t)p * buf.size();
        std::memcpy(buf.data(), base, buf.size());
        if (ToRows16) {
            const Block* rows = (const Block*)buf.data();  // row r's block i: rows[r * nb + i]
            for (int64_t i = 0; i < nb; i++) {
                const PanelBlock out = panel_block(type, base, nb, i);
                for (int r = 0; r < 16; r++) F::put(out, r, rows[r * nb + i]);
            }
        } else {
            Block* rows = (Block*)base;
            for (int64_t i = 0; i < nb; i++) {
                const PanelBlock in = panel_block(type, buf.data(), nb, i);
                for (int r = 0; r < 16; r++) rows[r * nb + i] = F::get(in, r);
            }
        }
    }
}

template <bool ToRows16>
void convert(int32_t type, void* data, int64_t rows, int64_t cols, ThreadPool* pool) {
    if (!rows16_fits(type, rows, cols))
        throw ArgumentError(format("no rows16 layout for a %s matrix of %lld x %lld (Q4_0, Q4_1 or Q8_0, rows a "
                                   "multiple of 16, columns of 32)",
                                   type_is_known(type) ? type_traits(type).name : "(unknown)", (long long)rows,
                                   (long long)cols));
    const int64_t nb = cols / 32, n_panels = rows / 16;
    auto run = [&](int64_t p0, int64_t p1) {
        uint8_t* d = (uint8_t*)data;
        if (type == TYPE_Q4_0) convert_panels<Q4_0Codes, ToRows16>(type, d, nb, p0, p1);
        else if (type == TYPE_Q4_1) convert_panels<Q4_1Codes, ToRows16>(type, d, nb, p0, p1);
        else convert_panels<Q8_0Codes, ToRows16>(type, d, nb, p0, p1);
    };
    if (!pool) return run(0, n_panels);
    pool->run([&](int ith, int nth) {
        int64_t p0, p1;
        split_range(n_panels, ith, nth, &p0, &p1);
        run(p0, p1);
    });
}

}  // namespace

bool rows16_fits(int32_t type, int64_t rows, int64_t cols) {
    return (type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0) && rows > 0 && rows % 16 == 0 && cols > 0 &&
           cols % 32 == 0;
}

void repack_rows16(int32_t type, void* data, int64_t rows, int64_t cols, ThreadPool* pool) {
    convert<true>(type, data, rows, cols, pool);
}

void unpack_rows16(int32_t type, void* data, int64_t rows, int64_t cols, ThreadPool* pool) {
    convert<false>(type, data, rows, cols, pool);
}

void dequantize_rows16_row(int32_t type, const void* data, int64_t r, int64_t cols, float* out) {
    if (r < 0 || !rows16_fits(type, (r / 16 + 1) * 16, cols))
        throw ArgumentError("dequantize_rows16_row: not a row of a rows16 matrix");
    const int64_t nb = cols / 32;
    const int lane = (int)(r % 16);
    uint8_t* base = (uint8_t*)data + (size_t)(r / 16) * 16 * row_size(type, cols);
    for (int64_t i = 0; i < nb; i++) {
        const PanelBlock p = panel_block(type, base, nb, i);
        if (type == TYPE_Q4_0) {
            const block_q4_0 b = Q4_0Codes::get(p, lane);
            dequantize_row(type, &b, out + 32 * i, 32);
        } else if (type == TYPE_Q4_1) {
            const block_q4_1 b = Q4_1Codes::get(p, lane);
            dequantize_row(type, &b, out + 32 * i, 32);
        } else {
            const block_q8_0 b = Q8_0Codes::get(p, lane);
            dequantize_row(type, &b, out + 32 * i, 32);
        }
    }
}

}  // namespace optiml
