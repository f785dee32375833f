// Attention on the GPU over the KV cache (layouts in optiml/backend.h's KVLayerView): a per-token
// kernel that normalizes, rotates and stores the new keys and values, and a per-(token, head) kernel
// that runs the softmax over the token's visible positions in chunks (two passes: max and sum online,
// then the weighted values; no split over positions yet), for any context length and grouped-query heads.
//
// Keys and values are F16, F32, or (each on its own) the block formats Q8_0 and Q4_0 in the CPU's layout and
// with its rotation (attn_quant.cpp, attention.cpp): a quantized side is rotated by a Walsh-Hadamard
// transform before it is quantized (q with the keys, the attention output back after the values), keys are
// rows of blocks whose dot products with q's Q8_0 codes are integer sums as the CPU's vec_dot, and values
// are rows too, weighed in float. The bytes are the CPU's, so a cache moves between the devices (attention
// offload) and both read it alike.
#include <cuda_fp16.h>

#include "kernels.cuh"
#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/rope_yarn.h"

namespace optiml {

namespace {

constexpr int kThreads = 128;        // threads of the scores kernel: positions per chunk
constexpr int kMaxHeadDim = 256;     // the models this backend runs (Gemma 3: 256)
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;
constexpr int kMaxBlocks = kMaxHeadDim / 32;  // a quantized head's blocks of 32 values

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

__host__ __device__ bool kv_quantized(int32_t type) { return type == TYPE_Q8_0 || type == TYPE_Q4_0; }

// Bytes of n values of a cache type (row_size for the four the cache stores; n a multiple of 32 when
// quantized).
__device__ size_t kv_bytes(int32_t type, int64_t n) {
    if (type == TYPE_Q8_0) return (size_t)(n / 32) * sizeof(block_q8_0);
    if (type == TYPE_Q4_0) return (size_t)(n / 32) * sizeof(block_q4_0);
    return (size_t)n * (type == TYPE_F16 ? 2 : 4);
}

// An f16 scale's bits as a float (the hardware conversion is exact).
__device__ float half_bits(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// x[0..n) (device or shared memory) rotated in place in stripes of `block` values, as the CPU's kv_rotate:
// the fast Walsh-Hadamard transform's rounds of butterflies (Sylvester's order) then 1/sqrt(block). Each
// value goes through the same float operations as there, so the bits are the CPU's. Every thread of the
// block calls it (it synchronizes between rounds).
__device__ void rotate(float* x, int n, int block) {
    for (int h = 1; h < block; h *= 2) {
        for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
            const int j = p / h * 2 * h + p % h;  // the pair (j, j + h): h apart within a run of 2h
            const float a = x[j], c = x[j + h];
            x[j] = a + c;
            x[j + h] = a - c;
        }
        __syncthreads();
    }
    const float norm = 1.0f / sqrtf((float)block);
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] *= norm;
    __syncthreads();
}

// Q8_0 codes of 32 values as the CPU converts activations (quant_legacy.cpp's q8_activation_codes:
// 127 / amax, ties to even), which is also how it writes a q8_0 cache; returns the scale before its f16
// rounding.
__device__ float q8_0_codes(const float* x, int8_t* qs) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; j++) qs[j] = (int8_t)rintf(x[j] * id);
    return amax / 127.0f;
}

// One block of 32 values into the cache (dst: 2-byte aligned), as the CPU's kv_from_float writes it: Q8_0
// by q8_0_codes, Q4_0 by llama.cpp's reference quantize_row_q4_0 (the signed extreme maps to code 0, codes
// truncated after + 8.5, the product rounded before the add as the CPU's fp_barrier keeps it).
__device__ void quantize_block(int32_t type, const float* x, uint8_t* dst) {
    if (type == TYPE_Q8_0) {
        const float d = q8_0_codes(x, (int8_t*)(dst + 2));
        *(__half*)dst = __float2half_rn(d);
        return;
    }
    float amax = fabsf(x[0]), max = x[0];  // the first of largest magnitude, with its sign
    for (int j = 1; j < 32; j++)
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *(__half*)dst = __float2half_rn(d);
    for (int j = 0; j < 16; j++) {
        int c[2];
        for (int half = 0; half < 2; half++) {
            const float t = __fmul_rn(x[j + 16 * half], id) + 8.5f;
            c[half] = !(t >= 0.0f) ? 0 : t >= 15.0f ? 15 : (int)t;  // NaN: 0, as the CPU's trunc_code
        }
        dst[2 + j] = (uint8_t)(c[0] | (c[1] << 4));
    }
}

