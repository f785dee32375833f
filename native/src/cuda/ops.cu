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
        case CudaKernel::RmsNormAdd: return "rms_norm_add";
        case CudaKernel::Quantize: return "quantize";
        case CudaKernel::Round: return "round";
        case CudaKernel::NormQuantize: return "norm_quantize";
        case CudaKernel::NormRound: return "norm_round";
        case CudaKernel::ActQuantize: return "act_quantize";
        case CudaKernel::ActRound: return "act_round";
        case CudaKernel::Matmul: return "matmul";
        case CudaKernel::MatmulQ8x: return "matmul_q8x";
        case CudaKernel::MatmulTiles: return "matmul_tiles";
        case CudaKernel::DownNeuronMajor: return "down_neuron_major";
        case CudaKernel::AttnPrepare: return "attn_prepare";
        case CudaKernel::AttnScores: return "attn_scores";
        case CudaKernel::AttnSplit: return "attn_split";
        case CudaKernel::AddBias: return "add_bias";
        case CudaKernel::Add: return "add";
        case CudaKernel::ActMul: return "act_mul";
        case CudaKernel::Softcap: return "softcap";
        case CudaKernel::Gather: return "gather";
        case CudaKernel::Sigmoid: return "sigmoid";
        case CudaKernel::MoECombine: return "moe_combine";
        case CudaKernel::MoERoute: return "moe_route";
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

// Threads of a block that normalizes a row of dim values: about four values a thread, at most 1024 (a
// decode step has one row, and one thread's long serial loop over it set the kernel's time). Every
// kernel that normalizes (rms_norm_kernel, input_stage_kernel) uses this many, so their sums are the
// same in every bit.
int norm_threads(int64_t dim) {
    int64_t threads = (dim / 4 + 31) / 32 * 32;
    return (int)(threads < 32 ? 32 : threads > 1024 ? 1024 : threads);
}

// 1 / rms(xr[0..dim)) with eps, by the whole block (every thread calls it once and gets the result): the
// sum of squares in double, as the CPU (and ggml) keep it.
__device__ float row_rms_scale(const float* xr, int64_t dim, float eps) {
    __shared__ double partial[32];
    double sum = 0;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += (double)xr[i] * xr[i];
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    double total = 0;
    for (int i = 0; i < (int)(blockDim.x / 32); i++) total += partial[i];
    return (float)(1.0 / sqrt(total / (double)dim + (double)eps));
}

// One block per row. add: out[i] += the normalized value (rounded to float first, as when it is stored
// and added by another kernel).
__global__ void rms_norm_kernel(const float* x, const float* w, float* out, int64_t dim, float eps, bool add) {
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* outr = out + (size_t)blockIdx.x * dim;
    const float scale = row_rms_scale(xr, dim, eps);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        // (__fmul_rn: never contracted with the add into one rounding)
        const float v = w ? __fmul_rn(xr[i] * scale, w[i]) : __fmul_rn(xr[i], scale);
        outr[i] = add ? outr[i] + v : v;
    }
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

constexpr int kGeluF16 = 100;  // the GELU through f16, as the CPU's table

// act(a) * b for an FFNActivation (or kGeluF16).
__device__ float act_mul(int act, float a, float b) {
    switch (act) {
        case FFN_RELU: return (a > 0 ? a : 0.0f) * b;
        case FFN_RELU2: return a > 0 && b > 0 ? a * b : 0.0f;
        case FFN_GELU: return gelu_tanh(a) * b;
        case FFN_SWIGLU_OAI: {  // gpt-oss: the gate clamped above, up on both sides (ops as moe_ffn.cpp's)
            const float x = fminf(a, 7.0f), y = fminf(fmaxf(b, -7.0f), 7.0f);
            return x / (1.0f + expf(1.702f * -x)) * (y + 1.0f);
        }
        case kGeluF16: {  // llama.cpp's f16 table (ops.cpp's gelu_mul): gelu of the f16 input, rounded to f16
            const float hx = __half2float(__float2half_rn(a));
            return a <= -10.0f ? 0.0f : a >= 10.0f ? a * b : __half2float(__float2half_rn(gelu_tanh(hx))) * b;
        }
        default: return a / (1.0f + expf(-a)) * b;
    }
}

