// Products of quantized weights with float activations on the GPU: one warp per weight row, applying each
// dequantized group of eight values (dequant.cuh, the same arithmetic as the CPU's dequantization) to up
// to kTokens tokens, then the lanes' sums added through shared memory. A prompt runs as kTokens-token
// slices of the grid, each reading the weights again: correct at any batch size, fast only for decode.
// A launch of one token a matrix (batch-1 decode, experts chosen on the GPU) takes the kernels built for
// one token: the registers that eight tokens' accumulators and unrolled loops take in the batch kernels
// hold a second chunk of the row in flight instead (two chunks read ahead, not one, for about the same
// registers: ptxas, sm_90, the integer path 61-64 either way, Q4_K 100 -> 102, Q8_0's float path
// 128 -> 99, Q6_K 236 -> 244). Both sum a token's products in the same order, so they give the same bits.
//
// Rows whose bytes are 16-byte aligned (every common shape) take the staged kernel: the warp reads its
// row a chunk at a time with coalesced 16-byte loads into shared memory, the next chunk's loads in flight
// while the lanes decode the current one from there (a block is only 2-byte aligned, so decoding straight
// from global memory means byte loads, few bytes in flight, and a bandwidth far under the memory's).
#include <algorithm>
#include <atomic>

#include "dequant.cuh"
#include "kernels.cuh"
#include "launch_matrices.cuh"
#include "optiml/common.h"
#include "optiml/cuda.h"

namespace optiml {

namespace {

constexpr int kTokens = 8;        // tokens one warp carries per dequantized group (batches)
constexpr int kRowsPerBlock = 4;  // warps (rows) per thread block

using Matrices = LaunchMatrices;  // (a unit: a thread block of kRowsPerBlock rows)

// This warp's matrix and row (r: past the matrix's rows for the last block's spare warps).
__device__ __forceinline__ CudaMatrix pick_row(const Matrices& ms, int64_t& r) {
    unsigned block_in;
    const CudaMatrix m = pick_matrix(ms, blockIdx.x, block_in);
    r = (int64_t)block_in * kRowsPerBlock + threadIdx.y;
    return m;
}

Matrices make_matrices(const CudaMatrix* m, int count) {
    if (count < 1 || count > kCudaMaxMatrices) throw Error("internal: 1 to 16 matrices per product launch");
    for (int k = 0; k < count; k++)
        if ((m[k].ids != nullptr) != (m[0].ids != nullptr) || (m[k].ids && m[k].n != m[0].n))
            throw Error("internal: a launch's matrices are all chosen on the GPU, over the same slots, or none");
    return launch_matrices(m, count, kRowsPerBlock);
}
unsigned total_blocks(const Matrices& ms) { return ms.units; }

// A warp's work: row r of matrix m (r >= m.rows for the last block's spare warps, which leave at once: r
// depends on the warp only) for the matrix's tokens t0 .. t0 + nt - 1 of this grid row's slice, input rows
// x0 + t0 .. (nt <= 0: the matrix has fewer tokens than the launch; the warps leave).
struct RowTask {
    CudaMatrix m;
    int64_t r;
    int32_t t0;
    int nt;
    int32_t x0;
};
template <int NT>
__device__ __forceinline__ RowTask row_task(const Matrices& ms, int32_t n) {
    RowTask k;
    k.m = pick_row(ms, k.r);
    if (k.m.ids) {  // slot blockIdx.y: its expert's matrix, one input row, one output row
        const int32_t j = (int32_t)blockIdx.y;
        k.m.w += (size_t)k.m.ids[j] * k.m.id_stride;
        k.m.y += (size_t)j * k.m.rows;
        k.t0 = 0;
        k.nt = 1;
        k.x0 = j / k.m.x_group;
        return k;
    }
    const int32_t nm = k.m.n < 0 ? n : k.m.n;
    k.t0 = (int32_t)blockIdx.y * NT;
    k.nt = nm - k.t0 < NT ? nm - k.t0 : NT;
    k.x0 = k.m.x_row;
    return k;
}

// The warp's 32 partial sums of each token through shared memory (`partial`: the warp's [NT][33]),
// lane t adding token t's: one exchange for all tokens instead of a five-shuffle tree per token. Then
// the matrix's epilogue: its bias, and the add into y (the residual stream) when it accumulates.
template <int NT>
__device__ __forceinline__ void write_row(float (*partial)[33], const float* acc, int nt, int lane,
                                          const CudaMatrix& m, int64_t r, int32_t t0) {
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < nt) partial[t][lane] = acc[t];
    __syncwarp();
    if (lane < nt) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += partial[lane][i];
        if (m.bias) s += m.bias[r];
        float* out = m.y + (size_t)(t0 + lane) * m.rows + r;
        *out = m.accumulate ? *out + s : s;
    }
}