// A head of hd values (rotated already where the CPU rotates them) into its blocks at dst; a thread per block.
__device__ void quantize_head(int32_t type, const float* x, int hd, uint8_t* dst) {
    const size_t bytes = type == TYPE_Q8_0 ? sizeof(block_q8_0) : sizeof(block_q4_0);
    for (int b = threadIdx.x; b < hd / 32; b += blockDim.x) quantize_block(type, x + 32 * b, dst + b * bytes);
}

// One key block against block b of the query's Q8_0 codes (xq: its eight words): the integer sum of the
// code products (four bytes a step), for Q4_0 less 8 per query code (its codes are nibbles - 8), scaled as
// the CPU's vec_dot_q8_0_q8_0 / vec_dot_q4_0_q8_0 scale it. kw: Q8_0's eight words of codes, or Q4_0's
// four words of nibbles (low nibbles: values 0..15, high: 16..31).
template <int TYPE>
__device__ float key_block(float dk, const int* kw, const int32_t* xq, float dq, int xsum) {
    int sumi = 0;
    if (TYPE == TYPE_Q8_0) {
#pragma unroll
        for (int j = 0; j < 8; j++) sumi = __dp4a(kw[j], xq[j], sumi);
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) sumi = __dp4a(kw[j] & 0x0F0F0F0F, xq[j], sumi);
#pragma unroll
        for (int j = 0; j < 4; j++) sumi = __dp4a((kw[j] >> 4) & 0x0F0F0F0F, xq[4 + j], sumi);
        sumi -= 8 * xsum;
    }
    return (float)sumi * (dk * dq);
}

