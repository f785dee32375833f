// Elementwise and per-row ops of the forward pass on the GPU: RMSNorm, biases, residual adds, the FFN's
// gated activations, and the rounding of activations to what the CPU's products see. Same formulas as
// native/src/cpu/kernels/ops.cpp (GELU in its tanh form) and native/src/quant/.
#include <cuda_fp16.h>

#include <cstring>

#include "kernels.cuh"
#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/model.h"

namespace optiml {

void cuda_check(cudaError_t err, const char* what) {
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess)
        throw Error(format("CUDA error in %s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err)));
}

const char* cuda_kernel_name(CudaKernel k) {
    switch (k) {
        case CudaKernel::RmsNorm: return "rms_norm";
        case CudaKernel::Quantize: return "quantize";
        case CudaKernel::Round: return "round";
        case CudaKernel::Matmul: return "matmul";
        case CudaKernel::MatmulQ8x: return "matmul_q8x";
        case CudaKernel::DownNeuronMajor: return "down_neuron_major";
        case CudaKernel::AttnPrepare: return "attn_prepare";
        case CudaKernel::AttnScores: return "attn_scores";
        case CudaKernel::AddBias: return "add_bias";
        case CudaKernel::Add: return "add";
        case CudaKernel::ActMul: return "act_mul";
        case CudaKernel::Softcap: return "softcap";
        case CudaKernel::CopyIn: return "copy_in";
        case CudaKernel::CopyOut: return "copy_out";
        case CudaKernel::Copy: return "copy";
        case CudaKernel::kCount: break;
    }
    return "?";
}

namespace {
thread_local CudaLaunchLog* t_launch_log = nullptr;
}
void cuda_set_launch_log(CudaLaunchLog* log) { t_launch_log = log; }
CudaLaunchLog* cuda_launch_log() { return t_launch_log; }
void cuda_count(CudaKernel k, const CudaTraffic& t) {
    if (t_launch_log) t_launch_log->count(k, t);
}

namespace {

constexpr int kThreads = 256;

// One block per row (up to 1024 threads: a decode step has one row, and one thread's long serial loop
// over it set the kernel's time); the sum of squares in double, as the CPU (and ggml) keep it.
__global__ void rms_norm_kernel(const float* x, const float* w, float* out, int64_t dim, float eps) {
    __shared__ double partial[32];
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* outr = out + (size_t)blockIdx.x * dim;
    double sum = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += (double)xr[i] * xr[i];
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    double total = 0;
    for (int i = 0; i < (int)(blockDim.x / 32); i++) total += partial[i];
    const float scale = (float)(1.0 / sqrt(total / (double)dim + (double)eps));
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) outr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
}

__global__ void add_bias_kernel(float* rows, const float* bias, int64_t dim, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) rows[i] += bias[i % dim];
}

__global__ void add_kernel(float* x, const float* y, const float* y2, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    // (y + y2) first, as the CPU joins the two shares of a split FFN before the residual add.
    x[i] += y2 ? y[i] + y2[i] : y[i];
}

__device__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + 0.044715f * x * x)));
}

constexpr int kGeluF16 = 100;  // cuda_act_mul's GELU through f16, as the CPU's table

__global__ void act_mul_kernel(int act, float* g, const float* u, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const float a = g[i], b = u[i];
    float r;
    switch (act) {
        case FFN_RELU: r = (a > 0 ? a : 0.0f) * b; break;
        case FFN_RELU2: r = a > 0 && b > 0 ? a * b : 0.0f; break;
        case FFN_GELU: r = gelu_tanh(a) * b; break;
        case kGeluF16: {  // llama.cpp's f16 table (ops.cpp's gelu_mul): gelu of the f16 input, rounded to f16
            const float hx = __half2float(__float2half_rn(a));
            r = a <= -10.0f ? 0.0f : a >= 10.0f ? a * b : __half2float(__float2half_rn(gelu_tanh(hx))) * b;
            break;
        }
        default: r = a / (1.0f + expf(-a)) * b; break;
    }
    g[i] = r;
}