template <int TYPE, int NT>
__global__ void matmul_kernel(Matrices ms, int64_t cols, const float* __restrict__ x, int32_t n) {
    using Q = cudaq::QType<TYPE>;
    const int lane = threadIdx.x;
    const auto [m, r, t0, nt, x0] = row_task<NT>(ms, n);
    if (r >= m.rows || nt <= 0) return;
    const uint8_t* row = m.w + (size_t)r * m.row_bytes;

    float acc[NT] = {};
    for (int64_t c = (int64_t)lane * 8; c < cols; c += 32 * 8) {
        float v[8];
        Q::dequant8(row + (size_t)(c / Q::block_size) * Q::block_bytes, (int)(c % Q::block_size), v);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const float* xt = x + (size_t)(x0 + t0 + t) * cols + c;
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) s += v[i] * xt[i];
            acc[t] += s;
        }
    }
    __shared__ float partial[kRowsPerBlock][NT][33];  // (33: lanes hit different banks)
    write_row<NT>(partial[threadIdx.y], acc, nt, lane, m, r, t0);
}

struct alignas(16) Bytes16 {
    uint32_t w[4];
};
struct alignas(16) Floats4 {
    float v[4];
};

// The staged kernel's chunk of a row for type Q: whole blocks, at least 1024 values, a multiple of 16
// bytes (so every chunk starts 16-byte aligned when the row does).
template <int TYPE>
struct Chunk {
    using Q = cudaq::QType<TYPE>;
    static constexpr int blocks() {
        int b = (1024 + Q::block_size - 1) / Q::block_size;
        while ((b * Q::block_bytes) % 16 != 0) b *= 2;
        return b;
    }
    static constexpr int kBlocks = blocks();
    static constexpr int kValues = kBlocks * Q::block_size;
    static constexpr int kBytes = kBlocks * Q::block_bytes;
    static constexpr int kLoads = (kBytes / 16 + 31) / 32;  // 16-byte loads per lane
    static constexpr int kGroups = kValues / 8;             // groups of eight values (a multiple of 32)
};

// A warp's row, a chunk at a time through the warp's shared memory `stage`, with the loads of the next
// DEPTH chunks in flight in registers, slot s holding the chunks whose index is s modulo DEPTH: construction
// starts the 16-byte loads of the first DEPTH chunks (bytes past the row: none); advance(s, c0) stores
// chunk c0, held in slot s, into `stage` once every lane is done with the previous chunk, then starts the
// loads of chunk c0 + DEPTH chunks into the same slot. The kernels walk a row's chunks DEPTH at a time with
// the inner loop unrolled, so that s is a constant in each copy: a register array indexed at run time
// would live in local memory, and moving a chunk from one slot to another would wait for its loads.
template <int TYPE, int DEPTH>
struct RowStager {
    using C = Chunk<TYPE>;
    const Bytes16* row;
    int64_t row_units, cols;
    int lane;
    Bytes16* stage;
    Bytes16 next[DEPTH][C::kLoads] = {};

