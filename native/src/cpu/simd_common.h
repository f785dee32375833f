// x86 kernel bodies shared by kernels_avx2.cpp and kernels_avx512.cpp (private to those two files).
//
// Every function lives in an anonymous namespace, so each including file gets its own copy compiled
// with its own -m flags (no ODR mixing of AVX-512 code into the AVX2 table). The int8 dot primitive
// switches on __AVX512VNNI__: vpdpbusd in the AVX-512 build, vpmaddubsw+vpmaddwd in the AVX2 build.
// Both are exact (the maddubs int16 pair sums never saturate for the value ranges used here), so
// the two builds return identical integer block sums.
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "simd_common.h needs AVX2 + FMA + F16C"
#endif

#pragma GCC diagnostic ignored "-Wunused-function"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"

namespace optiml {
namespace {

// ---- small helpers ---------------------------------------------------------------------------
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

// acc += sum of 4 adjacent u8*s8 products, per int32 lane.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    const __m256i p16 = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
#endif
}

// Sum of 4 adjacent s8*s8 products per int32 lane: |a| * (b with a's sign) keeps the u8*s8 form.
inline __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

// acc += (u8*s8 dot over 32 bytes) * scale, where scale is per int16 pair group: lanes 0..3 of the
// int32 result cover bytes 0..15, lanes 4..7 bytes 16..31. `scale` holds the int16 multiplier of each
// 16-byte half (maddubs path) — used as int32 in the VNNI path.
inline __m256i dot_u8s8_scaled(__m256i acc, __m256i u, __m256i s, __m256i scale16, __m256i scale32) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)scale16;
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s), scale32));
#else
    (void)scale32;
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale16));
#endif
}

// Scale vectors for dot_u8s8_scaled: a for bytes 0..15, b for bytes 16..31.
inline __m256i scale16_pair(int a, int b) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)a), _mm_set1_epi16((short)b));
}
inline __m256i scale32_pair(int a, int b) {
    return _mm256_setr_m128i(_mm_set1_epi32(a), _mm_set1_epi32(b));
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

// ---- float types -----------------------------------------------------------------------------
void vec_dot_f32(int64_t n, float* s, const void* w, const void* x) {
    const float* a = (const float*)w;
    const float* b = (const float*)x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) sum += a[i] * b[i];
    *s = sum;
}