__device__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

__device__ int warp_sum(int v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// BF16 rounding to nearest even as optiml::fp32_to_bf16 (NaN stays NaN), back in float.
__device__ float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return x;
    u = ((u + (0x7fffu + ((u >> 16) & 1))) >> 16) << 16;
    float r;
    memcpy(&r, &u, 4);
    return r;
}

// The products' input stage (kernels.cuh's CudaInputStage): grid (groups of the row / warps, rows), one
// warp per group of G values (32; 256 for Q8_K, whose scale spans that many), lane l holding values
// l, l + 32, ... of its group. Norm: the whole block first computes the row's scale, as rms_norm_kernel
// does (same threads, same sums); every block of the row does (the row is re-read from the cache).
// The conversions are those of the CPU (quant_legacy.cpp's q8_activation_codes: per 32 values amax, codes
// rint(x * 127 / amax), the scale amax / 127 rounded to f16; quant_kquants.cpp's quantize_row_q8_K: per
// 256 values the first value of largest magnitude sets iscale = -127 / max, codes min(127, rint(iscale *
// x)), scale 1 / iscale).
template <int G>
__global__ void input_stage_kernel(CudaInputStage st, int64_t cols) {
    constexpr int V = G / 32;
    const int64_t row = blockIdx.y;
    const float* xr = st.x + (size_t)row * cols;
    const float scale = st.make == CudaInputStage::Norm ? row_rms_scale(xr, cols, st.eps) : 1.0f;
    const int lane = threadIdx.x % 32;
    const int64_t g = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (g * G >= cols) return;  // whole warps leave together (after the block's only barrier)
    float v[V];
    bool in[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        const int64_t i = g * G + lane + 32 * j;
        in[j] = i < cols;  // (a partial last group only where nothing is converted per group)
        if (!in[j]) {
            v[j] = 0.0f;
            continue;
        }
        if (st.make == CudaInputStage::Norm) {
            v[j] = st.norm ? __fmul_rn(xr[i] * scale, st.norm[i]) : xr[i] * scale;
        } else if (st.make == CudaInputStage::ActMul) {
            v[j] = act_mul(st.act, xr[i], st.up[(size_t)row * cols + i]);
        } else {
            v[j] = xr[i];
        }
        if (st.values) st.values[(size_t)row * cols + i] = v[j];
    }
    const int32_t conv = st.convert;
    if (conv < 0 && conv != kCudaCodes && conv != kCudaCodesK) return;
    float* out = st.rounded + (size_t)row * cols + g * G;
    if (conv == TYPE_F16 || conv == TYPE_BF16) {
#pragma unroll
        for (int j = 0; j < V; j++)
            if (in[j]) out[lane + 32 * j] = conv == TYPE_F16 ? __half2float(__float2half_rn(v[j])) : round_bf16(v[j]);
        return;
    }
    if (G == 256) {  // Q8_K: the first value of largest magnitude (lowest index among equals), with its sign
        float best = fabsf(v[0]), max = v[0];
        int idx = lane;
#pragma unroll
        for (int j = 1; j < V; j++)
            if (fabsf(v[j]) > best) {
                best = fabsf(v[j]);
                max = v[j];
                idx = lane + 32 * j;
            }
        for (int off = 16; off > 0; off >>= 1) {
            const float b2 = __shfl_xor_sync(0xffffffffu, best, off), m2 = __shfl_xor_sync(0xffffffffu, max, off);
            const int i2 = __shfl_xor_sync(0xffffffffu, idx, off);
            if (b2 > best || (b2 == best && i2 < idx)) {
                best = b2;
                max = m2;
                idx = i2;
            }
        }
        const float iscale = best == 0.0f ? 0.0f : -127.0f / max;
        if (conv == kCudaCodesK) {  // the codes, the group's scale in each of its 32-value blocks, their sums
            int8_t* codes = st.codes + (size_t)row * cols + g * G;
#pragma unroll
            for (int j = 0; j < V; j++) {
                const int q = best == 0.0f ? 0 : (int)fminf(127.0f, rintf(iscale * v[j]));
                codes[lane + 32 * j] = (int8_t)q;
                const int sum = warp_sum(q);
                if (lane == 0)
                    st.meta[(size_t)row * (cols / 32) + g * V + j] =
                        CudaQ8Meta{best == 0.0f ? 0.0f : 1.0f / iscale, 0.0f, sum, 0};
            }
            return;
        }
        if (best == 0.0f) {
#pragma unroll
            for (int j = 0; j < V; j++) out[lane + 32 * j] = 0.0f;
            return;
        }
#pragma unroll
        for (int j = 0; j < V; j++) out[lane + 32 * j] = (1.0f / iscale) * fminf(127.0f, rintf(iscale * v[j]));
        return;
    }
    // 32-value blocks: Q8_0 / Q8_1 rounding, or the integer products' codes.
    const float amax = warp_max(fabsf(v[0]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    if (conv != kCudaCodes) {
        out[lane] = __half2float(__float2half_rn(amax / 127.0f)) * rintf(v[0] * id);
        return;
    }
    const int q = (int)rintf(v[0] * id);
    st.codes[(size_t)row * cols + g * 32 + lane] = (int8_t)q;
    const int sum = warp_sum(q);
    if (lane == 0) {
        const float d = amax / 127.0f;
        st.meta[(size_t)row * (cols / 32) + g] =
            CudaQ8Meta{__half2float(__float2half_rn(d)), __half2float(__float2half_rn(d * (float)sum)), sum, 0};
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
    OPTIML_LAUNCH(rms_norm_kernel, n, (unsigned)norm_threads(dim), s, x, w, out, dim, eps, false);
    cuda_check(cudaSuccess, "rms_norm");
    cuda_count(CudaKernel::RmsNorm, {w ? 4 * dim : 0, 2 * 4 * (int64_t)n * dim});
}

void cuda_rms_norm_add(cudaStream_t s, const float* y, const float* w, float* x, int32_t n, int64_t dim, float eps) {
    if (n <= 0) return;
    OPTIML_LAUNCH(rms_norm_kernel, n, (unsigned)norm_threads(dim), s, y, w, x, dim, eps, true);
    cuda_check(cudaSuccess, "rms_norm (added)");
    cuda_count(CudaKernel::RmsNormAdd, {w ? 4 * dim : 0, 3 * 4 * (int64_t)n * dim});
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

void cuda_input_stage(cudaStream_t s, const CudaInputStage& st, int32_t n, int64_t cols) {
    const int64_t count = (int64_t)n * cols;
    if (count <= 0) return;
    const int32_t conv = st.convert;
    const bool codes = conv == kCudaCodes || conv == kCudaCodesK, none = conv == -1;
    if (!codes && !none && conv != TYPE_Q8_0 && conv != TYPE_Q8_1 && conv != TYPE_Q8_K && conv != TYPE_F16 &&
        conv != TYPE_BF16)
        throw UnsupportedModelError(format("the CUDA backend cannot convert activations to type %d", conv));
    const int group = conv == TYPE_Q8_K || conv == kCudaCodesK ? 256 : 32;
    if ((codes || conv == TYPE_Q8_0 || conv == TYPE_Q8_1 || conv == TYPE_Q8_K) && cols % group)
        throw ArgumentError(format("8-bit activations need rows of whole %d-value blocks", group));
    if (n > 65535) throw ArgumentError(format("cuda input stage: %d rows is more than one launch holds", n));
    if (none && !st.values) throw Error("internal: an input stage that neither stores nor converts");
    if (st.make == CudaInputStage::Norm && (st.values == st.x || (!none && !codes && st.rounded == st.x)))
        throw Error("internal: a normalizing input stage cannot write its rows in place (cuda_rms_norm does)");
    const int threads = st.make == CudaInputStage::Norm ? norm_threads(cols) : kThreads;
    const int64_t groups = (cols + group - 1) / group, per_block = threads / 32;
    const dim3 grid((unsigned)((groups + per_block - 1) / per_block), (unsigned)n);
    if (group == 256)
        OPTIML_LAUNCH(input_stage_kernel<256>, grid, (unsigned)threads, s, st, cols);
    else
        OPTIML_LAUNCH(input_stage_kernel<32>, grid, (unsigned)threads, s, st, cols);
    cuda_check(cudaSuccess, "activations (input stage)");
    static constexpr CudaKernel kinds[3][3] = {
        {CudaKernel::Copy, CudaKernel::Quantize, CudaKernel::Round},  // (a copy is refused above)
        {CudaKernel::RmsNorm, CudaKernel::NormQuantize, CudaKernel::NormRound},
        {CudaKernel::ActMul, CudaKernel::ActQuantize, CudaKernel::ActRound}};
    CudaTraffic t;
    t.weights = st.make == CudaInputStage::Norm && st.norm ? 4 * cols : 0;
    t.activations = 4 * count * (st.make == CudaInputStage::ActMul ? 2 : 1) + (st.values ? 4 * count : 0) +
                    (codes ? count + (int64_t)sizeof(CudaQ8Meta) * (count / 32) : none ? 0 : 4 * count);
    cuda_count(kinds[(int)st.make][none ? 0 : codes ? 1 : 2], t);
}

void cuda_round_activations(cudaStream_t s, int32_t type, const float* x, float* out, int32_t n, int64_t cols) {
    const int64_t count = (int64_t)n * cols;
    if (count <= 0) return;
    if (type == TYPE_F32) {
        if (out != x) {
            cuda_check(cudaMemcpyAsync(out, x, 4 * (size_t)count, cudaMemcpyDeviceToDevice, s), "copy");
            cuda_count(CudaKernel::Copy, {0, 2 * 4 * count});
        }
        return;
    }
    CudaInputStage st;
    st.x = x;
    st.convert = type;
    st.rounded = out;
    cuda_input_stage(s, st, n, cols);
}

void cuda_quantize_q8x(cudaStream_t s, const float* x, int32_t n, int64_t cols, int8_t* codes, CudaQ8Meta* meta) {
    CudaInputStage st;
    st.x = x;
    st.convert = kCudaCodes;
    st.codes = codes;
    st.meta = meta;
    cuda_input_stage(s, st, n, cols);
}

void cuda_softcap(cudaStream_t s, float* x, int64_t count, float cap) {
    if (count <= 0) return;
    OPTIML_LAUNCH(softcap_kernel, blocks(count), kThreads, s, x, count, cap);
    cuda_check(cudaSuccess, "softcap");
    cuda_count(CudaKernel::Softcap, {0, 2 * 4 * count});
}

int32_t cuda_act_code(int act, bool gelu_f16) { return act == FFN_GELU && gelu_f16 ? kGeluF16 : act; }

void cuda_act_mul(cudaStream_t s, int act, bool gelu_f16, float* g, const float* u, int64_t count) {
    if (count <= 0) return;
    CudaInputStage st;
    st.make = CudaInputStage::ActMul;
    st.x = g;
    st.up = u;
    st.act = cuda_act_code(act, gelu_f16);
    st.values = g;
    cuda_input_stage(s, st, 1, count);  // (one long row: elementwise)
}

}  // namespace optiml