// Four bytes at a 2-byte aligned address (blocks hold their 16-bit scale first).
__device__ int load_i32_a2(const uint8_t* p) {
    const uint16_t* h = (const uint16_t*)p;
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

// The dot product of one key head (n_blocks blocks at kr) with the query's codes, block by block in the
// CPU's order. pairs: the head is whole pairs of blocks at a 4-byte aligned address (head_dim a multiple
// of 64): a pair (68 or 36 bytes) is read as 32-bit words, block 0's scale the low half of word 0 and its
// codes straddling words, block 1's scale the high half of word W and its codes words W + 1 on (half as
// many loads as reading 16 bits at a time, which any 2-byte aligned block allows).
template <int TYPE>
__device__ float key_dot(const uint8_t* kr, int n_blocks, bool pairs, const int32_t* xq, const float* xd,
                         const int* xs) {
    constexpr int B = TYPE == TYPE_Q8_0 ? (int)sizeof(block_q8_0) : (int)sizeof(block_q4_0);  // 34 or 18
    constexpr int W = (B - 2) / 4;  // words of codes per block: 8 or 4
    float dot = 0.0f;
    if (pairs) {
        const uint32_t* p = (const uint32_t*)kr;
        for (int b = 0; b < n_blocks; b += 2, p += 2 * B / 4) {
            uint32_t w[2 * B / 4];
#pragma unroll
            for (int i = 0; i < 2 * B / 4; i++) w[i] = p[i];
            int c[W];
#pragma unroll
            for (int j = 0; j < W; j++) c[j] = (int)((w[j] >> 16) | (w[j + 1] << 16));
            dot += key_block<TYPE>(half_bits((uint16_t)(w[0] & 0xFFFF)), c, xq + 8 * b, xd[b], xs[b]);
            dot += key_block<TYPE>(half_bits((uint16_t)(w[W] >> 16)), (const int*)(w + W + 1), xq + 8 * (b + 1),
                                   xd[b + 1], xs[b + 1]);
        }
        return dot;
    }
    for (int b = 0; b < n_blocks; b++) {
        const uint8_t* blk = kr + (size_t)b * B;
        int c[W];
#pragma unroll
        for (int j = 0; j < W; j++) c[j] = load_i32_a2(blk + 2 + 4 * j);
        dot += key_block<TYPE>(half_bits(*(const uint16_t*)blk), c, xq + 8 * b, xd[b], xs[b]);
    }
    return dot;
}

// sum_i w[i] * (value `in_block` of the block at blk + i * stride): one dimension of the CPU's attn_mad over
// `count` quantized value rows, the weight times the block's scale first as there; rows of weight 0 are
// skipped as there (a masked position's row may hold whatever a truncated sequence left). The weights are
// the same for every thread, so the skip never splits a warp, and a warp's 32 dimensions are one block:
// the warp reads each row's block as one run of bytes.
template <int TYPE>
__device__ float value_dot(const uint8_t* blk, int in_block, size_t stride, const float* w, int count) {
    const uint8_t* code = blk + 2 + (TYPE == TYPE_Q8_0 ? in_block : in_block % 16);
    const int shift = TYPE == TYPE_Q4_0 && in_block >= 16 ? 4 : 0;
    float acc = 0.0f;
    for (int i = 0; i < count; i++, blk += stride, code += stride) {
        if (w[i] == 0.0f) continue;
        const float s = w[i] * half_bits(*(const uint16_t*)blk);
        const int q = TYPE == TYPE_Q8_0 ? (int)(int8_t)*code : ((*code >> shift) & 0x0F) - 8;
        acc += s * (float)q;
    }
    return acc;
}

// One block per (token, head) of q, k and v together (grid.y: n_head q heads, then n_head_kv k heads, then
// n_head_kv v heads), so a decode step spreads over as many multiprocessors as it has heads: Gemma 3's
// per-head norm, RoPE, q's scaling, and the new key or value into the cache.
// kQuant: some side of the cache is quantized (an F16/F32 cache gets the kernel without that code).
template <bool kQuant>
__global__ void prepare_kernel(CudaAttnArgs a, float* q, float* k, const float* v, const int32_t* seq,
                               const int32_t* pos) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int hd = a.head_dim;
    const int64_t n_q = (int64_t)a.n_head * hd, n_kv = (int64_t)a.n_head_kv * hd;
    if (h >= a.n_head + a.n_head_kv) {  // a value head: into the cache, transposed ([dim][pos])
        const int hv = h - a.n_head - a.n_head_kv;
        const float* vt = v + (size_t)t * n_kv + (size_t)hv * hd;
        uint8_t* v_seq = a.v_cache + (size_t)seq[t] * a.v_seq;
        if (kQuant && a.v_row) {
            // Quantized values are rows like the keys (KVLayerView), rotated first where the CPU rotates them.
            __shared__ float sv[kMaxHeadDim];
            for (int i = threadIdx.x; i < hd; i += blockDim.x) sv[i] = vt[i];
            __syncthreads();
            if (a.rot_v) rotate(sv, hd, a.rot_v);
            quantize_head(a.v_type, sv, hd, v_seq + (size_t)pos[t] * a.v_row + (size_t)hv * kv_bytes(a.v_type, hd));
            return;
        }
        for (int i = threadIdx.x; i < hd; i += blockDim.x)
            store_kv(a.v_type, v_seq, ((int64_t)hv * hd + i) * a.n_ctx + pos[t], vt[i]);
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
        const float extrap = a.freq_factors ? theta / a.freq_factors[i] : theta;
        const float ang = rope_yarn_angle(extrap, a.rope_scale, i, a.yarn_ext, a.yarn_low, a.yarn_high);
        float sn, cs;
        sincosf(ang, &sn, &cs);
        sn *= a.rope_mscale;
        cs *= a.rope_mscale;
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
        if (kQuant && a.rot_k) {  // q turned with the keys (q.k unchanged), after its scaling as on the CPU
            __syncthreads();
            rotate(x, hd, a.rot_k);
        }
        return;
    }
    uint8_t* k_dst = a.k_cache + (size_t)seq[t] * a.k_seq + (size_t)pos[t] * a.k_row;
    if (kQuant && kv_quantized(a.k_type)) {
        if (a.rot_k) rotate(x, hd, a.rot_k);
        quantize_head(a.k_type, x, hd, k_dst + (size_t)(h - a.n_head) * kv_bytes(a.k_type, hd));
        return;
    }
    const int64_t k0 = (int64_t)(h - a.n_head) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) store_kv(a.k_type, k_dst, k0 + i, x[i]);
}