inline __m256 load_f16x8(const fp16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

void vec_dot_f16(int64_t n, float* s, const void* w, const void* x) {
    const fp16_t* a = (const fp16_t*)w;
    const fp16_t* b = (const fp16_t*)x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(load_f16x8(a + i), load_f16x8(b + i), acc0);
        acc1 = _mm256_fmadd_ps(load_f16x8(a + i + 8), load_f16x8(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(load_f16x8(a + i + 16), load_f16x8(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(load_f16x8(a + i + 24), load_f16x8(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load_f16x8(a + i), load_f16x8(b + i), acc0);
    float sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) sum += h2f(a[i]) * h2f(b[i]);
    *s = sum;
}

// bf16 -> f32 is a 16-bit shift into the high half.
inline __m256 load_bf16x8(const bf16_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

void vec_dot_bf16(int64_t n, float* s, const void* w, const void* x) {
    const bf16_t* a = (const bf16_t*)w;
    const bf16_t* b = (const bf16_t*)x;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(load_bf16x8(a + i), load_bf16x8(b + i), acc0);
        acc1 = _mm256_fmadd_ps(load_bf16x8(a + i + 8), load_bf16x8(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(load_bf16x8(a + i + 16), load_bf16x8(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(load_bf16x8(a + i + 24), load_bf16x8(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load_bf16x8(a + i), load_bf16x8(b + i), acc0);
    float sum = hsum_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (; i < n; i++) sum += bf16_to_fp32(a[i]) * bf16_to_fp32(b[i]);
    *s = sum;
}

// ---- 32-element block quants -------------------------------------------------------------------
// Each block's integer dot is exact; it is scaled by d_w*d_x and added into one float vector, block
// after block, then summed horizontally: the same order llama.cpp's 256-bit kernels use, so results
// agree with it bit for bit (activations are 8-bit, so last-bit differences can flip a token).

// A weight block is unpacked once into bytes ready for vpdpbusd/vpmaddubsw (u8 x s8), then dotted
// with one or several activation blocks: the batched kernels below (4 tokens per weight row) compute
// each token's sum exactly as the single-token kernel does.
struct SignedBlock {  // q . x = |q| . (x with q's sign): keeps the u8 x s8 form for signed codes
    __m256i abs_q, q;
};
inline __m256i dot_block(const SignedBlock& w, __m256i x) {
    return dot_u8s8(_mm256_setzero_si256(), w.abs_q, _mm256_sign_epi8(x, w.q));
}
inline __m256i dot_block(__m256i unsigned_q, __m256i x) { return dot_u8s8(_mm256_setzero_si256(), unsigned_q, x); }
inline SignedBlock signed_block(__m256i q) { return SignedBlock{_mm256_sign_epi8(q, q), q}; }

inline SignedBlock prepare(const block_q8_0& a) { return signed_block(_mm256_loadu_si256((const __m256i*)a.qs)); }
// Q4_0: q - 8 in [-8, 7].
inline SignedBlock prepare(const block_q4_0& a) {
    return signed_block(_mm256_sub_epi8(unpack_nibbles_16(a.qs), _mm256_set1_epi8(8)));
}
// Q5_0: q - 16 = nibble | (high bit ? 0 : 0xF0) as a signed byte.
inline SignedBlock prepare(const block_q5_0& a) {
    const __m256i hi = _mm256_andnot_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8((char)0xF0));
    return signed_block(_mm256_or_si256(unpack_nibbles_16(a.qs), hi));
}
// Q4_1: unsigned nibbles (the min is added separately).
inline __m256i prepare(const block_q4_1& a) { return unpack_nibbles_16(a.qs); }
// Q5_1: unsigned q = nibble | (high bit ? 0x10 : 0).
inline __m256i prepare(const block_q5_1& a) {
    const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
}

// The min term of Q4_1/Q5_1 (m_w * s_x, s_x = d_x * sum(q_x) precomputed in Q8_1); none for the rest.
template <typename WBlock, typename XBlock>
inline float min_term(const WBlock&, const XBlock&) { return 0.0f; }
inline float min_term(const block_q4_1& a, const block_q8_1& b) { return h2f(a.m) * h2f(b.s); }
inline float min_term(const block_q5_1& a, const block_q8_1& b) { return h2f(a.m) * h2f(b.s); }
template <typename WBlock>
constexpr bool has_min() { return false; }
template <>
constexpr bool has_min<block_q4_1>() { return true; }
template <>
constexpr bool has_min<block_q5_1>() { return true; }

// s[t] = dot(w, x_t) for NT activation rows x_t = x + t * x_stride bytes. Per token, each block's
// integer dot is scaled by d_w*d_x and added into one float vector, block after block, then summed
// horizontally (plus the min terms, summed in block order): the same order llama.cpp's 256-bit
// kernels use, so results agree with it bit for bit (activations are 8-bit, so last-bit
// differences can flip a token).
template <int NT, typename WBlock, typename XBlock>
inline void dot_rows(int64_t n, float* s, const void* w, const void* x, size_t x_stride) {
    const WBlock* a = (const WBlock*)w;
    const XBlock* b[NT];
    for (int t = 0; t < NT; t++) b[t] = (const XBlock*)((const uint8_t*)x + t * x_stride);
    __m256 acc[NT];
    float mins[NT];
    for (int t = 0; t < NT; t++) {
        acc[t] = _mm256_setzero_ps();
        mins[t] = 0.0f;
    }
    for (int64_t i = 0; i < n / 32; i++) {
        const auto q = prepare(a[i]);
        const float dw = h2f(a[i].d);
        for (int t = 0; t < NT; t++) {
            const __m256 d = _mm256_set1_ps(dw * h2f(b[t][i].d));
            const __m256i p = dot_block(q, _mm256_loadu_si256((const __m256i*)b[t][i].qs));
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[t]);
            if (has_min<WBlock>()) mins[t] += min_term(a[i], b[t][i]);
        }
    }
    for (int t = 0; t < NT; t++) s[t] = hsum_ps(acc[t]) + mins[t];
}

template <typename WBlock, typename XBlock>
void vec_dot_32(int64_t n, float* s, const void* w, const void* x) {
    dot_rows<1, WBlock, XBlock>(n, s, w, x, 0);
}
template <typename WBlock, typename XBlock>
void vec_dot4_32(int64_t n, float* s, const void* w, const void* x, size_t x_stride) {
    dot_rows<4, WBlock, XBlock>(n, s, w, x, x_stride);
}


// ---- several weight rows against one activation row (matrix-vector products) -------------------
// The per-row arithmetic is dot_rows<1>'s exactly; what the rows share is the activation block (its
// load, its fp16 scale, and for the offset formats a correction term). Signed codes are rebased to
// unsigned ones: (q - off) . x = q_u . x - off * x summed per 4-byte group, the same int32 in every
// lane, so the float steps that follow see the same values. (The sign trick of dot_block is exact
// for activations in [-127, 127], which is all Q8_0/Q8_1 conversion produces.)
template <typename WBlock> constexpr int code_offset() { return 0; }
template <> constexpr int code_offset<block_q4_0>() { return 8; }
template <> constexpr int code_offset<block_q5_0>() { return 16; }
// Unsigned codes of one block (offset formats: q + off).
inline __m256i prepare_u(const block_q4_0& a) { return unpack_nibbles_16(a.qs); }
inline __m256i prepare_u(const block_q5_0& a) {
    const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
}
inline __m256i prepare_u(const block_q4_1& a) { return prepare(a); }
inline __m256i prepare_u(const block_q5_1& a) { return prepare(a); }
inline fp16_t min_of(const block_q4_1& a) { return a.m; }
inline fp16_t min_of(const block_q5_1& a) { return a.m; }
template <typename WBlock> inline fp16_t min_of(const WBlock&) { return 0; }

// int32 lanes of the block dot of weight block a with activations xv; negcorr = -off * (4-group
// sums of xv), precomputed per activation block.
template <typename WBlock>
inline __m256i block_dot_u(const WBlock& a, __m256i xv, __m256i negcorr) {
    return dot_u8s8(negcorr, prepare_u(a), xv);
}
inline __m256i block_dot_u(const block_q8_0& a, __m256i xv, __m256i) { return dot_block(prepare(a), xv); }

template <int NR, typename WBlock, typename XBlock>
inline void dot_multirow(int64_t nb, float* s, const void* const* rows, const XBlock* b) {
    const WBlock* a[NR];
    const WBlock* ahead[NR];  // the rows NR further on, prefetched in step
    __m256 acc[NR];
    float mins[NR];
    for (int r = 0; r < NR; r++) {
        a[r] = (const WBlock*)rows[r];
        ahead[r] = (const WBlock*)rows[r + NR];
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.0f;
    }
    const __m256i offv = _mm256_set1_epi8((char)code_offset<WBlock>());
    for (int64_t i = 0; i < nb; i++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)b[i].qs);
        const float dx = h2f(b[i].d);
        __m256i negcorr = _mm256_setzero_si256();
        if (code_offset<WBlock>() != 0) negcorr = _mm256_sub_epi32(negcorr, dot_u8s8(negcorr, offv, xv));
        for (int r = 0; r < NR; r++) {
            // The next NR rows, at the same position: short interleaved streams train the hardware
            // prefetcher poorly (a row of a 4096-wide Q4_0 matrix is 36 cache lines).
            _mm_prefetch((const char*)&ahead[r][i], _MM_HINT_T1);
            const __m256 d = _mm256_set1_ps(h2f(a[r][i].d) * dx);
            const __m256i p = block_dot_u(a[r][i], xv, negcorr);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r]);
            if constexpr (has_min<WBlock>()) mins[r] = std::fma(h2f(min_of(a[r][i])), h2f(b[i].s), mins[r]);
        }
    }
    for (int r = 0; r < NR; r++) s[r] = hsum_ps(acc[r]) + mins[r];
}

template <typename WBlock, typename XBlock>
void vec_dot_rows_32(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    const XBlock* b = (const XBlock*)x;
    int64_t r = 0;
    for (; r + 8 <= n_rows; r += 8) dot_multirow<8, WBlock, XBlock>(n / 32, s + r, rows + r, b);
    for (; r + 4 <= n_rows; r += 4) dot_multirow<4, WBlock, XBlock>(n / 32, s + r, rows + r, b);
    for (; r < n_rows; r++) dot_multirow<1, WBlock, XBlock>(n / 32, s + r, rows + r, b);
}

void vec_dot_q8_0(int64_t n, float* s, const void* w, const void* x) { vec_dot_32<block_q8_0, block_q8_0>(n, s, w, x); }
void vec_dot_q4_0(int64_t n, float* s, const void* w, const void* x) { vec_dot_32<block_q4_0, block_q8_0>(n, s, w, x); }
void vec_dot_q4_1(int64_t n, float* s, const void* w, const void* x) { vec_dot_32<block_q4_1, block_q8_1>(n, s, w, x); }
void vec_dot_q5_0(int64_t n, float* s, const void* w, const void* x) { vec_dot_32<block_q5_0, block_q8_0>(n, s, w, x); }
void vec_dot_q5_1(int64_t n, float* s, const void* w, const void* x) { vec_dot_32<block_q5_1, block_q8_1>(n, s, w, x); }

// Registers the 32-block kernels (one token and four) in a table.
inline void fill_dots_32(KernelTable& t) {
    t.vec_dot[TYPE_Q8_0] = vec_dot_q8_0;
    t.vec_dot[TYPE_Q4_0] = vec_dot_q4_0;
    t.vec_dot[TYPE_Q4_1] = vec_dot_q4_1;
    t.vec_dot[TYPE_Q5_0] = vec_dot_q5_0;
    t.vec_dot[TYPE_Q5_1] = vec_dot_q5_1;
    t.vec_dot4[TYPE_Q8_0] = vec_dot4_32<block_q8_0, block_q8_0>;
    t.vec_dot4[TYPE_Q4_0] = vec_dot4_32<block_q4_0, block_q8_0>;
    t.vec_dot4[TYPE_Q4_1] = vec_dot4_32<block_q4_1, block_q8_1>;
    t.vec_dot4[TYPE_Q5_0] = vec_dot4_32<block_q5_0, block_q8_0>;
    t.vec_dot4[TYPE_Q5_1] = vec_dot4_32<block_q5_1, block_q8_1>;
    t.vec_dot_rows[TYPE_Q8_0] = vec_dot_rows_32<block_q8_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q4_0] = vec_dot_rows_32<block_q4_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q4_1] = vec_dot_rows_32<block_q4_1, block_q8_1>;
    t.vec_dot_rows[TYPE_Q5_0] = vec_dot_rows_32<block_q5_0, block_q8_0>;
    t.vec_dot_rows[TYPE_Q5_1] = vec_dot_rows_32<block_q5_1, block_q8_1>;
}

// ---- k-quants (256-element super-blocks, activations in Q8_K) ----------------------------------

// The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales (sc[0..7]) and 8 six-bit mins (mn[0..7]).
inline void unpack_scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        mn[j] = q[j + 4] & 63;
    }
    for (int j = 4; j < 8; j++) {
        sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        mn[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// sum over the 8 sub-blocks of 32: mins[j] * (bsums[2j] + bsums[2j+1]).
inline int mins_dot_bsums(const uint8_t* mn, const int16_t* bsums) {
    const __m128i b0 = _mm_loadu_si128((const __m128i*)bsums);
    const __m128i b1 = _mm_loadu_si128((const __m128i*)(bsums + 8));
    const __m128i pair = _mm_hadd_epi16(b0, b1);  // 8 sums of 32 q8 values, |.| <= 4064
    int64_t m8;
    std::memcpy(&m8, mn, 8);
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m8));
    return hsum_epi32_128(_mm_madd_epi16(m16, pair));
}

// sum over the 16 groups of 16: scales[g] * bsums[g] (scales signed bytes).
inline int scales16_dot_bsums(const int8_t* sc, const int16_t* bsums) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
    return hsum_epi32(_mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i*)bsums)));
}