    __device__ __forceinline__ RowStager(const CudaMatrix& m, int64_t r, int64_t cols_, int lane_, Bytes16* stage_)
        : row((const Bytes16*)(m.w + (size_t)r * m.row_bytes)), row_units((int64_t)(m.row_bytes / 16)),
          cols(cols_), lane(lane_), stage(stage_) {
#pragma unroll
        for (int d = 0; d < DEPTH; d++)
            if ((int64_t)d * C::kValues < cols) fetch(next[d], (int64_t)d * C::kValues);
    }
    __device__ __forceinline__ void fetch(Bytes16 (&into)[C::kLoads], int64_t c0) {
        const int64_t u0 = c0 / cudaq::QType<TYPE>::block_size * cudaq::QType<TYPE>::block_bytes / 16;
#pragma unroll
        for (int i = 0; i < C::kLoads; i++) {
            const int u = lane + 32 * i;
            if (u < C::kBytes / 16 && u0 + u < row_units) into[i] = row[u0 + u];
        }
    }
    __device__ __forceinline__ void advance(int s, int64_t c0) {
        __syncwarp();
#pragma unroll
        for (int i = 0; i < C::kLoads; i++) {
            const int u = lane + 32 * i;
            if (u < C::kBytes / 16) stage[u] = next[s][i];
        }
        __syncwarp();
        const int64_t ahead = c0 + (int64_t)DEPTH * C::kValues;
        if (ahead < cols) fetch(next[s], ahead);
    }
};

// Chunks a warp reads ahead of the one it computes: the one-token kernels have the registers for two.
template <int NT>
constexpr int kReadAhead = NT == 1 ? 2 : 1;

// Whether the staged kernel decodes a whole chunk's groups before it loads their activations (the loads of
// every group in flight at once), or decodes and applies one group at a time. One at a time for one token
// of the types whose decoding takes the most registers: Q6_K's and Q3_K's whole chunk took 244 registers a
// thread, 8 warps a multiprocessor; a group at a time takes 80 and 56 (ptxas, sm_90), with the activations
// (a token's few KB) from the cache. Both add in the same order: the same bits.
template <int TYPE, int NT>
constexpr bool kWholeChunks = !(NT == 1 && (TYPE == TYPE_Q6_K || TYPE == TYPE_Q3_K));

// A thread block's shared memory in the staged kernels: each warp's chunk of its row and its partial sums.
template <int TYPE, int NT>
struct StagedShared {
    Bytes16 stage[kRowsPerBlock][Chunk<TYPE>::kBytes / 16];
    float partial[kRowsPerBlock][NT][33];  // (33: lanes hit different banks)
};