// The block's query head into shared memory, rounded to the keys' type (F16, F32), and for quantized keys
// its Q8_0 codes (four to a word in sqc), their blocks' f16-rounded scales (sqd) and code sums (sqs, for
// Q4_0's offset), as the CPU converts it; a thread per block.
__device__ void stage_query(int k_type, bool k_quant, const float* qh, int hd, float* sq, int32_t* sqc, float* sqd,
                            int* sqs) {
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float v = qh[d];
        sq[d] = k_type == TYPE_F16 ? __half2float(__float2half_rn(v)) : v;
    }
    __syncthreads();
    if (!k_quant) return;
    for (int b = threadIdx.x; b < hd / 32; b += blockDim.x) {
        int8_t* codes = (int8_t*)sqc + 32 * b;
        sqd[b] = __half2float(__float2half_rn(q8_0_codes(sq + 32 * b, codes)));
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += codes[j];
        sqs[b] = sum;
    }
    __syncthreads();
}

// A thread's output dimensions (o[j]: d = x + j * kThreads) turned back by the values' rotation, through
// `so` (hd floats of shared memory). Every thread of the block calls it.
__device__ __forceinline__ void rotate_back(float* o, float* so, int hd, int block) {
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d < hd) so[d] = o[j];
    }
    __syncthreads();
    rotate(so, hd, block);
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d < hd) o[j] = so[d];
    }
}

// The attention's output of one (token, head): thread x's dimensions d = x + j * kThreads (o[j]) at
// out[row0 + d], stored as cuda_attn_scores' convert asks: a warp's 32 dimensions are one 32-value block
// of the row (head_dim a multiple of 32 wherever convert is not -1), converted as cuda_input_stage
// converts them.
__device__ __forceinline__ void store_output(const float* o, int hd, size_t row0, float* out, int32_t convert,
                                             int8_t* codes, CudaQ8Meta* meta) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) {
        const int d = threadIdx.x + j * kThreads;
        if (d >= hd) break;  // (whole warps where the output is converted)
        const size_t at = row0 + d;
        if (convert == -1) {
            out[at] = o[j];
            continue;
        }
        const float amax = warp_max(fabsf(o[j]));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        if (convert != kCudaCodes) {  // Q8_0 / Q8_1 rounding
            out[at] = __half2float(__float2half_rn(amax / 127.0f)) * rintf(o[j] * id);
            continue;
        }
        const int c = (int)rintf(o[j] * id);
        codes[at] = (int8_t)c;
        int sum = c;
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (lane == 0) {
            const float dq = amax / 127.0f;
            meta[at / 32] = CudaQ8Meta{__half2float(__float2half_rn(dq)), __half2float(__float2half_rn(dq * (float)sum)),
                                       sum, 0};
        }
    }
}

// Split z of `splits`: its range of the visible positions [first, last), in whole chunks of kThreads.
__device__ __forceinline__ void split_range(int z, int splits, int64_t& first, int64_t& last) {
    const int64_t chunks = (last - first + kThreads - 1) / kThreads, per = (chunks + splits - 1) / splits;
    const int64_t lo = first + (int64_t)z * per * kThreads;
    last = lo + per * kThreads < last ? lo + per * kThreads : last;
    first = lo;
}

// The softmax's max and sum from every split's (max, sum), in split order (empty splits have sum 0).
__device__ __forceinline__ void combine_splits(const float* part_ml, int splits, float& m, float& l) {
    for (int k = 0; k < splits; k++) m = fmaxf(m, part_ml[2 * k]);
    for (int k = 0; k < splits; k++)
        if (part_ml[2 * k + 1] > 0.0f) l += part_ml[2 * k + 1] * expf(part_ml[2 * k] - m);
}

