// Products of quantized weights with float activations on the GPU: one warp per weight row, each lane
// dequantizing eight values at a time (dequant.cuh, the same arithmetic as the CPU's dequantization)
// and applying them to up to kTokens tokens, then the lanes' sums added through shared memory. A prompt runs as kTokens-token
// slices of the grid, each reading the weights again: correct at any batch size, fast only for decode.
#include "dequant.cuh"
#include "kernels.cuh"
#include "optiml/common.h"
#include "optiml/cuda.h"

namespace optiml {

namespace {

constexpr int kTokens = 8;        // tokens one warp carries per dequantized group
constexpr int kRowsPerBlock = 4;  // warps (rows) per thread block

template <int TYPE>
__global__ void matmul_kernel(const uint8_t* __restrict__ w, int64_t rows, int64_t cols, size_t row_bytes,
                              const float* __restrict__ x, int32_t n, float* __restrict__ y, bool accumulate) {
    using Q = cudaq::QType<TYPE>;
    const int lane = threadIdx.x;
    const int64_t r = (int64_t)blockIdx.x * kRowsPerBlock + threadIdx.y;
    if (r >= rows) return;  // the whole warp leaves together: r depends on the warp only
    const int32_t t0 = (int32_t)blockIdx.y * kTokens;
    const int nt = n - t0 < kTokens ? n - t0 : kTokens;
    const uint8_t* row = w + (size_t)r * row_bytes;

    float acc[kTokens];
#pragma unroll
    for (int t = 0; t < kTokens; t++) acc[t] = 0.0f;
    for (int64_t c = (int64_t)lane * 8; c < cols; c += 32 * 8) {
        float v[8];
        Q::dequant8(row + (size_t)(c / Q::block_size) * Q::block_bytes, (int)(c % Q::block_size), v);
#pragma unroll
        for (int t = 0; t < kTokens; t++) {
            if (t >= nt) break;
            const float* xt = x + (size_t)(t0 + t) * cols + c;
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) s += v[i] * xt[i];
            acc[t] += s;
        }
    }
    // The warp's 32 partial sums of each token through shared memory: lane t adds token t's, one exchange
    // for all tokens instead of a five-shuffle tree per token.
    __shared__ float partial[kRowsPerBlock][kTokens][33];  // (33: lanes hit different banks)
#pragma unroll
    for (int t = 0; t < kTokens; t++)
        if (t < nt) partial[threadIdx.y][t][lane] = acc[t];
    __syncwarp();
    if (lane < nt) {
        float s = 0.0f;
        for (int i = 0; i < 32; i++) s += partial[threadIdx.y][lane][i];
        float* out = y + (size_t)(t0 + lane) * rows + r;
        *out = accumulate ? *out + s : s;
    }
}

template <int TYPE>
void launch(cudaStream_t s, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes, const float* x, int32_t n,
            float* y, bool accumulate) {
    const dim3 block(32, kRowsPerBlock);
    const dim3 grid((unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock), (unsigned)((n + kTokens - 1) / kTokens));
    OPTIML_LAUNCH(matmul_kernel<TYPE>, grid, block, s, w, rows, cols, row_bytes, x, n, y, accumulate);
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
}

bool cuda_reads_type(int32_t type) { return cudaq::block_size_of(type) > 0; }

void cuda_matmul(cudaStream_t s, int32_t type, const uint8_t* w, int64_t rows, int64_t cols, size_t row_bytes,
                 const float* x, int32_t n, float* y, bool accumulate) {
    if (n <= 0 || rows <= 0) return;
    if (cols % 8 != 0)
        throw UnsupportedModelError(format("the CUDA backend needs rows of a multiple of 8 values, got %lld",
                                           (long long)cols));
    if ((n + kTokens - 1) / kTokens > 65535)
        throw ArgumentError(format("cuda_matmul: %d tokens is more than one launch holds", n));
    switch (type) {
#define OPTIML_MATMUL_CASE(T)                                                  \
    case T:                                                                    \
        launch<T>(s, w, rows, cols, row_bytes, x, n, y, accumulate);           \
        break;
        OPTIML_CUDA_FOR_EACH_TYPE(OPTIML_MATMUL_CASE)
#undef OPTIML_MATMUL_CASE
        default:
            throw UnsupportedModelError(format("the CUDA backend does not read %s weights yet",
                                               type_traits(type).name ? type_traits(type).name : "these"));
    }
    cuda_check(cudaSuccess, "matmul");
}

}  // namespace optiml
