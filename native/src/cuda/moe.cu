// The mixture-of-experts steps around the products on the GPU: a step's rows gathered by expert, the
// shared expert's sigmoid gate, and each token's experts summed as the CPU sums them (moe_combine in
// native/src/cpu/backend/moe_ffn.cpp: best first, then the shared expert).
#include "kernels.cuh"
#include "optiml/common.h"

namespace optiml {

namespace {

constexpr int kThreads = 256;

__global__ void gather_rows_kernel(const float* src, const int32_t* idx, int64_t cols, float* dst) {
    const float* s = src + (size_t)idx[blockIdx.x] * cols;
    float* d = dst + (size_t)blockIdx.x * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) d[i] = s[i];
}

__global__ void sigmoid_kernel(float* x, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = 1.0f / (1.0f + expf(-x[i]));
}

// One block per token: its k rows of d weighted and added in order, then the shared expert.
__global__ void combine_kernel(int32_t k, int64_t cols, const float* weight, const int32_t* slot, const float* d,
                               const float* sy, const float* sgate, float* y) {
    const int32_t t = blockIdx.x;
    float* yt = y + (size_t)t * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = 0.0f;
        for (int32_t j = 0; j < k; j++) {
            const int32_t row = slot ? slot[t * k + j] : t * k + j;
            const float p = d[(size_t)row * cols + i] * weight[t * k + j];
            v = j == 0 ? p : v + p;
        }
        if (sy) v += sy[(size_t)t * cols + i] * sgate[t];
        yt[i] = v;
    }
}

__global__ void fill_kernel(float* x, int64_t count, float value) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) x[i] = value;
}

// Row r of y ([n_rows][cols]) plus its expert's row of bias ([n_expert][cols]): one block per row.
__global__ void expert_bias_kernel(float* y, const float* bias, const int32_t* expert, int64_t cols) {
    const float* b = bias + (size_t)expert[blockIdx.x] * cols;
    float* yr = y + (size_t)blockIdx.x * cols;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) yr[i] += b[i];
}

// One thread per token (a decode step's few tokens; 128 experts are a few thousand steps): the host's
// moe_route, step for step (expf for std::exp, so a near-tie may choose differently). softmax_chosen
// (gpt-oss): the raw logits rank the experts and the chosen ones' softmax weighs them.
__global__ void route_kernel(const float* logits, int32_t n, int32_t n_expert, int32_t k, bool norm, float scale,
                             bool softmax_chosen, int32_t* chosen, float* weight) {
    const int32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* l = logits + (size_t)t * n_expert;
    float mx = l[0];
    for (int32_t e = 1; e < n_expert; e++) mx = l[e] > mx ? l[e] : mx;
    double sum = 0;
    for (int32_t e = 0; e < n_expert; e++) sum += expf(l[e] - mx);
    // (ranking by logits is ranking by their softmax: only the weights differ)
    const float inv = (float)(1.0 / sum);
    int32_t* ct = chosen + (size_t)t * k;
    float* wt = weight + (size_t)t * k;
    float wsum = 0;
    for (int32_t j = 0; j < k; j++) {  // the next best: the highest p not taken (ties: the lower index)
        int32_t best = -1;
        float bp = 0;
        for (int32_t e = 0; e < n_expert; e++) {
            bool taken = false;
            for (int32_t i = 0; i < j; i++) taken = taken || ct[i] == e;
            const float p = expf(l[e] - mx) * inv;
            if (!taken && (best < 0 || p > bp)) best = e, bp = p;
        }
        ct[j] = best;
        wt[j] = bp;
        wsum += bp;
    }
    if (softmax_chosen) {  // as the host's softmax over the k chosen logits
        float cmx = l[ct[0]];
        for (int32_t j = 1; j < k; j++) cmx = l[ct[j]] > cmx ? l[ct[j]] : cmx;
        double csum = 0;
        for (int32_t j = 0; j < k; j++) csum += wt[j] = expf(l[ct[j]] - cmx);
        const float cinv = (float)(1.0 / csum);
        for (int32_t j = 0; j < k; j++) wt[j] *= cinv;
    }
    if (norm) {
        const float d = wsum > 6.103515625e-5f ? wsum : 6.103515625e-5f;
        for (int32_t j = 0; j < k; j++) wt[j] /= d;
    }
    if (scale != 1.0f)
        for (int32_t j = 0; j < k; j++) wt[j] *= scale;
}

}  // namespace