// A head's sink logit joins the softmax's max m and sum l (gpt-oss): a position whose value is zero.
__device__ __forceinline__ void add_sink(float sink, float& m, float& l) {
    const float m_new = fmaxf(m, sink);
    l = l * expf(m - m_new) + expf(sink - m_new);
    m = m_new;
}

// The splits' partial outputs of one (token, head) added in split order, turned back by the values'
// rotation (rot_v, 0: none) through `so`, and stored as the whole kernel stores its output.
__device__ void add_splits(const float* part_o, int splits, int hd, int rot_v, float* so, size_t head, float* out,
                           int32_t convert, int8_t* codes, CudaQ8Meta* meta) {
    float o[kDimsPerThread];
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) {
        const int d = threadIdx.x + j * kThreads;
        o[j] = 0.0f;
        if (d < hd)
            for (int k = 0; k < splits; k++) o[j] += part_o[(size_t)k * hd + d];
    }
    if (rot_v) rotate_back(o, so, hd, rot_v);
    store_output(o, hd, head * hd, out, convert, codes, meta);
}

// One block per (head, token), as the CPU computes it (attention.cpp) but for summation order: q rounded to
// the keys' type for the dot products with them (F16, F32; Q8_0 codes for quantized keys), the softmax's
// weights normalized and rounded to the values' type before the sum over them (F16, F32; float for
// quantized values, whose weighted sum is then rotated back). Pass 1 runs the softmax's max and sum online over chunks of kThreads
// positions (one per thread); pass 2 recomputes each chunk's scores, weights them, and each thread
// accumulates its output dimensions.
// kQuant as for prepare_kernel.
//
// Split over the KV length (flash-decoding, for few tokens over long contexts: grid z = the splits, each a
// contiguous range of the visible positions in whole chunks), the same work runs as three launches: phase
// 1, each split's max and sum; phase 2, each split combines every split's (max, sum) into the softmax's,
// then weights its own positions' values into a partial output; phase 3 (one block per head and token) adds
// the splits' partial outputs in order and stores the result as phase 0 (the whole kernel) does. part holds
// [token][head][split] (max, sum) pairs, then [token][head][split][head_dim] partial outputs.
template <bool kQuant>
__global__ void scores_kernel(CudaAttnArgs a, const float* q, const int32_t* seq, const int32_t* pos, float* out,
                              int32_t convert, int8_t* codes, CudaQ8Meta* meta, int phase, int splits, float* part) {
    __shared__ float sq[kMaxHeadDim];
    __shared__ int32_t sqc[kMaxHeadDim / 4];  // quantized keys: q's Q8_0 codes, four to a word,
    __shared__ float sqd[kMaxBlocks];         // its blocks' scales (f16-rounded)
    __shared__ int sqs[kMaxBlocks];           // and their codes' sums (for Q4_0's offset)
    __shared__ float sp[kThreads];
    __shared__ float red[kThreads / 32];
    const int h = blockIdx.x, t = blockIdx.y, z = blockIdx.z;
    const int hd = a.head_dim;
    const int kvh = h / (a.n_head / a.n_head_kv);
    const bool k_quant = kQuant && kv_quantized(a.k_type), v_rows = kQuant && a.v_row != 0;
    const size_t elem_v = a.v_type == TYPE_F16 ? 2 : 4;  // a transposed value's
    const size_t head = (size_t)t * a.n_head + h;
    float* part_ml = part + 2 * head * splits;  // (phases 1-3)
    float* part_o = part + 2 * (size_t)gridDim.y * a.n_head * splits + head * splits * hd;
    if (phase == 3) return add_splits(part_o, splits, hd, v_rows ? a.rot_v : 0, sq, head, out, convert, codes, meta);
    stage_query(a.k_type, k_quant, q + head * hd, hd, sq, sqc, sqd, sqs);

    const int64_t n_seen = (int64_t)pos[t] + 1;
    int64_t first = a.n_swa > 0 && n_seen > a.n_swa ? n_seen - a.n_swa : 0;
    int64_t last = n_seen;  // this block's positions: [first, last)
    if (phase != 0) split_range(z, splits, first, last);
    const uint8_t* k_seq = a.k_cache + (size_t)seq[t] * a.k_seq + (size_t)kvh * kv_bytes(a.k_type, hd);
    const uint8_t* v_seq = a.v_cache + (size_t)seq[t] * a.v_seq;
    // F16 rows read 16 bytes at a time where they are aligned (a thread's key row is one contiguous run,
    // so byte-wide loads would leave most of each memory transaction unused); the sums run in the same
    // order either way.
    const bool k_vec = a.k_type == TYPE_F16 && hd % 8 == 0 && a.k_row % 16 == 0 && a.k_seq % 16 == 0 &&
                       ((uintptr_t)a.k_cache % 16) == 0;
    const bool v_vec = a.v_type == TYPE_F16 && a.n_ctx % 8 == 0 && a.v_seq % 16 == 0 &&
                       ((uintptr_t)a.v_cache % 16) == 0;
    // Quantized key heads read as pairs of blocks in 32-bit words where they are whole pairs, 4-byte aligned
    // (key_dot; every head of a multiple of 64 values is, in a cache from cudaMalloc).
    const bool k_pairs = k_quant && hd % 64 == 0 && a.k_row % 4 == 0 && a.k_seq % 4 == 0 &&
                         ((uintptr_t)a.k_cache % 4) == 0;
    auto score = [&](int64_t s) {
        const uint8_t* kr = k_seq + (size_t)s * a.k_row;
        float dot = 0.0f;
        if (k_quant) {
            dot = a.k_type == TYPE_Q8_0 ? key_dot<TYPE_Q8_0>(kr, hd / 32, k_pairs, sqc, sqd, sqs)
                                        : key_dot<TYPE_Q4_0>(kr, hd / 32, k_pairs, sqc, sqd, sqs);
        } else if (k_vec) {
            for (int d0 = 0; d0 < hd; d0 += 8) {
                const Half8 k8 = *(const Half8*)(kr + 2 * (size_t)d0);
#pragma unroll
                for (int i = 0; i < 8; i++) dot += sq[d0 + i] * __half2float(k8.h[i]);
            }
        } else {
            for (int d = 0; d < hd; d++) dot += sq[d] * load_kv(a.k_type, kr, d);
        }
        dot *= a.kq_scale;
        return a.softcap > 0.0f ? a.softcap * tanhf(dot / a.softcap) : dot;
    };

    float m = -INFINITY, l = 0.0f;
    if (phase != 2)
        for (int64_t s0 = first; s0 < last; s0 += kThreads) {
            const int64_t s = s0 + threadIdx.x;
            const float sc = s < last ? score(s) : -INFINITY;
            const float m_new = fmaxf(m, block_reduce(sc, red, true));
            const float chunk_sum = block_reduce(s < last ? expf(sc - m_new) : 0.0f, red, false);
            l = l * expf(m - m_new) + chunk_sum;
            m = m_new;
        }
    if (phase == 1) {  // (m and l are the same in every thread)
        if (threadIdx.x < 2) part_ml[2 * z + threadIdx.x] = threadIdx.x == 0 ? m : l;
        return;
    }
    if (phase == 2) combine_splits(part_ml, splits, m, l);
    if (a.sinks) add_sink(a.sinks[h], m, l);  // (once: after the splits are combined)
    const float inv = 1.0f / l;

    float o[kDimsPerThread];
#pragma unroll
    for (int j = 0; j < kDimsPerThread; j++) o[j] = 0.0f;
    for (int64_t s0 = first; s0 < last; s0 += kThreads) {
        const int64_t s = s0 + threadIdx.x;
        float p = s < last ? expf(score(s) - m) * inv : 0.0f;
        if (a.v_type == TYPE_F16) p = __half2float(__float2half_rn(p));
        sp[threadIdx.x] = p;
        __syncthreads();
        const int count = (int)(last - s0 < kThreads ? last - s0 : kThreads);
#pragma unroll
        for (int j = 0; j < kDimsPerThread; j++) {
            const int d = threadIdx.x + j * kThreads;
            if (d >= hd) break;
            if (v_rows) {  // quantized values: rows of blocks, dimension d's block in each (value_dot)
                const int dim = kvh * hd + d;
                const uint8_t* blk = v_seq + (size_t)s0 * a.v_row + kv_bytes(a.v_type, dim / 32 * 32);
                o[j] += a.v_type == TYPE_Q8_0 ? value_dot<TYPE_Q8_0>(blk, dim % 32, a.v_row, sp, count)
                                              : value_dot<TYPE_Q4_0>(blk, dim % 32, a.v_row, sp, count);
                continue;
            }
            const uint8_t* vr = v_seq + ((size_t)(kvh * hd + d) * a.n_ctx + s0) * elem_v;
            float acc = 0.0f;
            int i = 0;
            if (v_vec && s0 % 8 == 0)
                for (; i + 8 <= count; i += 8) {
                    const Half8 v8 = *(const Half8*)(vr + 2 * (size_t)i);
#pragma unroll
                    for (int e = 0; e < 8; e++) acc += sp[i + e] * __half2float(v8.h[e]);
                }
            for (; i < count; i++) acc += sp[i] * load_kv(a.v_type, vr, i);
            o[j] += acc;
        }
        __syncthreads();  // sp is rewritten by the next chunk
    }
    if (phase == 2) {  // (phase 3 turns the sum back and stores it)
#pragma unroll
        for (int j = 0; j < kDimsPerThread; j++) {
            const int d = threadIdx.x + j * kThreads;
            if (d < hd) part_o[(size_t)z * hd + d] = o[j];
        }
        return;
    }
    // The values were rotated before they were stored: the sum is turned back (through sq: q is read no
    // more, the last chunk ended with every thread at the barrier).
    if (v_rows && a.rot_v) rotate_back(o, sq, hd, a.rot_v);
    store_output(o, hd, head * hd, out, convert, codes, meta);
}

}  // namespace