void vec_dot_q4_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q4_K* a = (const block_q4_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    float acc_m = 0;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t sc[8], mn[8];
        unpack_scales_mins_k4(a[i].scales, sc, mn);
        const float d = b[i].d * h2f(a[i].d);
        const float dmin = b[i].d * h2f(a[i].dmin);
        acc_m -= dmin * (float)mins_dot_bsums(mn, b[i].bsums);
        const uint8_t* q4 = a[i].qs;
        const int8_t* q8 = b[i].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            // 32 bytes hold sub-block 2j in the low nibbles and 2j+1 in the high nibbles.
            const __m256i q = _mm256_loadu_si256((const __m256i*)(q4 + 32 * j));
            const __m256i lo = _mm256_and_si256(q, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            const __m256i x0 = _mm256_loadu_si256((const __m256i*)(q8 + 64 * j));
            const __m256i x1 = _mm256_loadu_si256((const __m256i*)(q8 + 64 * j + 32));
            sumi = dot_u8s8_scaled(sumi, lo, x0, _mm256_set1_epi16(sc[2 * j]), _mm256_set1_epi32(sc[2 * j]));
            sumi = dot_u8s8_scaled(sumi, hi, x1, _mm256_set1_epi16(sc[2 * j + 1]), _mm256_set1_epi32(sc[2 * j + 1]));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum_ps(acc) + acc_m;
}

void vec_dot_q5_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q5_K* a = (const block_q5_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float acc_m = 0;
    for (int64_t i = 0; i < nb; i++) {
        uint8_t sc[8], mn[8];
        unpack_scales_mins_k4(a[i].scales, sc, mn);
        const float d = b[i].d * h2f(a[i].d);
        const float dmin = b[i].d * h2f(a[i].dmin);
        acc_m -= dmin * (float)mins_dot_bsums(mn, b[i].bsums);
        const uint8_t* q4 = a[i].qs;
        const int8_t* q8 = b[i].qs;
        // qh byte l holds the fifth bit of element l of each sub-block: bit j for sub-block j.
        __m256i qh = _mm256_loadu_si256((const __m256i*)a[i].qh);
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(q4 + 32 * j));
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(qh, one), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 1), one), 4);
            qh = _mm256_srli_epi16(qh, 2);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), h0);
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h1);
            const __m256i x0 = _mm256_loadu_si256((const __m256i*)(q8 + 64 * j));
            const __m256i x1 = _mm256_loadu_si256((const __m256i*)(q8 + 64 * j + 32));
            sumi = dot_u8s8_scaled(sumi, lo, x0, _mm256_set1_epi16(sc[2 * j]), _mm256_set1_epi32(sc[2 * j]));
            sumi = dot_u8s8_scaled(sumi, hi, x1, _mm256_set1_epi16(sc[2 * j + 1]), _mm256_set1_epi32(sc[2 * j + 1]));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = hsum_ps(acc) + acc_m;
}

