// Prompts and batches on tensor cores: the integer products of matmul.cu (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
// IQ4_NL weights with the activations' 8-bit codes, as the CPU's block dot products; and Q2_K-Q6_K, IQ4_XS
// with Q8_K's codes, as the CPU's K-quant dot products) for 32 tokens and more, as tiles of 64 weight rows
// by 64 tokens. A thread block stages a stretch of 256 values of its rows (decoded to signed 8-bit codes)
// and of its tokens' codes in shared memory; each of its four warps multiplies a 32 x 32 corner of the
// tile with mma.sync m16n8k32 (int8 in, int32 out), one quantization block of 32 values at a time (the
// K-quants with sub-blocks of 16, Q2_K, Q3_K and Q6_K: m16n8k16, a sub-block at a time), and scales each
// block's exact integer sums by the weights' and the activations' scales in float, as the CPU does. The
// per-block values are the CPU's; for the 32-value formats the float sum over blocks runs in another order,
// for the K-quants it is the CPU's chain of fused steps, super-block after super-block. F16 and BF16
// weights take the same tiles with 16-bit operands and float sums (matmul_tiles_f_kernel).
//
// The weights are read once per 64 tokens instead of once per 8 (matmul.cu's decode kernels), and the
// products run on the tensor cores. Needs compute capability 8.0 (mma.sync with 8-bit and 16-bit operands);
// the CPU emulator runs the same code with the instruction emulated in the PTX ISA's fragment layouts.
#include <cuda_fp16.h>

#include <cstring>

#include "dequant.cuh"
#include "kernels.cuh"
#include "launch_matrices.cuh"
#include "optiml/common.h"

namespace optiml {

namespace {

constexpr int kTileRows = 64;       // weight rows per thread block
constexpr int kTileTokens = 64;     // tokens per thread block
constexpr int kStageBlocks = 8;     // 32-value blocks staged at a time (256 values)
constexpr int kThreads = 128;       // four warps, each a 32 x 32 corner of the tile
constexpr int kStride = kStageBlocks * 32 + 16;  // bytes per staged row: the padding spreads a warp's
                                                 // fragment loads over all 32 banks

struct alignas(16) TileShared {
    int8_t w[kTileRows][kStride];
    int8_t x[kTileTokens][kStride];
    // Per block: the weights' scale and min, the codes' scale and Q8_1's s (rows padded to 9 floats, so
    // that a warp's eight rows fall in different banks).
    float wd[kTileRows][kStageBlocks + 1], wm[kTileRows][kStageBlocks + 1];
    float xd[kTileTokens][kStageBlocks + 1], xs[kTileTokens][kStageBlocks + 1];
};

// The same for the K-quants: a stage is one super-block of 256 values per row, whose sub-blocks (Q4_K,
// Q5_K: 8 of 32 values, with a 6-bit scale and min; Q6_K, Q3_K: 16 of 16, with a signed scale; Q2_K: 16 of
// 16, with a 4-bit scale and min) each have their scale, and the codes' Q8_K scale is one per 256 values.
struct alignas(16) TileSharedK {
    int8_t w[kTileRows][kStride];
    int8_t x[kTileTokens][kStride];
    float d[kTileRows], dmin[kTileRows];
    int8_t sc[kTileRows][16];
    uint8_t mn[kTileRows][16];
    float xd[kTileTokens];
    int32_t xsum[kTileTokens][17];  // the codes' sum per sub-block with a min: 32 values (Q4_K, Q5_K), 16 (Q2_K)
};

struct alignas(16) Bytes16 {
    uint32_t w[4];
};

// D = A B + C for one m16n8k32 tile, 8-bit signed operands, 32-bit sums (PTX ISA fragment layouts: lane
// l = 4 g + t holds A's rows g and g + 8 at columns 4t..4t+3 and 16+4t.., B's column g at rows 4t.. and
// 16+4t.., and C's rows g and g + 8 at columns 2t, 2t + 1).
__device__ __forceinline__ void mma_s8(int c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // (the host launches this kernel only on compute capability 8.0 and later)
#endif
#elif !defined(__CUDACC__)
    optiml_emu::mma_m16n8k32_s8(c, a, b);
#endif
}

// The same for m16n8k16 (the sub-blocks of 16 of Q2_K, Q3_K and Q6_K): A's rows g and g + 8 at columns
// 4t..4t+3 (a[0], a[1]), B's column g at rows 4t.. (b).
__device__ __forceinline__ void mma_s8_k16(int c[4], const uint32_t a[2], uint32_t b) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(b));
#else
    __trap();
#endif
#elif !defined(__CUDACC__)
    optiml_emu::mma_m16n8k16_s8(c, a, b);
#endif
}

// D = A B + C for one m16n8k16 tile of F16 or BF16 operands with float sums (lane l = 4 g + t holds A's rows g
// and g + 8 at columns 2t, 2t + 1 and 2t + 8, 2t + 9, two values a register; B's column g at rows 2t, 2t + 1
// and 2t + 8, 2t + 9; C as mma_s8's).
template <int TYPE>
__device__ __forceinline__ void mma_f16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
    if (TYPE == TYPE_F16)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