// What the kernels read: the cache's four types, quantized ones in whole blocks per head.
static void check_cache(const CudaAttnArgs& a) {
    for (int32_t type : {a.k_type, a.v_type}) {
        if (type != TYPE_F16 && type != TYPE_F32 && !kv_quantized(type))
            throw UnsupportedModelError(
                format("the CUDA attention reads f16, f32, q8_0 and q4_0 KV caches, not type %d", type));
        if (kv_quantized(type) && a.head_dim % 32)
            throw UnsupportedModelError(format("the CUDA attention reads a quantized KV cache in blocks of 32 "
                                               "values per head, and this model's heads have %d", a.head_dim));
    }
    if (kv_quantized(a.v_type) != (a.v_row != 0))
        throw Error("internal: quantized values are rows (v_row), f16/f32 ones transposed");
}

// Host-side bytes of n values of a cache type (kv_bytes on the device).
static int64_t cache_bytes(int32_t type, int64_t n) {
    if (type == TYPE_Q8_0) return n / 32 * (int64_t)sizeof(block_q8_0);
    if (type == TYPE_Q4_0) return n / 32 * (int64_t)sizeof(block_q4_0);
    return n * (type == TYPE_F16 ? 2 : 4);
}

// Both kernels keep a head in shared memory (kMaxHeadDim values): a larger head is refused before either runs.
static void check_head_dim(const CudaAttnArgs& a) {
    if (a.head_dim > kMaxHeadDim)
        throw UnsupportedModelError(format("the CUDA attention handles heads of up to %d values, this model has %d",
                                           kMaxHeadDim, a.head_dim));
}

