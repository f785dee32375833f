// x86 building blocks for the kernel files (kernels_avx2.cpp, kernels_avxvnni.cpp, kernels_avx512*.cpp).
//
// Each kernel file is compiled with the -m flags of one feature set and includes the kernel headers
// into an anonymous namespace, so it gets its own copy of every body compiled for exactly those
// features (no AVX-512 or VNNI code can leak into the AVX2 table). What differs between feature sets
// is confined to this file, in the way ggml's SIMD mappings do it:
//   * the two integer primitives (dot_u8s8, dot_u8s8_scaled): vpdpbusd / vpdpwssd where VNNI is
//     compiled in, vpmaddubsw + vpmaddwd + vpaddd otherwise. All forms are exact for the operand
//     ranges the kernels use, so every level produces the same integer lanes;
//   * the float vector type (F32x8, and F32x16 where AVX-512F is compiled in) that the float kernels
//     are written against.
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "simd_x86.h needs AVX2 + FMA + F16C"
#endif

#pragma GCC diagnostic ignored "-Wunused-function"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

// ---- horizontal reductions and small conversions --------------------------------------------
inline float h2f(fp16_t h) { return _cvtsh_ss(h); }

inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int hsum_epi32_128(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(v);
}

inline int hsum_epi32(__m256i v) {
    return hsum_epi32_128(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// ---- integer dot primitives (the only place where VNNI and non-VNNI code differ) ----------------
// Whether dot_u8s8 is vpdpbusd: exact for any u8 codes (no int16 pair sums to overflow).
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool kVnni256 = true;
#else
constexpr bool kVnni256 = false;
#endif
// acc + (sum of the 4 adjacent u8*s8 products), per int32 lane. Exact when every adjacent pair sum
// fits int16 (vpmaddubsw saturates): the kernels use u <= 128 and s in [-127, 127].
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// acc + (a16[2k] * b16[2k] + a16[2k+1] * b16[2k+1]) in int32 lane k: vpdpwssd, or vpmaddwd + vpaddd.
inline __m256i madd_acc(__m256i acc, __m256i a16, __m256i b16) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a16, b16);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a16, b16);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a16, b16));
#endif
}

// acc + scale16 * (u8*s8 pair sums), pairs of int16 lanes summed into int32 lanes: lane k gets
// scale16[2k] * (u[4k]s[4k] + u[4k+1]s[4k+1]) + scale16[2k+1] * (u[4k+2]s[4k+2] + u[4k+3]s[4k+3]).
// Exact for pair sums that fit int16 (u <= 63, s in [-127, 127]).
inline __m256i dot_u8s8_scaled(__m256i acc, __m256i u, __m256i s, __m256i scale16) {
    return madd_acc(acc, _mm256_maddubs_epi16(u, s), scale16);
}

// 16 packed bytes -> 32 nibbles: low nibbles first (elements 0..15), then high (16..31).
inline __m256i unpack_nibbles_16(const uint8_t* p) {
    const __m128i x = _mm_loadu_si128((const __m128i*)p);
    const __m256i b = _mm256_setr_m128i(x, _mm_srli_epi16(x, 4));
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, byte i = 0xFF if bit i is set else 0.
inline __m256i bits_to_bytes_32(const uint8_t* p) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL,
                                            0x0202020202020202LL, 0x0303030303030303LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)u), shuf);
    const __m256i bitsel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bitsel), bitsel);
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Marks v as changed by an (empty) asm statement, so the compiler keeps a chain of integer additions
// into v as written. Without it GCC reassociates a tile's 8 chained sums per (row, token) into trees
// of partial sums, which need more registers than there are and spill (measured: 2x slower).
inline void keep_chain(__m256i& v) { __asm__("" : "+x"(v)); }

// ---- containers ------------------------------------------------------------------------------------
// A std container of a type every file shares (std::vector<const void*>) is one template instantiation
// for the whole program: the linker keeps one file's copy for all, and it may be the copy compiled with
// AVX-512 flags, which then faults (SIGILL) on a CPU without them. LocalVector's allocator is a type of
// this file's anonymous namespace, so its instantiation is this file's own.
template <class T>
struct LocalAllocator : std::allocator<T> {
    template <class U> struct rebind { typedef LocalAllocator<U> other; };
    LocalAllocator() = default;
    template <class U> LocalAllocator(const LocalAllocator<U>&) {}
};
template <class T> using LocalVector = std::vector<T, LocalAllocator<T>>;