void cuda_moe_route(cudaStream_t s, const float* logits, int32_t n, int32_t n_expert, int32_t k, bool norm,
                    float scale, bool softmax_chosen, int32_t* chosen, float* weight) {
    if (n <= 0) return;
    if (k < 1 || k > n_expert)  // the kernel would leave a choice at -1 and index with it
        throw ArgumentError(format("moe_route: %d experts a token out of %d", k, n_expert));
    OPTIML_LAUNCH(route_kernel, (unsigned)((n + 31) / 32), 32, s, logits, n, n_expert, k, norm, scale, softmax_chosen,
                  chosen, weight);
    cuda_check(cudaSuccess, "moe_route");
    cuda_count(CudaKernel::MoERoute, {0, 4 * (int64_t)n * n_expert + 8 * (int64_t)n * k});
}

void cuda_add_expert_bias(cudaStream_t s, float* y, const float* bias, const int32_t* expert, int64_t n_rows,
                          int64_t cols) {
    if (n_rows <= 0 || !bias) return;
    OPTIML_LAUNCH(expert_bias_kernel, (unsigned)n_rows, kThreads, s, y, bias, expert, cols);
    cuda_check(cudaSuccess, "add_expert_bias");
    cuda_count(CudaKernel::AddBias, {0, 3 * 4 * n_rows * cols + 4 * n_rows});
}

void cuda_fill(cudaStream_t s, float* x, int64_t count, float value) {
    if (count <= 0) return;
    OPTIML_LAUNCH(fill_kernel, (unsigned)((count + kThreads - 1) / kThreads), kThreads, s, x, count, value);
    cuda_check(cudaSuccess, "fill");
    cuda_count(CudaKernel::Sigmoid, {0, 4 * count});
}

void cuda_gather_rows(cudaStream_t s, const float* src, const int32_t* idx, int64_t n_rows, int64_t cols, float* dst) {
    if (n_rows <= 0) return;
    OPTIML_LAUNCH(gather_rows_kernel, (unsigned)n_rows, kThreads, s, src, idx, cols, dst);
    cuda_check(cudaSuccess, "gather_rows");
    cuda_count(CudaKernel::Gather, {0, 2 * 4 * n_rows * cols + 4 * n_rows});
}

void cuda_sigmoid(cudaStream_t s, float* x, int64_t count) {
    if (count <= 0) return;
    OPTIML_LAUNCH(sigmoid_kernel, (unsigned)((count + kThreads - 1) / kThreads), kThreads, s, x, count);
    cuda_check(cudaSuccess, "sigmoid");
    cuda_count(CudaKernel::Sigmoid, {0, 2 * 4 * count});
}

void cuda_moe_combine(cudaStream_t s, int32_t n, int32_t k, int64_t cols, const float* weight, const int32_t* slot,
                      const float* d, const float* sy, const float* sgate, float* y) {
    if (n <= 0) return;
    OPTIML_LAUNCH(combine_kernel, (unsigned)n, kThreads, s, k, cols, weight, slot, d, sy, sgate, y);
    cuda_check(cudaSuccess, "moe_combine");
    cuda_count(CudaKernel::MoECombine, {0, 4 * (int64_t)n * cols * (k + 1 + (sy ? 1 : 0)) + 8 * (int64_t)n * k});
}

}  // namespace optiml