#elif !defined(__CUDACC__)
    optiml_emu::mma_m16n8k16_f16(c, a, b, TYPE == TYPE_BF16);
#endif
}

// Four nibbles 0..15 (one per byte) as the signed bytes q - 8: flipping the top bit gives q - 8 in four
// bits, then the sign is extended into the byte (0x08 * 0x1E = 0xF0 never carries into the next byte).
__device__ __forceinline__ uint32_t nibbles_minus_8(uint32_t q) {
    const uint32_t x = q ^ 0x08080808u;
    return x | ((x & 0x08080808u) * 0x1Eu);
}

__device__ __forceinline__ uint32_t load_u32_a2(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}

// Four codes 0..127 (one per byte) as the signed bytes q - OFFSET: each byte is first raised by 128, so that
// none borrows from the next.
template <uint32_t OFFSET>
__device__ __forceinline__ uint32_t codes_minus(uint32_t q) {
    return ((q | 0x80808080u) - OFFSET * 0x01010101u) ^ 0x80808080u;
}

// Four codes 0..15 (one per byte) as their IQ4_NL table values (signed bytes).
__device__ __forceinline__ uint32_t iq4nl_bytes(uint32_t q) {
    uint32_t out = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) out |= (uint32_t)(uint8_t)cudaq::iq4nl_value((q >> (8 * k)) & 0xF) << (8 * k);
    return out;
}

// Bits 0-3 of b as bit 0 of bytes 0-3.
__device__ __forceinline__ uint32_t bits_to_bytes(uint32_t b) {
    return (b & 1u) | ((b & 2u) << 7) | ((b & 4u) << 14) | ((b & 8u) << 21);
}

// The 32-value formats with a min (value d q + m), whose blocks add m times the codes' sum.
template <int TYPE>
constexpr bool kWithMin = TYPE == TYPE_Q4_1 || TYPE == TYPE_Q5_1;

// Block kb of staged row `row` from one quantized block (nullptr: past the matrix, zeros): its 32 codes
// as signed bytes in x's order, its scale and its min (Q4_1, Q5_1).
template <int TYPE>
__device__ __forceinline__ void stage_weight_block(TileShared& sh, int row, int kb, const uint8_t* blk) {
    uint32_t* out = (uint32_t*)&sh.w[row][kb * 32];
    if (!blk) {
#pragma unroll
        for (int j = 0; j < 8; j++) out[j] = 0;
        sh.wd[row][kb] = 0.0f;
        sh.wm[row][kb] = 0.0f;
        return;
    }
    sh.wd[row][kb] = cudaq::half_to_float(cudaq::load_u16(blk));
    if (TYPE == TYPE_Q8_0) {
#pragma unroll
        for (int j = 0; j < 8; j++) out[j] = load_u32_a2(blk + 2 + 4 * j);
        sh.wm[row][kb] = 0.0f;
        return;
    }
    if (TYPE == TYPE_IQ4_NL) {  // nibbles as Q4_0's, each a value of the table
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t q = load_u32_a2(blk + 2 + 4 * j);
            out[j] = iq4nl_bytes(q & 0x0F0F0F0Fu);
            out[4 + j] = iq4nl_bytes((q >> 4) & 0x0F0F0F0Fu);
        }
        sh.wm[row][kb] = 0.0f;
        return;
    }
    constexpr bool q5 = TYPE == TYPE_Q5_0 || TYPE == TYPE_Q5_1;
    const int qh_at = kWithMin<TYPE> ? 4 : 2, qs_at = qh_at + (q5 ? 4 : 0);
    sh.wm[row][kb] = kWithMin<TYPE> ? cudaq::half_to_float(cudaq::load_u16(blk + 2)) : 0.0f;
    const uint32_t qh = q5 ? load_u32_a2(blk + qh_at) : 0;  // bit v: the fifth bit of value v
#pragma unroll
    for (int j = 0; j < 4; j++) {  // low nibbles are values 0-15, high nibbles 16-31
        const uint32_t q = load_u32_a2(blk + qs_at + 4 * j);
        uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
        if (q5) {
            lo |= bits_to_bytes(qh >> (4 * j)) << 4;
            hi |= bits_to_bytes(qh >> (16 + 4 * j)) << 4;
        }
        out[j] = TYPE == TYPE_Q4_0 ? nibbles_minus_8(lo) : TYPE == TYPE_Q5_0 ? codes_minus<16>(lo) : lo;
        out[4 + j] = TYPE == TYPE_Q4_0 ? nibbles_minus_8(hi) : TYPE == TYPE_Q5_0 ? codes_minus<16>(hi) : hi;
    }
}

