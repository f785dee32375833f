// Attention on the GPU over the KV cache (layouts in optiml/backend.h's KVLayerView): a per-token
// kernel that normalizes, rotates and stores the new keys and values, and a per-(token, head) kernel
// that runs the softmax over the token's visible positions in chunks (two passes: max and sum online,
// then the weighted values; no split over positions yet), for any context length and grouped-query heads.
#include <cuda_fp16.h>

#include "kernels.cuh"
#include "optiml/common.h"
#include "optiml/ggml_types.h"

namespace optiml {

namespace {

constexpr int kThreads = 128;        // threads of the scores kernel: positions per chunk
constexpr int kMaxHeadDim = 256;     // the models this backend runs (Gemma 3: 256)
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;

__device__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ float warp_max(float v) {
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Sum (or max) over the block; every thread gets the result. `red` holds blockDim.x / 32 floats.
__device__ float block_reduce(float v, float* red, bool is_max) {
    v = is_max ? warp_max(v) : warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < n_warps; i++) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    __syncthreads();  // red is reused by the next call
    return r;
}

// Eight F16 values read as one 16-byte load.
struct alignas(16) Half8 {
    __half h[8];
};

__device__ float load_kv(int32_t type, const uint8_t* p, int64_t i) {
    return type == TYPE_F16 ? __half2float(((const __half*)p)[i]) : ((const float*)p)[i];
}

__device__ void store_kv(int32_t type, uint8_t* p, int64_t i, float v) {
    if (type == TYPE_F16)
        ((__half*)p)[i] = __float2half_rn(v);
    else
        ((float*)p)[i] = v;
}

// One block per (token, head) of q, k and v together (grid.y: n_head q heads, then n_head_kv k heads, then
// n_head_kv v heads), so a decode step spreads over as many multiprocessors as it has heads: Gemma 3's
// per-head norm, RoPE, q's scaling, and the new key or value into the cache.
__global__ void prepare_kernel(CudaAttnArgs a, float* q, float* k, const float* v, const int32_t* seq,
                               const int32_t* pos) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int hd = a.head_dim;
    const int64_t n_q = (int64_t)a.n_head * hd, n_kv = (int64_t)a.n_head_kv * hd;
    if (h >= a.n_head + a.n_head_kv) {  // a value head: into the cache, transposed ([dim][pos])
        const int hv = h - a.n_head - a.n_head_kv;
        const float* vt = v + (size_t)t * n_kv + (size_t)hv * hd;
        uint8_t* v_seq = a.v_cache + (size_t)seq[t] * a.v_seq;
        for (int i = threadIdx.x; i < hd; i += blockDim.x)
            store_kv(a.kv_type, v_seq, ((int64_t)hv * hd + i) * a.n_ctx + pos[t], vt[i]);
        return;
    }
    const bool is_q = h < a.n_head;
    float* x = is_q ? q + (size_t)t * n_q + (size_t)h * hd : k + (size_t)t * n_kv + (size_t)(h - a.n_head) * hd;

    // Gemma 3 normalizes every head of q and k before rotating them (the sum of squares in double).
    const float* w = is_q ? a.q_norm : a.k_norm;
    if (w) {
        double sum = 0;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) sum += (double)x[i] * x[i];
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        __shared__ double dred[kThreads / 32];
        if (threadIdx.x % 32 == 0) dred[threadIdx.x / 32] = sum;
        __syncthreads();
        double total = 0;
        for (int i = 0; i < (int)(blockDim.x / 32); i++) total += dred[i];
        const float scale = (float)(1.0 / sqrt(total / (double)hd + (double)a.rms_eps));
        __syncthreads();
        for (int i = threadIdx.x; i < hd; i += blockDim.x) x[i] = x[i] * scale * w[i];
        __syncthreads();
    }

    // RoPE: pair i turns by pos * base^(-2i/n_rot) (scaled, or divided by its factor).
    const int half = a.n_rot / 2;
    const float theta_scale = powf(a.rope_base, -2.0f / (float)a.n_rot);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        // The angle advanced by one float multiplication per pair, as ops.cpp's rope_cos_sin (and ggml)
        // compute it: powf would be closer to the real angle and further from the CPU's.
        float theta = (float)pos[t];
        for (int j = 0; j < i; j++) theta *= theta_scale;
        const float ang = a.freq_factors ? theta / a.freq_factors[i] * a.rope_scale : theta * a.rope_scale;
        float sn, cs;
        sincosf(ang, &sn, &cs);
        float* x0 = a.neox ? &x[i] : &x[2 * i];
        float* x1 = a.neox ? &x[i + half] : &x[2 * i + 1];
        const float v0 = *x0, v1 = *x1;
        *x0 = v0 * cs - v1 * sn;
        *x1 = v0 * sn + v1 * cs;
    }
    __syncthreads();

    if (is_q) {
        if (a.q_scale != 1.0f)
            for (int i = threadIdx.x; i < hd; i += blockDim.x) x[i] *= a.q_scale;
        return;
    }
    uint8_t* k_dst = a.k_cache + (size_t)seq[t] * a.k_seq + (size_t)pos[t] * a.k_row;
    const int64_t k0 = (int64_t)(h - a.n_head) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) store_kv(a.kv_type, k_dst, k0 + i, x[i]);
}