// Q8_0 / Q8_1 activations, as the CPU converts them (quant_legacy.cpp's q8_activation_codes): per 32
// values amax, codes rint(x * 127 / amax), the scale amax / 127 rounded to f16. One warp per block.
__global__ void act_q8_0_kernel(const float* x, float* out, int64_t n_blocks) {
    const int64_t b = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;  // whole warps leave together
    const float v = x[b * 32 + threadIdx.x % 32];
    float amax = fabsf(v);
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const float d = __half2float(__float2half_rn(amax / 127.0f));
    out[b * 32 + threadIdx.x % 32] = d * rintf(v * id);
}

// The same codes kept as integers for the integer products (kernels.cuh's CudaQ8Meta). One warp per block.
__global__ void quantize_q8x_kernel(const float* x, int8_t* codes, CudaQ8Meta* meta, int64_t n_blocks) {
    const int64_t b = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;  // whole warps leave together
    const int lane = threadIdx.x % 32;
    const float v = x[b * 32 + lane];
    float amax = fabsf(v);
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)rintf(v * id);
    codes[b * 32 + lane] = (int8_t)q;
    int sum = q;
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
        const float d = amax / 127.0f;
        meta[b] = CudaQ8Meta{__half2float(__float2half_rn(d)), __half2float(__float2half_rn(d * (float)sum)), sum, 0};
    }
}

// Q8_K activations (quant_kquants.cpp's quantize_row_q8_K): per 256 values the first value of largest
// magnitude sets iscale = -127 / max, codes min(127, rint(iscale * x)), scale 1 / iscale (float). One
// block of 256 threads per 256 values.
__global__ void act_q8_k_kernel(const float* x, float* out) {
    __shared__ float s_abs[256];
    __shared__ int s_idx[256];
    const int64_t base = (int64_t)blockIdx.x * 256;
    const int i = threadIdx.x;
    const float v = x[base + i];
    s_abs[i] = fabsf(v);
    s_idx[i] = i;
    __syncthreads();
    for (int stride = 128; stride > 0; stride >>= 1) {
        if (i < stride) {
            const float a = s_abs[i], b = s_abs[i + stride];
            const int ia = s_idx[i], ib = s_idx[i + stride];
            if (b > a || (b == a && ib < ia)) {
                s_abs[i] = b;
                s_idx[i] = ib;
            }
        }
        __syncthreads();
    }
    const float amax = s_abs[0];
    const float max = x[base + s_idx[0]];
    if (amax == 0.0f) {
        out[base + i] = 0.0f;
        return;
    }
    const float iscale = -127.0f / max;
    const float q = fminf(127.0f, rintf(iscale * v));
    out[base + i] = (1.0f / iscale) * q;
}

__global__ void act_round_kernel(int32_t type, const float* x, float* out, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    if (type == TYPE_F16) {
        out[i] = __half2float(__float2half_rn(x[i]));
    } else {  // BF16, round to nearest even as optiml::fp32_to_bf16 (NaN stays NaN)
        uint32_t u;
        memcpy(&u, &x[i], 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            out[i] = x[i];
            return;
        }
        u = ((u + (0x7fffu + ((u >> 16) & 1))) >> 16) << 16;
        memcpy(&out[i], &u, 4);
    }
}

__global__ void softcap_kernel(float* x, int64_t count, float cap) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = tanhf(x[i] / cap) * cap;
}

unsigned blocks(int64_t count) { return (unsigned)((count + kThreads - 1) / kThreads); }

}  // namespace

void cuda_rms_norm(cudaStream_t s, const float* x, const float* w, float* out, int32_t n, int64_t dim, float eps) {
    if (n <= 0) return;
    int64_t threads = (dim / 4 + 31) / 32 * 32;  // about four values a thread
    threads = threads < 32 ? 32 : threads > 1024 ? 1024 : threads;
    OPTIML_LAUNCH(rms_norm_kernel, n, (unsigned)threads, s, x, w, out, dim, eps);
    cuda_check(cudaSuccess, "rms_norm");
    cuda_count(CudaKernel::RmsNorm, {w ? 4 * dim : 0, 2 * 4 * (int64_t)n * dim});
}