// The tokens' codes of one stage: 64 rows of 256 bytes as 16-byte loads (zeros past n and past the row).
__device__ __forceinline__ void stage_codes(int8_t (*x)[kStride], const int8_t* __restrict__ codes, int64_t cols,
                                            int32_t n, int32_t tok0, int64_t b0, int tid) {
    const int64_t n_blocks = cols / 32;
    for (int j = tid; j < kTileTokens * kStageBlocks * 2; j += kThreads) {
        const int tok = j / (kStageBlocks * 2), part = j % (kStageBlocks * 2);
        const int64_t blk = b0 + part / 2;
        Bytes16 v = {};
        if (tok0 + tok < n && blk < n_blocks)
            v = *(const Bytes16*)(codes + (size_t)(tok0 + tok) * cols + blk * 32 + (part % 2) * 16);
        *(Bytes16*)&x[tok][part * 16] = v;
    }
}

// This lane's fragments of staged block kb: A from the warp's 32 weight rows (two 16-row tiles), B from its
// 32 tokens (four 8-token tiles), in the layouts mma_s8 takes.
__device__ __forceinline__ void load_fragments(const int8_t (*w)[kStride], const int8_t (*x)[kStride], int kb,
                                               int wrow, int wtok, int g, int t, uint32_t a[2][4], uint32_t b[4][2]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = wrow + 16 * i + g, c = kb * 32 + 4 * t;
        a[i][0] = *(const uint32_t*)&w[r][c];
        a[i][1] = *(const uint32_t*)&w[r + 8][c];
        a[i][2] = *(const uint32_t*)&w[r][c + 16];
        a[i][3] = *(const uint32_t*)&w[r + 8][c + 16];
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int tk = wtok + 8 * j + g, c = kb * 32 + 4 * t;
        b[j][0] = *(const uint32_t*)&x[tk][c];
        b[j][1] = *(const uint32_t*)&x[tk][c + 16];
    }
}

// The matrix of grid row blockIdx.y (a unit: a tile of kTileRows rows) and its first row there.
__device__ __forceinline__ CudaMatrix tile_matrix(const LaunchMatrices& ms, int64_t& row0) {
    unsigned tile_in;
    const CudaMatrix m = pick_matrix(ms, blockIdx.y, tile_in);
    row0 = (int64_t)tile_in * kTileRows;
    return m;
}

// The epilogue: the bias, and the add into y where the matrix accumulates (the residual stream).
__device__ __forceinline__ void store_tile(const CudaMatrix& m, const float (&acc)[2][4][4], int64_t row0, int32_t tok0,
                                           int wrow, int wtok, int g, int t, int32_t n) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t r = row0 + wrow + 16 * i + g + 8 * (e >> 1);
                const int32_t tk = tok0 + wtok + 8 * j + 2 * t + (e & 1);
                if (r >= m.rows || tk >= n) continue;
                float s = acc[i][j][e];
                if (m.bias) s += m.bias[r];
                float* out = m.y + (size_t)tk * m.rows + r;
                *out = m.accumulate ? *out + s : s;
            }
}

template <int TYPE>
__global__ void matmul_tiles_kernel(LaunchMatrices ms, int64_t cols, const int8_t* __restrict__ codes,
                                    const CudaQ8Meta* __restrict__ meta, int32_t n) {
    using Q = cudaq::QType<TYPE>;
    __shared__ TileShared sh;
    int64_t row0;
    const CudaMatrix m = tile_matrix(ms, row0);
    const int32_t tok0 = (int32_t)blockIdx.x * kTileTokens;
    const int64_t n_blocks = cols / 32;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wrow = (warp & 1) * 32, wtok = (warp >> 1) * 32;  // this warp's corner of the tile

    float acc[2][4][4] = {};
    for (int64_t b0 = 0; b0 < n_blocks; b0 += kStageBlocks) {
        __syncthreads();  // every warp is done with the previous stage
        // The weights: 64 rows x 8 blocks, consecutive threads on consecutive blocks of a row.
        for (int j = tid; j < kTileRows * kStageBlocks; j += kThreads) {
            const int row = j / kStageBlocks, kb = j % kStageBlocks;
            const int64_t r = row0 + row, blk = b0 + kb;
            const bool in = r < m.rows && blk < n_blocks;
            stage_weight_block<TYPE>(sh, row, kb, in ? m.w + (size_t)r * m.row_bytes + blk * Q::block_bytes : nullptr);
        }
        stage_codes(sh.x, codes, cols, n, tok0, b0, tid);
        for (int j = tid; j < kTileTokens * kStageBlocks; j += kThreads) {
            const int tok = j / kStageBlocks, kb = j % kStageBlocks;
            const int64_t blk = b0 + kb;
            float d = 0.0f, s = 0.0f;
            if (tok0 + tok < n && blk < n_blocks) {
                const CudaQ8Meta q = meta[(size_t)(tok0 + tok) * n_blocks + blk];
                d = q.d;
                s = q.s;
            }
            sh.xd[tok][kb] = d;
            sh.xs[tok][kb] = s;
        }
        __syncthreads();

        const int stage_blocks = n_blocks - b0 < kStageBlocks ? (int)(n_blocks - b0) : kStageBlocks;
        for (int kb = 0; kb < stage_blocks; kb++) {
            uint32_t a[2][4], b[4][2];
            load_fragments(sh.w, sh.x, kb, wrow, wtok, g, t, a, b);
            // The scales of this lane's rows (g, g + 8 of each 16) and tokens (2t, 2t + 1 of each 8).
            float wd[2][2], wm[2][2] = {}, xd[4][2], xs[4][2] = {};
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    wd[i][h] = sh.wd[wrow + 16 * i + g + 8 * h][kb];
                    if (kWithMin<TYPE>) wm[i][h] = sh.wm[wrow + 16 * i + g + 8 * h][kb];
                }
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    xd[j][h] = sh.xd[wtok + 8 * j + 2 * t + h][kb];
                    if (kWithMin<TYPE>) xs[j][h] = sh.xs[wtok + 8 * j + 2 * t + h][kb];
                }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int sum[4] = {0, 0, 0, 0};
                    mma_s8(sum, a[i], b[j]);
#pragma unroll
                    for (int e = 0; e < 4; e++) {  // the CPU's scaling of one block's integer sum
                        float v = (float)sum[e] * (wd[i][e >> 1] * xd[j][e & 1]);
                        if (kWithMin<TYPE>) v += wm[i][e >> 1] * xs[j][e & 1];
                        acc[i][j][e] += v;
                    }
                }
        }
    }

    store_tile(m, acc, row0, tok0, wrow, wtok, g, t, n);
}