template <int TYPE, int NT>
__global__ void matmul_staged_kernel(Matrices ms, int64_t cols, const float* __restrict__ x, int32_t n) {
    using Q = cudaq::QType<TYPE>;
    using C = Chunk<TYPE>;
    __shared__ StagedShared<TYPE, NT> sh;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const auto [m, r, t0, nt, x0] = row_task<NT>(ms, n);
    if (r >= m.rows || nt <= 0) return;
    RowStager<TYPE, kReadAhead<NT>> rs(m, r, cols, lane, sh.stage[warp]);
    const uint8_t* chunk = (const uint8_t*)sh.stage[warp];

    constexpr int D = kReadAhead<NT>;
    float acc[NT] = {};
    for (int64_t c = 0; c < cols; c += D * C::kValues)
#pragma unroll
    for (int s = 0; s < D; s++) {  // (s: the chunk's RowStager slot, a constant in each unrolled copy)
        const int64_t c0 = c + s * C::kValues;
        if (c0 >= cols) break;
        rs.advance(s, c0);
        const int64_t valid = cols - c0 < C::kValues ? cols - c0 : C::kValues;
        if (kWholeChunks<TYPE, NT> && valid == C::kValues) {
            // A whole chunk: each lane's groups decoded, then their activations loaded together, so the
            // loads of every group are in flight at once rather than one group's at a time.
            constexpr int G = C::kGroups / 32;
            float v[G][8];
#pragma unroll
            for (int k = 0; k < G; k++) {
                const int v0 = 8 * (lane + 32 * k);
                Q::dequant8(chunk + (v0 / Q::block_size) * Q::block_bytes, v0 % Q::block_size, v[k]);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const float* xt = x + (size_t)(x0 + t0 + t) * cols + c0;
                Floats4 xa[G][2];
#pragma unroll
                for (int k = 0; k < G; k++) {
                    const Floats4* p = (const Floats4*)(xt + 8 * (lane + 32 * k));
                    xa[k][0] = p[0];
                    xa[k][1] = p[1];
                }
#pragma unroll
                for (int k = 0; k < G; k++) {  // (the sums in the tail loop's order: the same bits either way)
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < 4; i++) s += v[k][i] * xa[k][0].v[i];
#pragma unroll
                    for (int i = 0; i < 4; i++) s += v[k][4 + i] * xa[k][1].v[i];
                    acc[t] += s;
                }
            }
            continue;
        }
        for (int g = lane; g < C::kGroups && 8 * g < valid; g += 32) {
            const int v0 = 8 * g;
            float v[8];
            Q::dequant8(chunk + (v0 / Q::block_size) * Q::block_bytes, v0 % Q::block_size, v);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t >= nt) break;
                const Floats4* xt = (const Floats4*)(x + (size_t)(x0 + t0 + t) * cols + c0 + v0);
                const Floats4 a = xt[0], b = xt[1];
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; i++) s += v[i] * a.v[i];
#pragma unroll
                for (int i = 0; i < 4; i++) s += v[4 + i] * b.v[i];
                acc[t] += s;
            }
        }
    }
    write_row<NT>(sh.partial[warp], acc, nt, lane, m, r, t0);
}