// ---- float vectors -------------------------------------------------------------------------------
// The kernels written once for every instruction set (simd_float.h, simd_ops.h, sparse_axpy_simd.h)
// see a float vector type FV: N lanes of V, masks M from the comparisons, and these operations. The
// NEON twin is F32x4 (simd_neon.h).
struct F32x8 {
    typedef __m256 V;
    typedef __m256 M;  // all-ones lanes where a comparison holds
    typedef __m256i VI;  // N int32
    static constexpr int N = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V load_f32(const float* p) { return _mm256_loadu_ps(p); }
    static V load_f16(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    // bf16 -> f32 is a 16-bit shift into the high half.
    static V load_bf16(const bf16_t* p) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    // 32 int8 codes (a Q8_0 block) as floats, N at a time: q[c] = codes 8c .. 8c + 7.
    static void load_q8x32(const int8_t* p, V q[32 / N]) {
#pragma GCC unroll 4
        for (int c = 0; c < 32 / N; c++)
            q[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * c))));
    }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static VI set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
    static VI sub_i32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
    static V i32_to_f32(VI v) { return _mm256_cvtepi32_ps(v); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, rounded once
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V neg(V a) { return _mm256_sub_ps(_mm256_setzero_ps(), a); }  // 0 - a
    static V max0(V a) { return _mm256_max_ps(a, _mm256_setzero_ps()); }  // NaN -> 0, as a > 0 ? a : 0
    static M ge(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
    static M le(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LE_OQ); }
    static V select(M m, V a, V b) { return _mm256_blendv_ps(b, a, m); }  // m ? a : b
    static float hsum(V v) { return hsum_ps(v); }
    // The horizontal sum in ggml's order (GGML_F32x8_REDUCE: hadd twice), for the attention dots that
    // follow llama.cpp bit for bit.
    static float hsum_ggml(V v) {
        const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 t1 = _mm_hadd_ps(t0, t0);
        return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
    }
    // hsum_ggml of 8 vectors at once, each sum formed from the same additions: the halves' sums two
    // vectors to a register, then the two hadds over four vectors' halves at a time.
    static void hsum_ggml8(const V* v, float* out) {
        __m256 t[4];
        for (int i = 0; i < 4; i++)
            t[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                                 _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
        alignas(32) float r[8];  // v0 v2 v4 v6 | v1 v3 v5 v7
        _mm256_store_ps(r, h);
        for (int i = 0; i < 4; i++) out[2 * i] = r[i], out[2 * i + 1] = r[4 + i];
    }
    static void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
    static void prefetch_l2(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }
};

#if defined(__AVX512F__)
struct F32x16 {
    typedef __m512 V;
    typedef __mmask16 M;
    typedef __m512i VI;
    static constexpr int N = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V load_f32(const float* p) { return _mm512_loadu_ps(p); }
    static V load_f16(const fp16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static V load_bf16(const bf16_t* p) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    static void load_q8x32(const int8_t* p, V q[32 / N]) {
#pragma GCC unroll 2
        for (int c = 0; c < 32 / N; c++)
            q[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16 * c))));
    }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static VI set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
    static VI sub_i32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
    static V i32_to_f32(VI v) { return _mm512_cvtepi32_ps(v); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V neg(V a) { return _mm512_sub_ps(_mm512_setzero_ps(), a); }
    static V max0(V a) { return _mm512_max_ps(a, _mm512_setzero_ps()); }
    static M ge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
    static M le(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LE_OQ); }
    static V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }
    static float hsum(V v) { return _mm512_reduce_add_ps(v); }
    // GGML_F32x16_REDUCE's last step, _mm512_reduce_add_ps, written out: lane i takes lane i + 8, then
    // i + 4, i + 2 and i + 1 (the tree GCC's and Clang's intrinsic both form), so that hsum_ggml8 forms
    // the same sums for eight vectors at once whatever the compiler.
    static float hsum_ggml(V v) {
        const __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(v),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        const __m128 t6 = _mm_add_ps(_mm256_castps256_ps128(t3), _mm256_extractf128_ps(t3, 1));
        const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));
        return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
    }
    // hsum_ggml of 8 vectors at once, each sum formed from the same additions: the tree's steps over two
    // vectors' halves (+8), four vectors' quarters (+4), then eight vectors' lanes (+2, +1).
    static void hsum_ggml8(const V* v, float* out) {
        __m512 a[4];
        for (int k = 0; k < 4; k++)  // [v2k: lanes 0-7 + 8-15 | v2k+1: the same]
            a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
        __m512 b[2];
        for (int k = 0; k < 2; k++)  // [v4k .. v4k+3: lanes 0-3 + 4-7]
            b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                                 _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
        // quarter k: [vk: 0 + 2, 1 + 3 | vk+4: the same], then each pair's sum
        const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], 0x44), _mm512_shuffle_ps(b[0], b[1], 0xEE));
        const __m512 d = _mm512_add_ps(c, _mm512_shuffle_ps(c, c, 0xB1));
        alignas(64) float r[16];
        _mm512_store_ps(r, d);
        for (int k = 0; k < 4; k++) out[k] = r[4 * k], out[k + 4] = r[4 * k + 2];
    }
    static void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
    static void prefetch_l2(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T1); }
};
#endif

}  // namespace
}  // namespace optiml

#include "simd_elem.h"