// A K-quant block's j-th 6-bit scale and min (the CPU's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// A staged half super-block past the matrix's rows: zero codes, scales, mins (its n_sub sub-blocks) and d.
__device__ __forceinline__ void clear_staged_half(TileSharedK& sh, int row, int half, int n_sub) {
    uint32_t* out = (uint32_t*)&sh.w[row][128 * half];
#pragma unroll
    for (int w = 0; w < 32; w++) out[w] = 0;
    for (int k = 0; k < n_sub; k++) sh.sc[row][n_sub * half + k] = sh.mn[row][n_sub * half + k] = 0;
    if (half == 0) sh.d[row] = sh.dmin[row] = 0.0f;
}

// Half `half` (values 128 half .. 128 half + 127, sub-blocks 4 half ..) of a Q4_K/Q5_K super-block into
// staged row `row` (blk nullptr: past the matrix, zeros): codes 0..31 as bytes in x's order (the CPU's
// unpacking: value 64 j + l is the low nibble of qs[32 j + l], value 64 j + 32 + l its high nibble, and
// Q5_K's fifth bits from qh[l]), with the sub-blocks' scales and mins and the block's d and dmin.
template <int TYPE>
__device__ __forceinline__ void stage_superblock(TileSharedK& sh, int row, int half, const uint8_t* blk) {
    if (!blk) return clear_staged_half(sh, row, half, 4);
    uint32_t* out = (uint32_t*)&sh.w[row][128 * half];
    if (half == 0) {
        sh.d[row] = cudaq::half_to_float(cudaq::load_u16(blk));
        sh.dmin[row] = cudaq::half_to_float(cudaq::load_u16(blk + 2));
    }
    for (int k = 0; k < 4; k++) {
        uint8_t sc, m;
        scale_min_k4(4 * half + k, blk + 4, sc, m);
        sh.sc[row][4 * half + k] = (int8_t)sc;  // (at most 63)
        sh.mn[row][4 * half + k] = m;
    }
    const uint8_t* qs = blk + (TYPE == TYPE_Q5_K ? 48 : 16);
    const uint8_t* qh = blk + 16;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int jj = 2 * half + p;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const uint32_t q = load_u32_a2(qs + 32 * jj + 4 * w);
            uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
            if (TYPE == TYPE_Q5_K) {
                const uint32_t h = load_u32_a2(qh + 4 * w);
                lo |= ((h >> (2 * jj)) & 0x01010101u) << 4;
                hi |= ((h >> (2 * jj + 1)) & 0x01010101u) << 4;
            }
            out[16 * p + w] = lo;
            out[16 * p + 8 + w] = hi;
        }
    }
}

// Half `half` of an IQ4_XS super-block (sub-blocks 4 half .. 4 half + 3 of 32 values): sub-block ib's values 0-15
// from the low nibbles of qs[16 ib ..], 16-31 from the high ones, each its table value; the sub-blocks' scales
// (six bits, less 32) and d.
__device__ __forceinline__ void stage_superblock_iq4xs(TileSharedK& sh, int row, int half, const uint8_t* blk) {
    if (!blk) return clear_staged_half(sh, row, half, 4);
    uint32_t* out = (uint32_t*)&sh.w[row][128 * half];
    const int scales_h = cudaq::load_u16(blk + 2);
    for (int k = 0; k < 4; k++) {
        const int ib = 4 * half + k;
        const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4);
        sh.sc[row][ib] = (int8_t)(ls - 32);
        sh.mn[row][ib] = 0;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const uint32_t q = load_u32_a2(blk + 8 + 16 * ib + 4 * w);
            out[8 * k + w] = iq4nl_bytes(q & 0x0F0F0F0Fu);
            out[8 * k + 4 + w] = iq4nl_bytes((q >> 4) & 0x0F0F0F0Fu);
        }
    }
    if (half == 0) {
        sh.d[row] = cudaq::half_to_float(cudaq::load_u16(blk));
        sh.dmin[row] = 0.0f;
    }
}