// Q6_K: q in 0..63 (value q - 32); 16 signed scales, one per 16 elements. The -32 offset is folded
// out with the bsums: sum_g sc_g * (sum q*x - 32 * bsum_g).
void vec_dot_q6_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q6_K* a = (const block_q6_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i m2 = _mm256_set1_epi8(0x03);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = b[i].d * h2f(a[i].d);
        const int8_t* sc = a[i].scales;
        const int offs = scales16_dot_bsums(sc, b[i].bsums);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const uint8_t* ql = a[i].ql + 64 * h;
            const int8_t* q8 = b[i].qs + 128 * h;
            const int8_t* s8 = sc + 8 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i*)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(a[i].qh + 32 * h));
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
            sumi = dot_u8s8_scaled(sumi, q0, _mm256_loadu_si256((const __m256i*)(q8 + 0)), scale16_pair(s8[0], s8[1]), scale32_pair(s8[0], s8[1]));
            sumi = dot_u8s8_scaled(sumi, q1, _mm256_loadu_si256((const __m256i*)(q8 + 32)), scale16_pair(s8[2], s8[3]), scale32_pair(s8[2], s8[3]));
            sumi = dot_u8s8_scaled(sumi, q2, _mm256_loadu_si256((const __m256i*)(q8 + 64)), scale16_pair(s8[4], s8[5]), scale32_pair(s8[4], s8[5]));
            sumi = dot_u8s8_scaled(sumi, q3, _mm256_loadu_si256((const __m256i*)(q8 + 96)), scale16_pair(s8[6], s8[7]), scale32_pair(s8[6], s8[7]));
        }
        const int total = hsum_epi32(sumi) - 32 * offs;
        sum += d * (float)total;
    }
    *s = sum;
}