// Four bytes of shared memory at a 2-byte aligned address (blocks hold 16-bit fields first).
__device__ __forceinline__ int load_i32_a2(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

// The integer path: one warp per row, one block of 32 weights per lane and chunk (Chunk<T> holds 32 blocks
// of these types), staged through shared memory as the float kernel does; per block the integer dot
// product of the weights' codes with x's (dp4a) and the CPU's scaling (vec_dot_scalar.cpp).
// (One token: at most 64 registers, so that eight blocks, 32 warps, fit on a multiprocessor with their two
// chunks each in flight: 61-64 registers with the bound, no spills; ptxas, sm_90.)
template <int TYPE, int NT>
__global__ void __launch_bounds__(32 * kRowsPerBlock, NT == 1 ? 8 : 0) matmul_q8x_kernel(Matrices ms, int64_t cols, const int8_t* __restrict__ codes,
                                  const CudaQ8Meta* __restrict__ meta, int32_t n) {
    using Q = cudaq::QType<TYPE>;
    using C = Chunk<TYPE>;
    static_assert(C::kBlocks == 32 && Q::block_size == 32, "one 32-value block per lane");
    __shared__ StagedShared<TYPE, NT> sh;
    const int lane = threadIdx.x, warp = threadIdx.y;
    const auto [m, r, t0, nt, x0] = row_task<NT>(ms, n);
    if (r >= m.rows || nt <= 0) return;
    RowStager<TYPE, kReadAhead<NT>> rs(m, r, cols, lane, sh.stage[warp]);
    const int64_t n_blocks = cols / 32;
    const uint8_t* wb = (const uint8_t*)sh.stage[warp] + lane * Q::block_bytes;

    constexpr int D = kReadAhead<NT>;
    float acc[NT] = {};
    for (int64_t c = 0; c < cols; c += D * C::kValues)
#pragma unroll
    for (int s = 0; s < D; s++) {  // (as in matmul_staged_kernel)
        const int64_t c0 = c + s * C::kValues;
        if (c0 >= cols) break;
        rs.advance(s, c0);
        const int64_t blk = c0 / 32 + lane;
        if (blk >= n_blocks) continue;
        // The weights' codes as 8 words of four bytes: for Q4_0/Q4_1 words 0-3 hold values 0-15 (low
        // nibbles) and 4-7 values 16-31 (high nibbles), in x's order.
        int wq[8];
        float dw, mw = 0.0f;
        dw = cudaq::half_to_float(cudaq::load_u16(wb));
        if (TYPE == TYPE_Q8_0) {
#pragma unroll
            for (int j = 0; j < 8; j++) wq[j] = load_i32_a2(wb + 2 + 4 * j);
        } else {
            const int qs_at = TYPE == TYPE_Q4_1 ? 4 : 2;
            if (TYPE == TYPE_Q4_1) mw = cudaq::half_to_float(cudaq::load_u16(wb + 2));
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int q = load_i32_a2(wb + qs_at + 4 * j);
                wq[j] = q & 0x0F0F0F0F;
                wq[4 + j] = (q >> 4) & 0x0F0F0F0F;
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            const Bytes16* xq = (const Bytes16*)(codes + (size_t)(x0 + t0 + t) * cols + 32 * blk);
            const Bytes16 a = xq[0], b = xq[1];
            const CudaQ8Meta m = meta[(size_t)(x0 + t0 + t) * n_blocks + blk];
            int sumi = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) sumi = __dp4a(wq[j], (int)a.w[j], sumi);
#pragma unroll
            for (int j = 0; j < 4; j++) sumi = __dp4a(wq[4 + j], (int)b.w[j], sumi);
            if (TYPE == TYPE_Q4_0) sumi -= 8 * m.sum;  // codes are the nibbles minus 8
            float v = (float)sumi * (dw * m.d);
            if (TYPE == TYPE_Q4_1) v += mw * m.s;
            acc[t] += v;
        }
    }
    write_row<NT>(sh.partial[warp], acc, nt, lane, m, r, t0);
}

std::atomic<bool> one_token_kernels{true};  // cuda_use_one_token_kernels

// The most tokens a matrix of the launch has.
int32_t max_tokens(const Matrices& ms, int32_t n) {
    int32_t most = 0;
    for (int k = 0; k < ms.count; k++) most = std::max(most, ms.m[k].n < 0 ? n : ms.m[k].n);
    return most;
}
// Tokens a warp carries in this launch: one where no matrix has more (experts chosen on the GPU: one per
// slot), else kTokens.
int tokens_per_warp(const Matrices& ms, int32_t n) {
    const bool one = ms.m[0].ids || max_tokens(ms, n) == 1;
    return one && one_token_kernels.load(std::memory_order_relaxed) ? 1 : kTokens;
}
// The grid of a launch: a block per kRowsPerBlock rows (a warp each) by a block per slice of `nt` tokens
// (experts chosen on the GPU: per slot).
dim3 grid_of(const Matrices& ms, int32_t n, int nt) {
    const int32_t most = max_tokens(ms, n), y = ms.m[0].ids ? most : (most + nt - 1) / nt;
    if (y > 65535) throw ArgumentError(format("cuda_matmul: %d tokens is more than one launch holds", most));
    return dim3(total_blocks(ms), (unsigned)y);
}

template <int TYPE, int NT>
void launch(cudaStream_t s, const Matrices& ms, int64_t cols, const float* x, int32_t n) {
    const dim3 block(32, kRowsPerBlock), grid = grid_of(ms, n, NT);
    // The staged kernel reads rows as 16-byte units and the activations as 4 floats at a time.
    bool staged = (uintptr_t)x % 16 == 0;
    for (int k = 0; k < ms.count; k++)
        staged = staged && ms.m[k].row_bytes % 16 == 0 && (uintptr_t)ms.m[k].w % 16 == 0 && ms.m[k].id_stride % 16 == 0;
    if (staged)
        OPTIML_LAUNCH((matmul_staged_kernel<TYPE, NT>), grid, block, s, ms, cols, x, n);
    else
        OPTIML_LAUNCH((matmul_kernel<TYPE, NT>), grid, block, s, ms, cols, x, n);
}