// Half `half` of a Q6_K super-block (values 128 half ..) into staged row `row`, as the CPU unpacks it: value
// 128 h + l of the four quarters from ql[64 h + l] and ql[64 h + 32 + l] (low, then high nibbles) and two bits
// of qh[32 h + l] each, minus 32; the 8 scales of those values' sub-blocks of 16, and d.
__device__ __forceinline__ void stage_superblock_q6(TileSharedK& sh, int row, int half, const uint8_t* blk) {
    if (!blk) return clear_staged_half(sh, row, half, 8);
    uint32_t* out = (uint32_t*)&sh.w[row][128 * half];
    const uint8_t* ql = blk + 64 * half;
    const uint8_t* qh = blk + 128 + 32 * half;
#pragma unroll
    for (int w = 0; w < 8; w++) {
        const uint32_t l0 = load_u32_a2(ql + 4 * w), l1 = load_u32_a2(ql + 32 + 4 * w), h = load_u32_a2(qh + 4 * w);
        out[w] = codes_minus<32>((l0 & 0x0F0F0F0Fu) | ((h & 0x03030303u) << 4));
        out[8 + w] = codes_minus<32>((l1 & 0x0F0F0F0Fu) | (((h >> 2) & 0x03030303u) << 4));
        out[16 + w] = codes_minus<32>(((l0 >> 4) & 0x0F0F0F0Fu) | (((h >> 4) & 0x03030303u) << 4));
        out[24 + w] = codes_minus<32>(((l1 >> 4) & 0x0F0F0F0Fu) | (((h >> 6) & 0x03030303u) << 4));
    }
    for (int k = 0; k < 8; k++) sh.sc[row][8 * half + k] = (int8_t)blk[192 + 8 * half + k];
    if (half == 0) sh.d[row] = cudaq::half_to_float(cudaq::load_u16(blk + 208));
}

// Half `half` of a Q2_K or Q3_K super-block (values 128 half ..) into staged row `row`, as the CPU unpacks it:
// value 128 h + 32 j + l is bits 2j, 2j + 1 of qs[32 h + l] (Q3_K: with bit 4h + j of hmask[l] as its third bit,
// minus 4); the 8 sub-blocks' scales (Q3_K: signed 6 bits; Q2_K: the low nibble, the min the high one), d and
// dmin.
template <int TYPE>
__device__ __forceinline__ void stage_superblock_2bit(TileSharedK& sh, int row, int half, const uint8_t* blk) {
    if (!blk) return clear_staged_half(sh, row, half, 8);
    uint32_t* out = (uint32_t*)&sh.w[row][128 * half];
    constexpr bool q3 = TYPE == TYPE_Q3_K;
    const uint8_t* qs = blk + (q3 ? offsetof(block_q3_K, qs) : offsetof(block_q2_K, qs)) + 32 * half;
#pragma unroll
    for (int w = 0; w < 8; w++) {
        const uint32_t q = load_u32_a2(qs + 4 * w);
        const uint32_t hm = q3 ? load_u32_a2(blk + offsetof(block_q3_K, hmask) + 4 * w) : 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t lo = (q >> (2 * j)) & 0x03030303u;
            out[8 * j + w] = q3 ? codes_minus<4>(lo | (((hm >> (4 * half + j)) & 0x01010101u) << 2)) : lo;
        }
    }
    for (int k = 0; k < 8; k++) {
        const int sb = 8 * half + k;
        if (q3) {
            sh.sc[row][sb] = (int8_t)cudaq::q3_K_scale(sb, blk + offsetof(block_q3_K, scales));
        } else {
            const uint8_t b = blk[offsetof(block_q2_K, scales) + sb];
            sh.sc[row][sb] = (int8_t)(b & 0xF);
            sh.mn[row][sb] = b >> 4;
        }
    }
    if (half == 0) {
        sh.d[row] = cudaq::half_to_float(cudaq::load_u16(blk + (q3 ? offsetof(block_q3_K, d) : offsetof(block_q2_K, d))));
        sh.dmin[row] = q3 ? 0.0f : cudaq::half_to_float(cudaq::load_u16(blk + offsetof(block_q2_K, dmin)));
    }
}

// The integer sums of one staged super-block of 16-value sub-blocks (Q2_K, Q3_K, Q6_K): each sub-block
// multiplied by m16n8k16 and weighted by its scale.
__device__ __forceinline__ void sums16(const TileSharedK& sh, int wrow, int wtok, int g, int t, int (&isum)[2][4][4]) {
    for (int kb = 0; kb < 16; kb++) {
        const int c = 16 * kb + 4 * t;
        uint32_t a[2][2], b[4];
        int sc[2][2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int r = wrow + 16 * i + g;
            a[i][0] = *(const uint32_t*)&sh.w[r][c];
            a[i][1] = *(const uint32_t*)&sh.w[r + 8][c];
            sc[i][0] = sh.sc[r][kb];
            sc[i][1] = sh.sc[r + 8][kb];
        }
#pragma unroll
        for (int j = 0; j < 4; j++) b[j] = *(const uint32_t*)&sh.x[wtok + 8 * j + g][c];
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int sum[4] = {0, 0, 0, 0};
                mma_s8_k16(sum, a[i], b[j]);
#pragma unroll
                for (int e = 0; e < 4; e++) isum[i][j][e] += sc[i][e >> 1] * sum[e];
            }
    }
}