// Q2_K: 2-bit q, 16 groups of 16 with a 4-bit scale (low nibble) and 4-bit min (high nibble).
void vec_dot_q2_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q2_K* a = (const block_q2_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = b[i].d * h2f(a[i].d);
        const float dmin = b[i].d * h2f(a[i].dmin);
        const __m128i sc8 = _mm_loadu_si128((const __m128i*)a[i].scales);
        const __m128i mins8 = _mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0F));
        const __m256i mins16 = _mm256_cvtepu8_epi16(mins8);
        const int summ = hsum_epi32(_mm256_madd_epi16(mins16, _mm256_loadu_si256((const __m256i*)b[i].bsums)));
        uint8_t scl[16];
        _mm_storeu_si128((__m128i*)scl, _mm_and_si128(sc8, _mm_set1_epi8(0x0F)));
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(a[i].qs + 32 * h));
            const int8_t* q8 = b[i].qs + 128 * h;
            const uint8_t* s8 = scl + 8 * h;
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                sumi = dot_u8s8_scaled(sumi, v, _mm256_loadu_si256((const __m256i*)(q8 + 32 * j)),
                                       scale16_pair(s8[2 * j], s8[2 * j + 1]), scale32_pair(s8[2 * j], s8[2 * j + 1]));
            }
        }
        sum += d * (float)hsum_epi32(sumi) - dmin * (float)summ;
    }
    *s = sum;
}