void cuda_attn_prepare(cudaStream_t s, const CudaAttnArgs& a, float* q, float* k, const float* v, const int32_t* seq,
                       const int32_t* pos, int32_t n) {
    if (n <= 0) return;
    check_head_dim(a);
    check_cache(a);
    {
        const int64_t n_q = (int64_t)a.n_head * a.head_dim, n_kv = (int64_t)a.n_head_kv * a.head_dim;
        CudaTraffic t;
        t.weights = 4 * ((a.freq_factors ? a.n_rot / 2 : 0) + (a.q_norm ? a.head_dim : 0) + (a.k_norm ? a.head_dim : 0));
        t.activations = 4 * (int64_t)n * (2 * (n_q + n_kv) + n_kv + 2);  // q, k read and written, v read, seq, pos
        t.kv = (int64_t)n * (cache_bytes(a.k_type, n_kv) + cache_bytes(a.v_type, n_kv));
        cuda_count(CudaKernel::AttnPrepare, t);
    }
    // 64 threads: a head's pairs (head_dim / 2) at most twice over for the usual head sizes.
    const dim3 grid(n, a.n_head + 2 * a.n_head_kv);
    if (kv_quantized(a.k_type) || kv_quantized(a.v_type))
        OPTIML_LAUNCH(prepare_kernel<true>, grid, 64, s, a, q, k, v, seq, pos);
    else
        OPTIML_LAUNCH(prepare_kernel<false>, grid, 64, s, a, q, k, v, seq, pos);
    cuda_check(cudaSuccess, "attention (prepare)");
}