// Sub-block sb's min (of this lane's rows) times the codes' sum over it (of its tokens), into msum: exact
// integers, in any order.
__device__ __forceinline__ void add_mins(const TileSharedK& sh, int sb, int wrow, int wtok, int g, int t,
                                         int (&msum)[2][4][4]) {
    int mn[2][2], xs[4][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) mn[i][h] = sh.mn[wrow + 16 * i + g + 8 * h][sb];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) xs[j][h] = sh.xsum[wtok + 8 * j + 2 * t + h][sb];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) msum[i][j][e] += mn[i][e >> 1] * xs[j][e & 1];
}

// The K-quants whose sub-blocks are 16 values (multiplied by m16n8k16), and those with mins.
template <int TYPE>
constexpr bool kSub16 = TYPE == TYPE_Q2_K || TYPE == TYPE_Q3_K || TYPE == TYPE_Q6_K;
template <int TYPE>
constexpr bool kKMin = TYPE == TYPE_Q2_K || TYPE == TYPE_Q4_K || TYPE == TYPE_Q5_K;

// The tiles for the K-quants (Q2_K-Q6_K, IQ4_XS) with Q8_K codes (kCudaCodesK): per super-block and (row, token),
// the sub-blocks' integer sums weighted by their scales, and (Q2_K, Q4_K, Q5_K) their mins by the codes'
// sums, in integers, then the CPU's float steps (simd_kquants.h): acc = fma(float(isum), d * x.d, acc) and
// acc = fma(float(summs), -dmin * x.d, acc) (Q3_K and Q6_K: the first, with the codes' offsets taken out
// of isum, which is the CPU's isum - corr; IQ4_XS: the first too, its codes the table's values and its scales
// six bits less 32, where the CPU multiplies, then adds).
template <int TYPE>
__global__ void matmul_tiles_k_kernel(LaunchMatrices ms, int64_t cols, const int8_t* __restrict__ codes,
                                      const CudaQ8Meta* __restrict__ meta, int32_t n) {
    using Q = cudaq::QType<TYPE>;
    static_assert(Q::block_size == 32 * kStageBlocks, "a stage is one super-block");
    __shared__ TileSharedK sh;
    int64_t row0;
    const CudaMatrix m = tile_matrix(ms, row0);
    const int32_t tok0 = (int32_t)blockIdx.x * kTileTokens;
    const int64_t n_blocks = cols / 32;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wrow = (warp & 1) * 32, wtok = (warp >> 1) * 32;

    float acc[2][4][4] = {};
    for (int64_t b0 = 0; b0 < n_blocks; b0 += kStageBlocks) {
        __syncthreads();
        static_assert(kThreads == 2 * kTileRows, "two threads per row's super-block");
        const int64_t r = row0 + tid / 2;
        const uint8_t* blk = r < m.rows ? m.w + (size_t)r * m.row_bytes + (b0 / kStageBlocks) * Q::block_bytes : nullptr;
        if (TYPE == TYPE_Q6_K) stage_superblock_q6(sh, tid / 2, tid % 2, blk);
        else if (TYPE == TYPE_Q2_K || TYPE == TYPE_Q3_K) stage_superblock_2bit<TYPE>(sh, tid / 2, tid % 2, blk);
        else if (TYPE == TYPE_IQ4_XS) stage_superblock_iq4xs(sh, tid / 2, tid % 2, blk);
        else stage_superblock<TYPE>(sh, tid / 2, tid % 2, blk);
        stage_codes(sh.x, codes, cols, n, tok0, b0, tid);
        for (int j = tid; j < kTileTokens * kStageBlocks; j += kThreads) {
            const int tok = j / kStageBlocks, kb = j % kStageBlocks;
            CudaQ8Meta q{};
            if (tok0 + tok < n) q = meta[(size_t)(tok0 + tok) * n_blocks + b0 + kb];
            if (kb == 0) sh.xd[tok] = q.d;
            if (TYPE != TYPE_Q2_K) sh.xsum[tok][kb] = q.sum;
        }
        if (TYPE == TYPE_Q2_K)  // its mins are per 16 values: the codes' sums per 16, from the codes
            for (int j = tid; j < kTileTokens * 16; j += kThreads) {
                const int tok = j / 16, sb = j % 16;
                int sum = 0;
                if (tok0 + tok < n) {  // (16 codes at a multiple of 16 bytes: the rows are whole super-blocks)
                    const Bytes16 c = *(const Bytes16*)(codes + (size_t)(tok0 + tok) * cols + b0 * 32 + 16 * sb);
#pragma unroll
                    for (int i = 0; i < 16; i++) sum += (int8_t)(c.w[i / 4] >> (8 * (i % 4)));
                }
                sh.xsum[tok][sb] = sum;
            }
        __syncthreads();

        int isum[2][4][4] = {}, msum[2][4][4] = {};
        if (kSub16<TYPE>) {
            sums16(sh, wrow, wtok, g, t, isum);
            if (TYPE == TYPE_Q2_K)
                for (int sb = 0; sb < 16; sb++) add_mins(sh, sb, wrow, wtok, g, t, msum);
        } else {
        for (int kb = 0; kb < kStageBlocks; kb++) {
            uint32_t a[2][4], b[4][2];
            load_fragments(sh.w, sh.x, kb, wrow, wtok, g, t, a, b);
            int sc[2][2];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int h = 0; h < 2; h++) sc[i][h] = sh.sc[wrow + 16 * i + g + 8 * h][kb];
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int sum[4] = {0, 0, 0, 0};
                    mma_s8(sum, a[i], b[j]);
#pragma unroll
                    for (int e = 0; e < 4; e++) isum[i][j][e] += sc[i][e >> 1] * sum[e];
                }
            if (kKMin<TYPE>) add_mins(sh, kb, wrow, wtok, g, t, msum);
        }
        }
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = wrow + 16 * i + g + 8 * (e >> 1), tk = wtok + 8 * j + 2 * t + (e & 1);
                    const float xd = sh.xd[tk];
                    acc[i][j][e] = fmaf((float)isum[i][j][e], sh.d[r] * xd, acc[i][j][e]);
                    if (kKMin<TYPE>) acc[i][j][e] = fmaf((float)msum[i][j][e], -sh.dmin[r] * xd, acc[i][j][e]);
                }
    }
    store_tile(m, acc, row0, tok0, wrow, wtok, g, t, n);
}