// Q3_K: value = (2 low bits | high bit << 2) - 4, 16 six-bit scales (minus 32). The -4 offset is
// folded out with the bsums.
void vec_dot_q3_K(int64_t n, float* s, const void* w, const void* x) {
    const block_q3_K* a = (const block_q3_K*)w;
    const block_q8_K* b = (const block_q8_K*)x;
    const int64_t nb = n / OPTIML_QK_K;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i one = _mm256_set1_epi8(1);
    float sum = 0;
    for (int64_t i = 0; i < nb; i++) {
        const float d = b[i].d * h2f(a[i].d);
        uint32_t aux[4];
        std::memcpy(aux, a[i].scales, 12);
        const uint32_t tmp = aux[2];
        const uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        int8_t sc[16];
        _mm_storeu_si128((__m128i*)sc, _mm_sub_epi8(_mm_loadu_si128((const __m128i*)aux), _mm_set1_epi8(32)));
        const int offs = scales16_dot_bsums(sc, b[i].bsums);
        __m256i hm = _mm256_loadu_si256((const __m256i*)a[i].hmask);
        __m256i sumi = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i*)(a[i].qs + 32 * h));
            const int8_t* q8 = b[i].qs + 128 * h;
            const int8_t* s8 = sc + 8 * h;
            for (int j = 0; j < 4; j++) {
                const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
                hm = _mm256_srli_epi16(hm, 1);
                const __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3), hb);
                sumi = dot_u8s8_scaled(sumi, v, _mm256_loadu_si256((const __m256i*)(q8 + 32 * j)),
                                       scale16_pair(s8[2 * j], s8[2 * j + 1]), scale32_pair(s8[2 * j], s8[2 * j + 1]));
            }
        }
        sum += d * (float)(hsum_epi32(sumi) - 4 * offs);
    }
    *s = sum;
}

// ---- activation conversion (bit-identical to the scalar reference) ---------------------------