// One block per (head, token), as the CPU computes it (attention.cpp) but for summation order: q rounded to
// the cache's type for the dot products with the keys, the softmax's weights normalized and rounded to it
// before the sum over the values. Pass 1 runs the softmax's max and sum online over chunks of kThreads
// positions (one per thread); pass 2 recomputes each chunk's scores, weights them, and each thread
// accumulates its output dimensions.
__global__ void scores_kernel(CudaAttnArgs a, const float* q, const int32_t* seq, const int32_t* pos, float* out) {
    __shared__ float sq[kMaxHeadDim];
    __shared__ float sp[kThreads];
    __shared__ float red[kThreads / 32];
    const int h = blockIdx.x, t = blockIdx.y;
    const int hd = a.head_dim;
    const int kvh = h / (a.n_head / a.n_head_kv);
    const size_t elem = a.kv_type == TYPE_F16 ? 2 : 4;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float v = q[((size_t)t * a.n_head + h) * hd + d];
        sq[d] = a.kv_type == TYPE_F16 ? __half2float(__float2half_rn(v)) : v;
    }
    __syncthreads();

    const int64_t n_seen = (int64_t)pos[t] + 1;
    const int64_t first = a.n_swa > 0 && n_seen > a.n_swa ? n_seen - a.n_swa : 0;
    const uint8_t* k_seq = a.k_cache + (size_t)seq[t] * a.k_seq + (size_t)kvh * hd * elem;
    const uint8_t* v_seq = a.v_cache + (size_t)seq[t] * a.v_seq;
    // F16 rows read 16 bytes at a time where they are aligned (a thread's key row is one contiguous run,
    // so byte-wide loads would leave most of each memory transaction unused); the sums run in the same
    // order either way.
    const bool k_vec = a.kv_type == TYPE_F16 && hd % 8 == 0 && a.k_row % 16 == 0 && a.k_seq % 16 == 0 &&
                       ((uintptr_t)a.k_cache % 16) == 0;
    const bool v_vec = a.kv_type == TYPE_F16 && a.n_ctx % 8 == 0 && a.v_seq % 16 == 0 &&
                       ((uintptr_t)a.v_cache % 16) == 0;
    auto score = [&](int64_t s) {
        const uint8_t* kr = k_seq + (size_t)s * a.k_row;
        float dot = 0.0f;
        if (k_vec) {
            for (int d0 = 0; d0 < hd; d0 += 8) {
                const Half8 k8 = *(const Half8*)(kr + 2 * (size_t)d0);
#pragma unroll
                for (int i = 0; i < 8; i++) dot += sq[d0 + i] * __half2float(k8.h[i]);
            }
        } else {
            for (int d = 0; d < hd; d++) dot += sq[d] * load_kv(a.kv_type, kr, d);
        }
        return dot * a.kq_scale;
    };

    float m = -INFINITY, l = 0.0f;
    for (int64_t s0 = first; s0 < n_seen; s0 += kThreads) {
        const int64_t s = s0 + threadIdx.x;
        const float sc = s < n_seen ? score(s) : -INFINITY;
        const float m_new = fmaxf(m, block_reduce(sc, red, true));
        const float chunk_sum = block_reduce(s < n_seen ? expf(sc - m_new) : 0.0f, red, false);
        l = l * expf(m - m_new) + chunk_sum;
        m = m_new;
    }
    const float inv = 1.0f / l;

    float o[kDimsPerThread];
    for (int j = 0; j < kDimsPerThread; j++) o[j] = 0.0f;
    for (int64_t s0 = first; s0 < n_seen; s0 += kThreads) {
        const int64_t s = s0 + threadIdx.x;
        float p = s < n_seen ? expf(score(s) - m) * inv : 0.0f;
        if (a.kv_type == TYPE_F16) p = __half2float(__float2half_rn(p));
        sp[threadIdx.x] = p;
        __syncthreads();
        const int count = (int)(n_seen - s0 < kThreads ? n_seen - s0 : kThreads);
        for (int j = 0; j < kDimsPerThread; j++) {
            const int d = threadIdx.x + j * kThreads;
            if (d >= hd) break;
            const uint8_t* vr = v_seq + ((size_t)(kvh * hd + d) * a.n_ctx + s0) * elem;
            float acc = 0.0f;
            int i = 0;
            if (v_vec && s0 % 8 == 0)
                for (; i + 8 <= count; i += 8) {
                    const Half8 v8 = *(const Half8*)(vr + 2 * (size_t)i);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc += sp[i + e] * __half2float(v8.h[e]);
                }
            for (; i < count; i++) acc += sp[i] * load_kv(a.kv_type, vr, i);
            o[j] += acc;
        }
        __syncthreads();  // sp is rewritten by the next chunk
    }
    for (int j = 0; j < kDimsPerThread; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d < hd) out[((size_t)t * a.n_head + h) * hd + d] = o[j];
    }
}

}  // namespace

void cuda_attn_prepare(cudaStream_t s, const CudaAttnArgs& a, float* q, float* k, const float* v, const int32_t* seq,
                       const int32_t* pos, int32_t n) {
    if (n <= 0) return;
    // 64 threads: a head's pairs (head_dim / 2) at most twice over for the usual head sizes.
    OPTIML_LAUNCH(prepare_kernel, dim3(n, a.n_head + 2 * a.n_head_kv), 64, s, a, q, k, v, seq, pos);
    cuda_check(cudaSuccess, "attention (prepare)");
}

void cuda_attn_scores(cudaStream_t s, const CudaAttnArgs& a, const float* q, const int32_t* seq, const int32_t* pos,
                      int32_t n, float* out) {
    if (n <= 0) return;
    if (a.head_dim > kMaxHeadDim)
        throw UnsupportedModelError(format("the CUDA attention handles heads of up to %d values, this model has %d",
                                           kMaxHeadDim, a.head_dim));
    if (n > 65535) throw ArgumentError(format("cuda attention: %d tokens is more than one launch holds", n));
    OPTIML_LAUNCH(scores_kernel, dim3(a.n_head, n), kThreads, s, a, q, seq, pos, out);
    cuda_check(cudaSuccess, "attention (scores)");
}

}  // namespace optiml