void cuda_attn_scores(cudaStream_t s, const CudaAttnArgs& a, const float* q, const int32_t* seq, const int32_t* pos,
                      int32_t n, float* out, int32_t convert, int8_t* codes, CudaQ8Meta* meta, int32_t splits,
                      float* part) {
    if (n <= 0) return;
    check_head_dim(a);
    if (n > 65535) throw ArgumentError(format("cuda attention: %d tokens is more than one launch holds", n));
    check_cache(a);
    if (convert != -1 && (a.head_dim % 32 || (convert != kCudaCodes && convert != TYPE_Q8_0 && convert != TYPE_Q8_1) ||
                          (convert == kCudaCodes && (!codes || !meta))))
        throw Error("internal: the attention converts its output to codes or Q8_0/Q8_1 in whole 32-value blocks only");
    if (splits < 1 || splits > kCudaMaxAttnSplits || (splits > 1 && !part))
        throw Error("internal: 1 to 64 splits of the attention, the partials' buffer with more than one");
    const bool quant = kv_quantized(a.k_type) || kv_quantized(a.v_type);
    auto launch = [&](int phase, unsigned z) {
        const dim3 grid(a.n_head, n, z);
        if (quant)
            OPTIML_LAUNCH(scores_kernel<true>, grid, kThreads, s, a, q, seq, pos, out, convert, codes, meta, phase, splits, part);
        else
            OPTIML_LAUNCH(scores_kernel<false>, grid, kThreads, s, a, q, seq, pos, out, convert, codes, meta, phase, splits, part);
        cuda_check(cudaSuccess, "attention (scores)");
    };
    const int64_t n_q = (int64_t)a.n_head * a.head_dim;
    // q read, seq, pos; the output written (as floats, or codes and their scales)
    CudaTraffic t;
    t.activations = 4 * (int64_t)n * (n_q + 2) +
                    (convert == kCudaCodes ? (int64_t)n * (n_q + (int64_t)sizeof(CudaQ8Meta) * (n_q / 32))
                                           : 4 * (int64_t)n * n_q);
    // Each visible position's key and value heads, once per kv head (the q heads of a group share them).
    t.kv_per_position = (int64_t)a.n_head_kv * (cache_bytes(a.k_type, a.head_dim) + cache_bytes(a.v_type, a.head_dim));
    t.n_swa = a.n_swa;
    if (splits == 1) {
        launch(0, 1);
        cuda_count(CudaKernel::AttnScores, t);
        return;
    }
    // Split: the same bytes of the cache, and the partials written and read back (kernels.cuh).
    const int64_t partials = 4 * (int64_t)n * a.n_head * splits * (a.head_dim + 2);
    launch(1, (unsigned)splits);
    launch(2, (unsigned)splits);
    launch(3, 1);
    CudaTraffic part_t;
    part_t.activations = partials;
    cuda_count(CudaKernel::AttnSplit, part_t);
    cuda_count(CudaKernel::AttnSplit, part_t);
    cuda_count(CudaKernel::AttnScores, t);
}

}  // namespace optiml