// F16 and BF16 weights: a stage is 128 values of the 64 rows (their 16-bit values as they are stored) and of
// the 64 tokens' activations, which the CPU's path has already rounded to the weights' type (so converting
// them to its 16 bits is exact); each warp's 32 x 32 corner as m16n8k16 tiles with float sums.
constexpr int kStageHalves = 128;
constexpr int kStrideHalves = kStageHalves + 8;  // 272 bytes a staged row: a warp's fragment loads hit 32 banks

struct alignas(16) TileSharedF {
    uint16_t w[kTileRows][kStrideHalves];
    uint16_t x[kTileTokens][kStrideHalves];
};

template <int TYPE>
__device__ __forceinline__ uint32_t bits16(float v) {
    if (TYPE == TYPE_BF16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        return u >> 16;  // (v is a BF16 value: its low half is zero)
    }
    const __half h = __float2half_rn(v);
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

template <int TYPE>
__global__ void matmul_tiles_f_kernel(LaunchMatrices ms, int64_t cols, const float* __restrict__ x, int32_t n) {
    __shared__ TileSharedF sh;
    int64_t row0;
    const CudaMatrix m = tile_matrix(ms, row0);
    const int32_t tok0 = (int32_t)blockIdx.x * kTileTokens;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int wrow = (warp & 1) * 32, wtok = (warp >> 1) * 32;
    constexpr int kPairs = kStageHalves / 2;

    float acc[2][4][4] = {};
    for (int64_t c0 = 0; c0 < cols; c0 += kStageHalves) {
        __syncthreads();
        for (int j = tid; j < kTileRows * kPairs; j += kThreads) {  // two values at a time (rows 2-byte aligned)
            const int row = j / kPairs, p = j % kPairs;
            const int64_t r = row0 + row, c = c0 + 2 * p;
            *(uint32_t*)&sh.w[row][2 * p] = r < m.rows && c < cols ? load_u32_a2(m.w + (size_t)r * m.row_bytes + 2 * c) : 0;
        }
        for (int j = tid; j < kTileTokens * kPairs; j += kThreads) {
            const int tok = j / kPairs, p = j % kPairs;
            const int64_t c = c0 + 2 * p;
            uint32_t v = 0;
            if (tok0 + tok < n && c < cols) {
                const float* xp = x + (size_t)(tok0 + tok) * cols + c;
                v = bits16<TYPE>(xp[0]) | (bits16<TYPE>(xp[1]) << 16);
            }
            *(uint32_t*)&sh.x[tok][2 * p] = v;
        }
        __syncthreads();

        const int steps = (int)(((cols - c0 < kStageHalves ? cols - c0 : kStageHalves) + 15) / 16);
        for (int ks = 0; ks < steps; ks++) {
            const int k = 16 * ks + 2 * t;
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const int r = wrow + 16 * i + g;
                a[i][0] = *(const uint32_t*)&sh.w[r][k];
                a[i][1] = *(const uint32_t*)&sh.w[r + 8][k];
                a[i][2] = *(const uint32_t*)&sh.w[r][k + 8];
                a[i][3] = *(const uint32_t*)&sh.w[r + 8][k + 8];
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int tk = wtok + 8 * j + g;
                b[j][0] = *(const uint32_t*)&sh.x[tk][k];
                b[j][1] = *(const uint32_t*)&sh.x[tk][k + 8];
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) mma_f16<TYPE>(acc[i][j], a[i], b[j]);
        }
    }
    store_tile(m, acc, row0, tok0, wrow, wtok, g, t, n);
}