void cuda_add_bias(cudaStream_t s, float* rows, const float* bias, int32_t n, int64_t dim) {
    const int64_t count = (int64_t)n * dim;
    if (count <= 0 || !bias) return;
    OPTIML_LAUNCH(add_bias_kernel, blocks(count), kThreads, s, rows, bias, dim, count);
    cuda_check(cudaSuccess, "add_bias");
    cuda_count(CudaKernel::AddBias, {4 * dim, 2 * 4 * count});
}

void cuda_add(cudaStream_t s, float* x, const float* y, const float* y2, int64_t count) {
    if (count <= 0) return;
    OPTIML_LAUNCH(add_kernel, blocks(count), kThreads, s, x, y, y2, count);
    cuda_check(cudaSuccess, "add");
    cuda_count(CudaKernel::Add, {0, (y2 ? 4 : 3) * 4 * count});
}

void cuda_round_activations(cudaStream_t s, int32_t type, const float* x, float* out, int32_t n, int64_t cols) {
    const int64_t count = (int64_t)n * cols;
    if (count <= 0) return;
    switch (type) {
        case TYPE_Q8_0:
        case TYPE_Q8_1:
            if (cols % 32) throw ArgumentError("8-bit activations need rows of whole 32-value blocks");
            OPTIML_LAUNCH(act_q8_0_kernel, blocks(count), kThreads, s, x, out, count / 32);
            break;
        case TYPE_Q8_K:
            if (cols % 256) throw ArgumentError("8-bit K activations need rows of whole 256-value blocks");
            OPTIML_LAUNCH(act_q8_k_kernel, (unsigned)(count / 256), 256, s, x, out);
            break;
        case TYPE_F16:
        case TYPE_BF16:
            OPTIML_LAUNCH(act_round_kernel, blocks(count), kThreads, s, type, x, out, count);
            break;
        case TYPE_F32:
            if (out != x) {
                cuda_check(cudaMemcpyAsync(out, x, 4 * (size_t)count, cudaMemcpyDeviceToDevice, s), "copy");
                cuda_count(CudaKernel::Copy, {0, 2 * 4 * count});
            }
            return;
        default:
            throw UnsupportedModelError(format("the CUDA backend cannot convert activations to type %d", type));
    }
    cuda_check(cudaSuccess, "activation rounding");
    cuda_count(CudaKernel::Round, {0, 2 * 4 * count});
}

void cuda_quantize_q8x(cudaStream_t s, const float* x, int32_t n, int64_t cols, int8_t* codes, CudaQ8Meta* meta) {
    const int64_t count = (int64_t)n * cols;
    if (count <= 0) return;
    if (cols % 32) throw ArgumentError("8-bit activations need rows of whole 32-value blocks");
    OPTIML_LAUNCH(quantize_q8x_kernel, blocks(count), kThreads, s, x, codes, meta, count / 32);
    cuda_check(cudaSuccess, "activation codes");
    cuda_count(CudaKernel::Quantize, {0, 4 * count + count + (int64_t)sizeof(CudaQ8Meta) * (count / 32)});
}

void cuda_softcap(cudaStream_t s, float* x, int64_t count, float cap) {
    if (count <= 0) return;
    OPTIML_LAUNCH(softcap_kernel, blocks(count), kThreads, s, x, count, cap);
    cuda_check(cudaSuccess, "softcap");
    cuda_count(CudaKernel::Softcap, {0, 2 * 4 * count});
}

void cuda_act_mul(cudaStream_t s, int act, bool gelu_f16, float* g, const float* u, int64_t count) {
    if (count <= 0) return;
    if (act == FFN_GELU && gelu_f16) act = kGeluF16;
    OPTIML_LAUNCH(act_mul_kernel, blocks(count), kThreads, s, act, g, u, count);
    cuda_check(cudaSuccess, "act_mul");
    cuda_count(CudaKernel::ActMul, {0, 3 * 4 * count});
}

}  // namespace optiml
