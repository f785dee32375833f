// The x86 kernel set, one source for every x86 feature level: each kernels_*.cpp file includes this
// header (into an anonymous namespace, compiled with its own -m flags) and registers what it needs.
// The bodies live in simd_q32.h, simd_kquants.h, simd_float.h and simd_convert.h; what differs
// between feature sets (VNNI or not, 256- or 512-bit float vectors) is in simd_x86.h.
#pragma once

#include "simd_convert.h"
#include "simd_float.h"
#include "simd_gemm.h"
#include "simd_gemm_q32.h"
#include "simd_iq4.h"
#include "simd_kquants.h"
#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include "simd_gemm_k_rows.h"
#include "simd_gemm_q32_rows.h"
#else
#include "simd_gemm_k_rows8.h"
#endif
#include "simd_q32.h"

namespace optiml {
namespace {

// Tile sizes (rows x tokens) of the k-quants' batched product: 2 x 4 (the tile keeps 8 integer sums
// and 4 activation chunks in registers), chosen with llvm-mca for Zen 3 among 2..4 x 2..6 for the 16
// vector registers of AVX2 (the AVX-512 files use them as they are).
constexpr int kKRows = 2, kKTokens = 4;
// Rows per tile of the 32-element formats' batched product (simd_gemm_q32.h): each row keeps an
// integer and a float accumulator, so 8 rows where AVX-512VL gives 32 vector registers, 4 with 16.
#if defined(__AVX512VL__)
constexpr int kPanelRows = 8;
#else
constexpr int kPanelRows = 4;
#endif

// The 32-element formats' batched product: with AVX-512VNNI rows in the lanes from 32 tokens
// (simd_gemm_q32_rows.h), else tokens in the lanes (simd_gemm_q32.h).
#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
template <class WBlock, int NR> constexpr gemm_fn kGemmQ32 = gemm_q32_vnni<WBlock, NR>;
#else
template <class WBlock, int NR> constexpr gemm_fn kGemmQ32 = gemm_panels_32<WBlock, NR>;
#endif

// The k-quants' batched product over laid-out activations: rows in the lanes, 16 in a zmm with AVX-512VNNI
// (from 8 tokens, simd_gemm_k_rows.h), else 8 in a ymm (from 32, simd_gemm_k_rows8.h); tile_k under that.
#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
template <class WBlock> constexpr gemm_pre_fn kGemmPreK = gemm_pre_k_vnni<WBlock, kKRows, kKTokens>;
#else
template <class WBlock> constexpr gemm_pre_fn kGemmPreK = gemm_pre_k_rows8<WBlock, kKRows, kKTokens>;
#endif

// The quant kernels: vec_dot, the matrix-vector product (vec_dot_rows) and the batched product (gemm).
inline void fill_quant_kernels(KernelTable& t) {
    constexpr int KR = kKRows, KT = kKTokens, PR = kPanelRows;
    t.vec_dot[TYPE_Q4_0] = vec_dot_32<block_q4_0>;
    t.vec_dot[TYPE_Q4_1] = vec_dot_32<block_q4_1>;
    t.vec_dot[TYPE_Q5_0] = vec_dot_32<block_q5_0>;
    t.vec_dot[TYPE_Q5_1] = vec_dot_32<block_q5_1>;
    t.vec_dot[TYPE_Q8_0] = vec_dot_32<block_q8_0>;
    t.vec_dot[TYPE_MXFP4] = vec_dot_32<block_mxfp4>;
    t.vec_dot[TYPE_IQ4_NL] = vec_dot_32<block_iq4_nl>;
    t.vec_dot[TYPE_IQ4_XS] = vec_dot_iq4_xs;
    t.vec_dot_rows[TYPE_Q4_0] = vec_dot_rows_32<block_q4_0>;
    t.vec_dot_rows[TYPE_Q4_1] = vec_dot_rows_32<block_q4_1>;
    t.vec_dot_rows[TYPE_Q5_0] = vec_dot_rows_32<block_q5_0>;
    t.vec_dot_rows[TYPE_Q5_1] = vec_dot_rows_32<block_q5_1>;
    t.vec_dot_rows[TYPE_Q8_0] = vec_dot_rows_32<block_q8_0>;
    t.vec_dot_rows[TYPE_MXFP4] = vec_dot_rows_32<block_mxfp4>;
    t.vec_dot_rows[TYPE_IQ4_NL] = vec_dot_rows_32<block_iq4_nl>;
    t.gemm[TYPE_Q4_0] = kGemmQ32<block_q4_0, PR>;
    t.gemm[TYPE_Q4_1] = kGemmQ32<block_q4_1, PR>;
    t.gemm[TYPE_Q5_0] = kGemmQ32<block_q5_0, PR>;
    t.gemm[TYPE_Q5_1] = kGemmQ32<block_q5_1, PR>;
    t.gemm[TYPE_Q8_0] = kGemmQ32<block_q8_0, PR>;
    t.gemm[TYPE_MXFP4] = kGemmQ32<block_mxfp4, PR>;
    t.gemm[TYPE_IQ4_NL] = kGemmQ32<block_iq4_nl, PR>;
    t.gemm[TYPE_IQ4_XS] = gemm_iq4_xs;

    t.vec_dot[TYPE_Q2_K] = vec_dot_tiled<KTile<block_q2_K>>;
    t.vec_dot[TYPE_Q3_K] = vec_dot_tiled<KTile<block_q3_K>>;
    t.vec_dot[TYPE_Q4_K] = vec_dot_tiled<KTile<block_q4_K>>;
    t.vec_dot[TYPE_Q5_K] = vec_dot_tiled<KTile<block_q5_K>>;
    t.vec_dot[TYPE_Q6_K] = vec_dot_tiled<KTile<block_q6_K>>;
    t.vec_dot_rows[TYPE_Q2_K] = vec_dot_rows_k<block_q2_K>;
    t.vec_dot_rows[TYPE_Q3_K] = vec_dot_rows_k<block_q3_K>;
    t.vec_dot_rows[TYPE_Q4_K] = vec_dot_rows_k<block_q4_K>;
    t.vec_dot_rows[TYPE_Q5_K] = vec_dot_rows_k<block_q5_K>;
    t.vec_dot_rows[TYPE_Q6_K] = vec_dot_rows_k<block_q6_K>;
    t.gemm[TYPE_Q2_K] = gemm_k<block_q2_K, KR, KT, kGemmPreK<block_q2_K>>;
    t.gemm[TYPE_Q3_K] = gemm_k<block_q3_K, KR, KT, kGemmPreK<block_q3_K>>;
    t.gemm[TYPE_Q4_K] = gemm_k<block_q4_K, KR, KT, kGemmPreK<block_q4_K>>;
    t.gemm[TYPE_Q5_K] = gemm_k<block_q5_K, KR, KT, kGemmPreK<block_q5_K>>;
    t.gemm[TYPE_Q6_K] = gemm_k<block_q6_K, KR, KT, kGemmPreK<block_q6_K>>;
    t.gemm_pre[TYPE_Q2_K] = kGemmPreK<block_q2_K>;
    t.gemm_pre[TYPE_Q3_K] = kGemmPreK<block_q3_K>;
    t.gemm_pre[TYPE_Q4_K] = kGemmPreK<block_q4_K>;
    t.gemm_pre[TYPE_Q5_K] = kGemmPreK<block_q5_K>;
    t.gemm_pre[TYPE_Q6_K] = kGemmPreK<block_q6_K>;
    t.gemm_x = gemm_x_k;
}

// The float kernels for vector type FV with R x T tiles (R * T accumulators + T activation vectors
// in registers).
template <class FV, int R, int T>
inline void fill_float_kernels(KernelTable& t) {
    t.vec_dot[TYPE_F32] = vec_dot_float<FV, ElemF32>;
    t.vec_dot[TYPE_F16] = vec_dot_float<FV, ElemF16>;
    t.vec_dot[TYPE_BF16] = vec_dot_float<FV, ElemBF16>;
    t.gemm[TYPE_F32] = gemm_tiled<FloatTile<FV, ElemF32>, R, T>;
    t.gemm[TYPE_F16] = gemm_tiled<FloatTile<FV, ElemF16>, R, T>;
    t.gemm[TYPE_BF16] = gemm_tiled<FloatTile<FV, ElemBF16>, R, T>;
}

inline void fill_convert_kernels(KernelTable& t) {
    t.from_float[TYPE_Q8_0] = from_float_q8_0;
    t.from_float[TYPE_Q8_1] = from_float_q8_1;
    t.from_float[TYPE_Q8_K] = from_float_q8_K;
    t.from_float[TYPE_F16] = from_float_f16;
    t.from_float[TYPE_BF16] = from_float_bf16;
}

}  // namespace
}  // namespace optiml
