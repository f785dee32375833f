// Products that give the CPU's bits (issue #44: a split must cost no fidelity). The CPU's 32-value block
// formats (simd_q32.h, every SIMD level, batched or not) compute a row as one chain over its blocks:
//     acc = fma(float(isum), d_w * d_x, acc), then acc = fma(m_w, s_x, acc) for the formats with mins,
// isum being the block's exact integer dot of the weights' codes (minus their offset) with the activation's
// 8-bit codes. Here a warp takes a row and a token; lane k computes block k's integer dot of each chunk of
// 32 blocks, and every lane runs the chain over the chunk's terms passed along the warp in block order.
// The K-quants (simd_kquants.h) compute per 256-value super-block two exact integer totals, the scaled
// products of the codes (isum) and the corrections (corr: the mins, or Q6_K's code offset, met with the
// 16-value sums of the activations), then acc = fma(float(isum), d_w * d_x, acc) and
// acc = fma(float(corr), -dmin_w * d_x, acc) (Q4_K, Q5_K) or acc = fma(float(isum - corr), d_w * d_x, acc)
// (Q6_K), super-block after super-block. Here lane 8g + L computes a share of super-block g of each group
// of 4 (bytes 4L..4L+3 of each 32-value chunk), the 8 lanes' integers are added (exact), and every lane
// runs the chain over the group's terms in super-block order.
// The faster decode kernels (matmul.cu) add the lanes' sums at the end instead, which differs from the CPU
// in the last bits; these run a split's device share, which is small (its hot neurons' gate and up).
#include "dequant.cuh"
#include "kernels.cuh"
#include "launch_matrices.cuh"
#include "optiml/common.h"
#include "optiml/cuda.h"