// 32 int32 (4 vectors) -> 32 int8 in order.
inline __m256i pack_i32x32_to_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i ab = _mm256_packs_epi32(a, b);  // lanes interleaved: a0 b0 | a1 b1
    const __m256i cd = _mm256_packs_epi32(c, d);
    const __m256i p = _mm256_packs_epi16(ab, cd);  // a0 b0 c0 d0 | a1 b1 c1 d1 (4-byte groups)
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Quantizes one block of 32 activations to int8 as the scalar activation_row_q8_0 does (id = 127/amax,
// ties to even); returns d (float, before fp16 rounding).
inline float quantize_block_q8(const float* x, int8_t* qs, __m256i* sum32) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    const float amax = hmax_ps(mx);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vid = _mm256_set1_ps(id);
    // cvtps_epi32 rounds to nearest even in the default MXCSR mode.
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
    if (sum32) *sum32 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    _mm256_storeu_si256((__m256i*)qs, pack_i32x32_to_i8(i0, i1, i2, i3));
    return d;
}

void from_float_q8_0(const float* x, void* y, int64_t n) {
    block_q8_0* out = (block_q8_0*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, nullptr);
        out[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    }
}

void from_float_q8_1(const float* x, void* y, int64_t n) {
    block_q8_1* out = (block_q8_1*)y;
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i sum32;
        const float d = quantize_block_q8(x + 32 * i, out[i].qs, &sum32);
        out[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        out[i].s = _cvtss_sh(d * (float)hsum_epi32(sum32), _MM_FROUND_TO_NEAREST_INT);
    }
}

// Q8_K: scale from the element of largest magnitude (first one on ties, keeping its sign),
// round-to-nearest-even, clamp to 127.
void from_float_q8_K(const float* x, void* y, int64_t n) {
    block_q8_K* out = (block_q8_K*)y;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < n / OPTIML_QK_K; i++) {
        const float* xb = x + OPTIML_QK_K * i;
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < OPTIML_QK_K; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + k), absmask));
        const float amax = hmax_ps(mx);
        if (amax == 0.0f) {
            std::memset(&out[i], 0, sizeof(block_q8_K));
            continue;
        }
        float max = 0;
        const __m256 va = _mm256_set1_ps(amax);
        for (int k = 0; k < OPTIML_QK_K; k += 8) {
            const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(xb + k), absmask), va, _CMP_EQ_OQ));
            if (m) { max = xb[k + __builtin_ctz((unsigned)m)]; break; }
        }
        const float iscale = -127.f / max;
        const __m256 vs = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int k = 0; k < OPTIML_QK_K; k += 32) {
            __m256i q[4];
            for (int t = 0; t < 4; t++) {
                const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * t), vs),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[t] = _mm256_min_epi32(_mm256_cvtps_epi32(v), lim);
            }
            const __m256i p = pack_i32x32_to_i8(q[0], q[1], q[2], q[3]);
            _mm256_storeu_si256((__m256i*)(out[i].qs + k), p);
            // bsums of the two groups of 16 in these 32 bytes.
            const __m256i s16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p), _mm256_set1_epi16(1));
            out[i].bsums[k / 16] = (int16_t)hsum_epi32_128(_mm256_castsi256_si128(s16));
            out[i].bsums[k / 16 + 1] = (int16_t)hsum_epi32_128(_mm256_extracti128_si256(s16, 1));
        }
        out[i].d = 1 / iscale;
    }
}

void from_float_f16(const float* x, void* y, int64_t n) {
    fp16_t* out = (fp16_t*)y;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) out[i] = fp32_to_fp16(x[i]);
}

// The scalar fp32_to_bf16 in integer lanes (vcvtneps2bf16 would flush denormals, so it is not used).
void from_float_bf16(const float* x, void* y, int64_t n) {
    bf16_t* out = (bf16_t*)y;
    int64_t i = 0;
    const __m256i absm = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int t = 0; t < 2; t++) {
            const __m256i u = _mm256_loadu_si256((const __m256i*)(x + i + 8 * t));
            const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
            const __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(64));
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            const __m256i rv = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
            r[t] = _mm256_blendv_epi8(rv, nanv, isnan);
        }
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), _MM_SHUFFLE(3, 1, 2, 0));
        _mm256_storeu_si256((__m256i*)(out + i), p);
    }
    for (; i < n; i++) out[i] = fp32_to_bf16(x[i]);
}

}  // namespace
}  // namespace optiml