// The grid of a tiled launch (token tiles by row tiles), with the traffic of its weights and outputs; every
// matrix reads all n rows of its input.
dim3 tile_grid(const LaunchMatrices& ms, const CudaMatrix* m, int count, int32_t n, CudaTraffic& traffic) {
    const int64_t token_tiles = (n + kTileTokens - 1) / kTileTokens;
    for (int k = 0; k < count; k++) {
        if (m[k].ids || m[k].n >= 0 || m[k].x_row != 0)
            throw Error("internal: the tiled products take every row of their input");
        traffic.weights += m[k].rows * (int64_t)m[k].row_bytes * token_tiles + (m[k].bias ? 4 * m[k].rows : 0);
        traffic.activations += (m[k].accumulate ? 8 : 4) * (int64_t)n * m[k].rows;
    }
    if (ms.units > 65535)
        throw ArgumentError(format("cuda tiled product: %u row tiles is more than one launch holds", ms.units));
    return dim3((unsigned)token_tiles, ms.units);
}

}  // namespace

bool cuda_matmul_tiles_f_reads(int32_t type) { return type == TYPE_F16 || type == TYPE_BF16; }

void cuda_matmul_f_tiles(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols, const float* x,
                         int32_t n) {
    if (n <= 0) return;
    if (cols % 2 != 0) throw Error("internal: the F16/BF16 tiles take rows of an even number of values");
    const LaunchMatrices ms = launch_matrices(m, count, kTileRows);
    CudaTraffic traffic;
    const dim3 grid = tile_grid(ms, m, count, n, traffic);
    if (ms.units == 0) return;
    switch (type) {
        case TYPE_F16: OPTIML_LAUNCH(matmul_tiles_f_kernel<TYPE_F16>, grid, kThreads, s, ms, cols, x, n); break;
        case TYPE_BF16: OPTIML_LAUNCH(matmul_tiles_f_kernel<TYPE_BF16>, grid, kThreads, s, ms, cols, x, n); break;
        default: throw Error("internal: the float tiles read F16 and BF16 weights only");
    }
    cuda_check(cudaSuccess, "matmul (tiles)");
    // (the activations are read once per row tile; the L2 cache serves most of it, counted once)
    traffic.activations += 4 * (int64_t)n * cols;
    cuda_count(CudaKernel::MatmulTiles, traffic);
}

bool cuda_matmul_tiles_reads(int32_t type) {
    switch (type) {
        case TYPE_Q4_0: case TYPE_Q4_1: case TYPE_Q5_0: case TYPE_Q5_1: case TYPE_Q8_0:
        case TYPE_Q2_K: case TYPE_Q3_K: case TYPE_Q4_K: case TYPE_Q5_K: case TYPE_Q6_K:
        case TYPE_IQ4_NL: case TYPE_IQ4_XS: return true;
        default: return false;
    }
}

int32_t cuda_tile_codes(int32_t type) {
    return type == TYPE_Q2_K || type == TYPE_Q3_K || type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ||
                   type == TYPE_IQ4_XS
               ? kCudaCodesK
               : kCudaCodes;
}

void cuda_matmul_q8x_tiles(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                           const int8_t* codes, const CudaQ8Meta* meta, int32_t n) {
    if (n <= 0) return;
    if (cols % (cuda_tile_codes(type) == kCudaCodesK ? 256 : 32) != 0)
        throw Error("internal: the tiled products take rows of whole blocks");
    const LaunchMatrices ms = launch_matrices(m, count, kTileRows);
    CudaTraffic traffic;
    const dim3 grid = tile_grid(ms, m, count, n, traffic);
    if (ms.units == 0) return;
    switch (type) {
        case TYPE_Q4_0: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_Q4_0>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q4_1: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_Q4_1>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q5_0: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_Q5_0>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q5_1: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_Q5_1>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q8_0: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_Q8_0>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q2_K: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_Q2_K>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q3_K: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_Q3_K>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_IQ4_NL: OPTIML_LAUNCH(matmul_tiles_kernel<TYPE_IQ4_NL>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_IQ4_XS: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_IQ4_XS>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q4_K: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_Q4_K>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q5_K: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_Q5_K>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        case TYPE_Q6_K: OPTIML_LAUNCH(matmul_tiles_k_kernel<TYPE_Q6_K>, grid, kThreads, s, ms, cols, codes, meta, n); break;
        default: throw Error("internal: the tiled products read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL and IQ4_XS "
                             "weights only");
    }
    cuda_check(cudaSuccess, "matmul (tiles)");
    // (the codes are read once per row tile; the L2 cache serves most of it, counted once)
    traffic.activations += (int64_t)n * (cols + (int64_t)sizeof(CudaQ8Meta) * (cols / 32));
    cuda_count(CudaKernel::MatmulTiles, traffic);
}

}  // namespace optiml