template <int NT>
void launch_q8x(cudaStream_t s, int32_t type, const Matrices& ms, int64_t cols, const int8_t* codes,
                const CudaQ8Meta* meta, int32_t n) {
    const dim3 block(32, kRowsPerBlock), grid = grid_of(ms, n, NT);
    switch (type) {
        case TYPE_Q4_0: OPTIML_LAUNCH((matmul_q8x_kernel<TYPE_Q4_0, NT>), grid, block, s, ms, cols, codes, meta, n); break;
        case TYPE_Q4_1: OPTIML_LAUNCH((matmul_q8x_kernel<TYPE_Q4_1, NT>), grid, block, s, ms, cols, codes, meta, n); break;
        case TYPE_Q8_0: OPTIML_LAUNCH((matmul_q8x_kernel<TYPE_Q8_0, NT>), grid, block, s, ms, cols, codes, meta, n); break;
        default: throw Error("internal: cuda_matmul_q8x reads Q4_0, Q4_1 and Q8_0 weights only");
    }
}

// The weight bytes a launch reads: every matrix once per slice of `nt` of its tokens.
int64_t matrices_bytes(const Matrices& ms, int32_t n, int nt) {
    int64_t b = 0;
    for (int k = 0; k < ms.count; k++) {
        const int32_t nm = ms.m[k].n < 0 ? n : ms.m[k].n;
        b += ms.m[k].rows * (int64_t)ms.m[k].row_bytes * (ms.m[k].ids ? nm : (nm + nt - 1) / nt);
    }
    return b;
}
// After a launch: its error check and its traffic, the weights (matrices_bytes), the outputs' bytes (read
// too where they accumulate), the biases' and `inputs` bytes of activations.
void count_launch(const Matrices& ms, int32_t n, int nt, int64_t inputs, CudaKernel kernel, const char* what) {
    cuda_check(cudaSuccess, what);
    CudaTraffic t;
    for (int k = 0; k < ms.count; k++) {
        t.activations += (ms.m[k].accumulate ? 8 : 4) * (int64_t)(ms.m[k].n < 0 ? n : ms.m[k].n) * ms.m[k].rows;
        if (ms.m[k].bias) t.weights += 4 * ms.m[k].rows;
    }
    t.weights += matrices_bytes(ms, n, nt);
    t.activations += inputs;
    cuda_count(kernel, t);
}

// One thread per output dimension and token: consecutive threads read consecutive bytes of each row.
__global__ void down_nm_q8_kernel(const uint8_t* __restrict__ rows, size_t row_bytes, const float* __restrict__ dim_scale,
                                  const float* __restrict__ h, int64_t n_neurons, int64_t dim, float* __restrict__ y) {
    const int64_t d = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    if (d >= dim) return;
    const float* ht = h + (size_t)t * n_neurons;
    const size_t block = (size_t)(d / 32) * sizeof(block_q8_0);
    const int in_block = (int)(d % 32);
    float sum = 0.0f;
    for (int64_t j = 0; j < n_neurons; j++) {
        const uint8_t* b = rows + (size_t)j * row_bytes + block;
        const float w = cudaq::half_to_float(cudaq::load_u16(b)) * (float)(int8_t)b[2 + in_block];
        sum += ht[j] * w;
    }
    y[(size_t)t * dim + d] = dim_scale[d] * sum;
}

}  // namespace