namespace optiml {

namespace {

constexpr int kRows = 4;  // warps (rows) per thread block

// Block `blk`'s integer dot with the activation's 32 codes x, and its scale (and min) as the CPU reads them.
template <int TYPE>
__device__ __forceinline__ int block_isum(const uint8_t* blk, const int8_t* x, float& d, float& m) {
    using cudaq::half_to_float;
    using cudaq::load_u16;
    m = 0.0f;
    int isum = 0;
    if (TYPE == TYPE_Q8_0) {
        d = half_to_float(load_u16(blk + offsetof(block_q8_0, d)));
        const int8_t* qs = (const int8_t*)(blk + offsetof(block_q8_0, qs));
        for (int i = 0; i < 32; i++) isum += qs[i] * x[i];
        return isum;
    }
    // 4-bit codes (value l < 16 the low nibble of qs[l], l + 16 the high one), a fifth bit from qh for Q5
    const bool q5 = TYPE == TYPE_Q5_0 || TYPE == TYPE_Q5_1, with_min = TYPE == TYPE_Q4_1 || TYPE == TYPE_Q5_1;
    const int offset = TYPE == TYPE_Q4_0 ? 8 : TYPE == TYPE_Q5_0 ? 16 : 0;
    size_t qs_at, qh_at = 0;
    if (TYPE == TYPE_Q4_0) qs_at = offsetof(block_q4_0, qs);
    else if (TYPE == TYPE_Q4_1) qs_at = offsetof(block_q4_1, qs);
    else if (TYPE == TYPE_Q5_0) qs_at = offsetof(block_q5_0, qs), qh_at = offsetof(block_q5_0, qh);
    else qs_at = offsetof(block_q5_1, qs), qh_at = offsetof(block_q5_1, qh);
    d = half_to_float(load_u16(blk));  // every one of these formats begins with d, then m where it has one
    if (with_min) m = half_to_float(load_u16(blk + 2));
    const uint32_t qh = q5 ? cudaq::load_u32(blk + qh_at) : 0u;
    const uint8_t* qs = blk + qs_at;
    for (int l = 0; l < 16; l++) {
        const int lo = (qs[l] & 0x0F) | (int)(((qh >> l) & 1) << 4);
        const int hi = (qs[l] >> 4) | (int)(((qh >> (l + 16)) & 1) << 4);
        isum += (lo - offset) * x[l] + (hi - offset) * x[l + 16];
    }
    return isum;
}

template <int TYPE>
__global__ void matmul_exact_kernel(LaunchMatrices ms, int64_t cols, const int8_t* __restrict__ codes,
                                    const CudaQ8Meta* __restrict__ meta) {
    constexpr bool kMin = TYPE == TYPE_Q4_1 || TYPE == TYPE_Q5_1;
    using Q = cudaq::QType<TYPE>;
    const int lane = threadIdx.x;
    unsigned unit_in;
    const CudaMatrix m = pick_matrix(ms, blockIdx.x, unit_in);
    const int64_t r = (int64_t)unit_in * kRows + threadIdx.y;
    if (r >= m.rows) return;  // (the whole warp: r depends on the warp only)
    const int64_t t = blockIdx.y, nb = cols / 32;
    const uint8_t* row = m.w + r * m.row_bytes;
    const int8_t* xt = codes + t * cols;
    const CudaQ8Meta* xm = meta + t * nb;
    float acc = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += 32) {
        const int64_t b = b0 + lane < nb ? b0 + lane : nb - 1;  // (lanes past the row's end: terms unused)
        float dw, mw;
        const float isum = (float)block_isum<TYPE>(row + b * Q::block_bytes, xt + 32 * b, dw, mw);
        const float scale = dw * xm[b].d, sx = xm[b].s;
        const int valid = nb - b0 < 32 ? (int)(nb - b0) : 32;
        for (int k = 0; k < valid; k++) {
            acc = fmaf(__shfl_sync(0xffffffffu, isum, k), __shfl_sync(0xffffffffu, scale, k), acc);
            if (kMin) acc = fmaf(__shfl_sync(0xffffffffu, mw, k), __shfl_sync(0xffffffffu, sx, k), acc);
        }
    }
    if (lane != 0) return;
    float s = acc;
    if (m.bias) s += m.bias[r];
    float* out = m.y + t * m.rows + r;
    *out = m.accumulate ? *out + s : s;
}

// Element e's unsigned code in a K-quant super-block (Q6_K's value is code - 32, taken out by corr).
template <int TYPE>
__device__ __forceinline__ int k_code(const uint8_t* blk, int e) {
    const int c = e / 32, l = e % 32;
    if (TYPE == TYPE_Q6_K) {
        const int h = e / 128, k = c % 4;
        const int lo = (blk[offsetof(block_q6_K, ql) + 64 * h + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 0xF;
        return lo | (((blk[offsetof(block_q6_K, qh) + 32 * h + l] >> (2 * k)) & 3) << 4);
    }
    const size_t qs = TYPE == TYPE_Q4_K ? offsetof(block_q4_K, qs) : offsetof(block_q5_K, qs);
    int q = (blk[qs + 32 * (c / 2) + l] >> (4 * (c & 1))) & 0xF;
    if (TYPE == TYPE_Q5_K) q |= ((blk[offsetof(block_q5_K, qh) + l] >> c) & 1) << 4;
    return q;
}

// Lane L's exact integers of one super-block against Q8_K codes x (256) and its float scales.
template <int TYPE>
__device__ __forceinline__ void k_lane(const uint8_t* blk, const int8_t* x, int L, int& sumi, int& corr, float& dw,
                                       float& dmin) {
    using cudaq::half_to_float;
    using cudaq::load_u16;
    int scale[8], coef[2];  // scale of chunk c's bytes of this lane; the corrections' coefficients
    if (TYPE == TYPE_Q6_K) {
        const int8_t* sc = (const int8_t*)(blk + offsetof(block_q6_K, scales));
        for (int c = 0; c < 8; c++) scale[c] = sc[2 * c + (L >= 4)];
        coef[0] = 32 * sc[2 * L];
        coef[1] = 32 * sc[2 * L + 1];
        dw = half_to_float(load_u16(blk + offsetof(block_q6_K, d)));
        dmin = 0.0f;
    } else {  // Q4_K and Q5_K begin alike: d, dmin, 12 bytes of scales and mins
        int m;
        for (int c = 0; c < 8; c++) cudaq::scale_min_k4(c, blk + 4, &scale[c], &m);
        cudaq::scale_min_k4(L, blk + 4, &m, &coef[0]);
        coef[1] = coef[0];
        dw = half_to_float(load_u16(blk));
        dmin = half_to_float(load_u16(blk + 2));
    }
    sumi = 0;
    for (int c = 0; c < 8; c++)
        for (int j = 4 * L; j < 4 * L + 4; j++) sumi += k_code<TYPE>(blk, 32 * c + j) * x[32 * c + j] * scale[c];
    int bsum[2] = {0, 0};  // Q8_K's sums of values 32L..32L+15 and 32L+16..32L+31
    for (int j = 0; j < 32; j++) bsum[j / 16] += x[32 * L + j];
    corr = coef[0] * bsum[0] + coef[1] * bsum[1];
}

template <int TYPE>
__global__ void matmul_exact_k_kernel(LaunchMatrices ms, int64_t cols, const int8_t* __restrict__ codes,
                                      const CudaQ8Meta* __restrict__ meta) {
    using Q = cudaq::QType<TYPE>;
    const int lane = threadIdx.x, L = lane % 8, g = lane / 8;
    unsigned unit_in;
    const CudaMatrix m = pick_matrix(ms, blockIdx.x, unit_in);
    const int64_t r = (int64_t)unit_in * kRows + threadIdx.y;
    if (r >= m.rows) return;
    const int64_t t = blockIdx.y, nb = cols / 256;
    const uint8_t* row = m.w + r * m.row_bytes;
    const int8_t* xt = codes + t * cols;
    const CudaQ8Meta* xm = meta + t * (cols / 32);
    float acc = 0.0f;  // (every lane runs the row's chain)
    for (int64_t i0 = 0; i0 < nb; i0 += 4) {
        const int64_t i = i0 + g < nb ? i0 + g : nb - 1;
        int sumi, corr;
        float dw, dmin;
        k_lane<TYPE>(row + i * Q::block_bytes, xt + 256 * i, L, sumi, corr, dw, dmin);
        for (int o = 1; o < 8; o <<= 1) {  // the super-block's totals in each of its 8 lanes
            sumi += __shfl_xor_sync(0xffffffffu, sumi, o);
            corr += __shfl_xor_sync(0xffffffffu, corr, o);
        }
        const float dx = xm[8 * i].d;  // (Q8_K's scale, in each of its 32-value blocks)
        const float d = dw * dx, dm = -dmin * dx;
        const float a = TYPE == TYPE_Q6_K ? (float)(sumi - corr) : (float)sumi, b = (float)corr;
        const int valid = nb - i0 < 4 ? (int)(nb - i0) : 4;
        for (int k = 0; k < valid; k++) {
            acc = fmaf(__shfl_sync(0xffffffffu, a, 8 * k), __shfl_sync(0xffffffffu, d, 8 * k), acc);
            if (TYPE != TYPE_Q6_K)  // (a compile-time branch: the whole warp or none)
                acc = fmaf(__shfl_sync(0xffffffffu, b, 8 * k), __shfl_sync(0xffffffffu, dm, 8 * k), acc);
        }
    }
    if (lane != 0) return;
    float s = acc;
    if (m.bias) s += m.bias[r];
    float* out = m.y + t * m.rows + r;
    *out = m.accumulate ? *out + s : s;
}

}  // namespace

bool cuda_matmul_exact_reads(int32_t type, int64_t cols) {
    const bool q32 = type == TYPE_Q4_0 || type == TYPE_Q4_1 || type == TYPE_Q5_0 || type == TYPE_Q5_1 || type == TYPE_Q8_0;
    const bool k = type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K;
    return (q32 && cols % 32 == 0) || (k && cols % 256 == 0);
}

int32_t cuda_matmul_exact_codes(int32_t type) {
    return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K ? kCudaCodesK : kCudaCodes;
}

void cuda_matmul_exact_many(cudaStream_t s, int32_t type, const CudaMatrix* m, int count, int64_t cols,
                            const int8_t* codes, const CudaQ8Meta* meta, int32_t n) {
    if (n <= 0) return;
    for (int k = 0; k < count; k++)
        if (m[k].ids || m[k].n >= 0 || m[k].x_row)
            throw Error("internal: the exact products read every row of their input (no experts' slots or parts)");
    if (n > 65535) throw ArgumentError(format("the exact products take at most 65535 tokens a launch, not %d", n));
    const LaunchMatrices ms = launch_matrices(m, count, kRows);
    if (ms.units == 0) return;
    const dim3 block(32, kRows), grid(ms.units, (unsigned)n);
    switch (type) {
        case TYPE_Q4_0: OPTIML_LAUNCH(matmul_exact_kernel<TYPE_Q4_0>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q4_1: OPTIML_LAUNCH(matmul_exact_kernel<TYPE_Q4_1>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q5_0: OPTIML_LAUNCH(matmul_exact_kernel<TYPE_Q5_0>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q5_1: OPTIML_LAUNCH(matmul_exact_kernel<TYPE_Q5_1>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q8_0: OPTIML_LAUNCH(matmul_exact_kernel<TYPE_Q8_0>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q4_K: OPTIML_LAUNCH(matmul_exact_k_kernel<TYPE_Q4_K>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q5_K: OPTIML_LAUNCH(matmul_exact_k_kernel<TYPE_Q5_K>, grid, block, s, ms, cols, codes, meta); break;
        case TYPE_Q6_K: OPTIML_LAUNCH(matmul_exact_k_kernel<TYPE_Q6_K>, grid, block, s, ms, cols, codes, meta); break;
        default: throw Error("internal: the exact products read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K "
                             "weights only");
    }
    CudaTraffic tr;
    for (int k = 0; k < count; k++) tr.weights += m[k].rows * (int64_t)m[k].row_bytes * n;
    tr.activations = (int64_t)n * (cols + (int64_t)sizeof(CudaQ8Meta) * (cols / 32));
    cuda_check(cudaSuccess, "matmul (exact)");
    cuda_count(CudaKernel::MatmulQ8x, tr);
}

}  // namespace optiml