void cuda_down_neuron_major_q8(cudaStream_t s, const uint8_t* rows, size_t row_bytes, const float* dim_scale,
                               const float* h, int64_t n_neurons, int64_t dim, int32_t n, float* y) {
    if (n <= 0) return;
    if (n > 65535) throw ArgumentError(format("cuda down product: %d tokens is more than one launch holds", n));
    const unsigned threads = 128;
    OPTIML_LAUNCH(down_nm_q8_kernel, dim3((unsigned)((dim + threads - 1) / threads), (unsigned)n), threads, s, rows,
                  row_bytes, dim_scale, h, n_neurons, dim, y);
    cuda_check(cudaSuccess, "down product (neuron-major)");
    // (each token's threads read every row again)
    cuda_count(CudaKernel::DownNeuronMajor, {(int64_t)n * (n_neurons * (int64_t)row_bytes + 4 * dim),
                                             4 * (int64_t)n * (n_neurons + dim)});
}

void cuda_use_one_token_kernels(bool on) { one_token_kernels.store(on, std::memory_order_relaxed); }
bool cuda_one_token_kernels() { return one_token_kernels.load(std::memory_order_relaxed); }

bool cuda_reads_type(int32_t type) { return cudaq::block_size_of(type) > 0; }

bool cuda_matmul_q8x_reads(int32_t type, int64_t cols, size_t row_bytes, const void* w) {
    return (type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q8_0) && cols % 32 == 0 && row_bytes % 16 == 0 &&
           (uintptr_t)w % 16 == 0;
}

void cuda_matmul_q8x_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                          const int8_t* codes, const CudaQ8Meta* meta, int32_t n) {
    if (n <= 0) return;
    const Matrices ms = make_matrices(m, count);
    if (total_blocks(ms) == 0) return;
    const int nt = tokens_per_warp(ms, n);
    if (nt == 1)
        launch_q8x<1>(s, type, ms, cols, codes, meta, n);
    else
        launch_q8x<kTokens>(s, type, ms, cols, codes, meta, n);
    count_launch(ms, n, nt, (int64_t)n * (cols + (int64_t)sizeof(CudaQ8Meta) * (cols / 32)), CudaKernel::MatmulQ8x,
                 "matmul (integer)");
}

void cuda_matmul_q8x(cudaStream_t s, int32_t type, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes,
                     const int8_t* codes, const CudaQ8Meta* meta, int32_t n, float* y, bool accumulate) {
    const CudaMatrix m{w, rows, row_bytes, y, nullptr, accumulate};  // (no bias)
    cuda_matmul_q8x_many(s, type, &m, 1, cols, codes, meta, n);
}

void cuda_matmul(cudaStream_t s, int32_t type, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes,
                 const float* x, int32_t n, float* y, bool accumulate) {
    const CudaMatrix m{w, rows, row_bytes, y, nullptr, accumulate};  // (no bias)
    cuda_matmul_many(s, type, &m, 1, cols, x, n);
}

void cuda_matmul_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols, const float* x,
                      int32_t n) {
    if (n <= 0) return;
    const Matrices ms = make_matrices(m, count);
    if (total_blocks(ms) == 0) return;
    if (cols % 8 != 0)
        throw UnsupportedModelError(format("the CUDA backend needs rows of a multiple of 8 values, got %lld",
                                           (long long)cols));
    const int nt = tokens_per_warp(ms, n);
    switch (type) {
#define OPTIML_MATMUL_CASE(T)                          \
    case T:                                            \
        if (nt == 1)                                   \
            launch<T, 1>(s, ms, cols, x, n);           \
        else                                           \
            launch<T, kTokens>(s, ms, cols, x, n);     \
        break;
        OPTIML_CUDA_FOR_EACH_TYPE(OPTIML_MATMUL_CASE)
#undef OPTIML_MATMUL_CASE
        default:
            throw UnsupportedModelError(format("the CUDA backend does not read %s weights yet",
                                               type_traits(type).name ? type_traits(type).name : "these"));
    }
    count_launch(ms, n, nt, 4 * (int64_t)n * cols, CudaKernel::Matmul, "matmul");
}

}  // namespace optiml
