// The 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against Q8_0/Q8_1 activations): one
// tile kernel that serves vec_dot (1 x 1), the matrix-vector product (rows x 1) and the batched
// product (rows x tokens).
//
// Per (row, token), each block's integer dot is exact; it is converted to float, scaled by d_w * d_x
// and added into one 8-lane float vector, block after block, then summed horizontally (plus the min
// terms of Q4_1/Q5_1, fma'd in block order): the order of llama.cpp's 256-bit kernels, so results
// agree with it bit for bit (activations are 8-bit, so last bits can decide close tokens).
#pragma once

#include <new>
#include <type_traits>
#include <vector>

#include "simd_x86.h"

namespace optiml {
namespace {

// A weight block's codes: unsigned bytes whose values are code - offset (Q4_0, Q5_0) or code
// (Q4_1, Q5_1, whose mins are added apart), or signed bytes (Q8_0). Signed values meet the activation
// as |q| . (x with q's sign), which keeps vpmaddubsw's u8 x s8 form and is exact for x in [-127, 127]
// (all Q8_0/Q8_1 conversion produces). With one token (vec_dot, the matrix-vector product) the
// offset formats keep their unsigned codes instead and take the offset back out with a correction
// that depends on the activation block only ((q - off) . x = q . x - off * x summed per 4-byte
// group), shared by every row; with several tokens that correction would cost more per token than
// the sign step costs per (row, token). Both forms give the same int32 lanes.
template <class WBlock> struct Q32;
template <> struct Q32<block_q4_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 8;
    static constexpr bool has_min = false, is_signed = false;
    static __m256i codes(const block_q4_0& a) { return unpack_nibbles_16(a.qs); }
};
template <> struct Q32<block_q5_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 16;
    static constexpr bool has_min = false, is_signed = false;
    static __m256i codes(const block_q5_0& a) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
    }
};
template <> struct Q32<block_q4_1> {
    typedef block_q8_1 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = true, is_signed = false;
    static __m256i codes(const block_q4_1& a) { return unpack_nibbles_16(a.qs); }
};
template <> struct Q32<block_q5_1> {
    typedef block_q8_1 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = true, is_signed = false;
    static __m256i codes(const block_q5_1& a) {
        const __m256i hi = _mm256_and_si256(bits_to_bytes_32(a.qh), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(unpack_nibbles_16(a.qs), hi);
    }
};
template <> struct Q32<block_q8_0> {
    typedef block_q8_0 X;
    static constexpr int offset = 0;
    static constexpr bool has_min = false, is_signed = true;
    static __m256i codes(const block_q8_0& a) { return load256(a.qs); }
};

inline float min_of(const block_q4_1& a) { return h2f(a.m); }
inline float min_of(const block_q5_1& a) { return h2f(a.m); }
template <class WBlock> inline float min_of(const WBlock&) { return 0.0f; }
// The fp16 sums s = d * sum(q) of NT Q8_1 blocks (block i of each token), as floats in lanes 0..NT-1.
template <int NT>
inline __m256 sums_of(const block_q8_1* const* b, int64_t i) {
    auto h = [&](int t) { return t < NT ? (short)b[t][i].s : (short)0; };
    return _mm256_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7)));
}

// A weight block as the integer dot meets it: v holds its values as bytes (signed values, or the
// unsigned codes of Q4_1/Q5_1, whose mins are added apart), absv = |v| for the signed formats.
struct Q32Ready {
    __m256i v, absv;
    float d, m;
};

// signed_values: Q4_0/Q5_0 codes become their signed values (code - offset) and absv is set.
template <class WBlock>
inline void ready_block(const WBlock& a, Q32Ready& u, bool signed_values) {
    typedef Q32<WBlock> Q;
    u.v = Q::codes(a);
    if (Q::offset != 0 && signed_values) u.v = _mm256_sub_epi8(u.v, _mm256_set1_epi8((char)Q::offset));
    if ((Q::offset != 0 && signed_values) || Q::is_signed) u.absv = _mm256_sign_epi8(u.v, u.v);
    u.d = h2f(a.d);
    u.m = min_of(a);
}

// Where a tile reads a weight row from: its blocks, unpacked as they are met (vec_dot and the
// matrix-vector product meet each block once; one token, so offset formats keep unsigned codes) ...
template <class WBlock>
struct Q32Blocks {
    static constexpr bool signed_values = Q32<WBlock>::is_signed;
    const WBlock* a;
    explicit Q32Blocks(const void* p) : a((const WBlock*)p) {}
    void get(int64_t i, Q32Ready& u) const { ready_block(a[i], u, false); }
};

// ... or the row unpacked beforehand (the batched product meets each block once per token, so it
// unpacks a few rows once and runs all its tokens over them).
struct Q32Unpacked {
    int8_t v[32];
    float d, m;
};
template <class WBlock>
struct Q32FromUnpacked {
    static constexpr bool signed_values = Q32<WBlock>::offset != 0 || Q32<WBlock>::is_signed;
    const Q32Unpacked* u;
    explicit Q32FromUnpacked(const void* p) : u((const Q32Unpacked*)p) {}
    void get(int64_t i, Q32Ready& r) const {
        r.v = load256(u[i].v);
        if (signed_values) r.absv = _mm256_sign_epi8(r.v, r.v);
        r.d = u[i].d;
        r.m = u[i].m;
    }
};

template <class WBlock>
inline void unpack_row_32(const void* row, int64_t nb, Q32Unpacked* out) {
    const WBlock* a = (const WBlock*)row;
    for (int64_t i = 0; i < nb; i++) {
        Q32Ready u;
        ready_block(a[i], u, true);
        _mm256_storeu_si256((__m256i*)out[i].v, u.v);
        out[i].d = u.d;
        out[i].m = u.m;
    }
}

// NR rows x NT tokens over nb blocks: s[t * s_stride + r] = dot(row r, x_t), rows read through Src.
// When ahead is not null, ahead[r] is a row read in step with row r a little later (the
// matrix-vector product passes the next rows): short interleaved streams train the hardware
// prefetcher poorly.
template <class WBlock, class Src, int NR, int NT>
inline void tile_32(int64_t nb, float* s, int64_t s_stride, const void* const* rows, const void* const* ahead,
                    const uint8_t* x, size_t x_stride) {
    typedef Q32<WBlock> Q;
    typedef typename Q::X XBlock;
    constexpr bool is_signed = Src::signed_values;
    // Unsigned codes of an offset format: the correction -off * (4-group sums of x) per token.
    constexpr bool correct = Q::offset != 0 && !is_signed;
    const Src* src[NR];
    alignas(Src) unsigned char src_mem[NR][sizeof(Src)];
    const XBlock* b[NT];
    static_assert(NT <= 8, "a tile holds at most 8 tokens");
    __m256 acc[NR][NT];
    __m256 mins[NR];  // Q4_1/Q5_1: lane t is token t's sum of the min terms m_w * s_x
    for (int r = 0; r < NR; r++) src[r] = new (src_mem[r]) Src(rows[r]);
    for (int t = 0; t < NT; t++) b[t] = (const XBlock*)(x + t * x_stride);
    for (int r = 0; r < NR; r++) {
        mins[r] = _mm256_setzero_ps();
        for (int t = 0; t < NT; t++) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < nb; i++) {
        // The tokens' activation blocks, shared by every row.
        __m256i xv[NT], base[NT];
        __m256 dx[NT];
        for (int t = 0; t < NT; t++) {
            xv[t] = load256(b[t][i].qs);
            // d_x in every lane, converted in the vector unit: then d_w * d_x is one vmulps per (row,
            // token) (the same value as the scalar product; written as set1(d_w * d_x) the compiler
            // emits a scalar multiply and a broadcast).
            dx[t] = _mm256_cvtph_ps(_mm_set1_epi16((short)b[t][i].d));
            base[t] = _mm256_setzero_si256();
            if (correct)
                base[t] = _mm256_sub_epi32(base[t], dot_u8s8(base[t], _mm256_set1_epi8((char)Q::offset), xv[t]));
        }
        __m256 sx = _mm256_setzero_ps();
        if constexpr (Q::has_min) sx = sums_of<NT>(b, i);
        auto ready = [&](int r, Q32Ready& u) {
            if (ahead) _mm_prefetch((const char*)&((const WBlock*)ahead[r])[i], _MM_HINT_T1);
            src[r]->get(i, u);
            // Q4_1/Q5_1: one fma per (row, token), the tokens side by side in lanes.
            if constexpr (Q::has_min) mins[r] = _mm256_fmadd_ps(_mm256_set1_ps(u.m), sx, mins[r]);
        };
        auto pair = [&](int r, int t, const Q32Ready& u) {
            const __m256i p = is_signed ? dot_u8s8(base[t], u.absv, _mm256_sign_epi8(xv[t], u.v))
                                        : dot_u8s8(base[t], u.v, xv[t]);
            acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(u.d), dx[t]), _mm256_cvtepi32_ps(p), acc[r][t]);
        };
        // The same arithmetic in two orders: with one token (many rows) row by row keeps few
        // registers live; with several tokens, every row's block unpacked first and then token by
        // token measured 5-10% faster (llvm-mca, Zen 3).
        if constexpr (NT == 1) {
            for (int r = 0; r < NR; r++) {
                Q32Ready u;
                ready(r, u);
                pair(r, 0, u);
            }
        } else {
            Q32Ready u[NR];
            for (int r = 0; r < NR; r++) ready(r, u[r]);
            for (int t = 0; t < NT; t++)
                for (int r = 0; r < NR; r++) pair(r, t, u[r]);
        }
    }
    for (int r = 0; r < NR; r++) {
        alignas(32) float m[8];
        _mm256_store_ps(m, mins[r]);
        for (int t = 0; t < NT; t++) s[t * s_stride + r] = hsum_ps(acc[r][t]) + m[t];
    }
}

// vec_dot's tile: rows read straight from their blocks.
template <class WBlock>
struct Q32Tile {
    static const void* const* prepare(int64_t, const void* const* rows, int64_t) { return rows; }
    template <int NR, int NT>
    static void run(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
        tile_32<WBlock, Q32Blocks<WBlock>, NR, NT>(n / 32, s, s_stride, rows, nullptr, x, x_stride);
    }
};

// The batched product's tile: prepare unpacks the tile's rows once (into a buffer of the calling
// thread), run reads them from there for every token.
template <class WBlock>
struct Q32UnpackedTile {
    static const void* const* prepare(int64_t n, const void* const* rows, int64_t n_rows) {
        static thread_local std::vector<Q32Unpacked> buf;
        static thread_local std::vector<const void*> ptrs;
        const int64_t nb = n / 32;
        if ((int64_t)buf.size() < n_rows * nb) buf.resize(n_rows * nb);
        if ((int64_t)ptrs.size() < n_rows) ptrs.resize(n_rows);
        for (int64_t r = 0; r < n_rows; r++) {
            unpack_row_32<WBlock>(rows[r], nb, buf.data() + r * nb);
            ptrs[r] = buf.data() + r * nb;
        }
        return ptrs.data();
    }
    template <int NR, int NT>
    static void run(int64_t n, float* s, int64_t s_stride, const void* const* rows, const uint8_t* x, size_t x_stride) {
        tile_32<WBlock, Q32FromUnpacked<WBlock>, NR, NT>(n / 32, s, s_stride, rows, nullptr, x, x_stride);
    }
};

// Matrix-vector product (vec_dot_rows_fn): rows 8 at a time sharing each activation block, the 8
// rows after them prefetched in step; every row's value is its vec_dot, bit for bit.
//
// Short Q8_0 rows (output layers: SmolLM2's 49152 x 576, Gemma 3's 262144 x 640) go one row at a
// time instead (still prefetching, in step, the row 8 further on). Eight rows in step are eight short
// streams that restart every tile, which the hardware prefetcher follows poorly; one row at a time is
// a single sequential stream. Measured on Zen 3 with 2 threads: 1.3-1.7x faster up to 2048 columns,
// the same at 4096. The 4-bit formats
// unpack more per byte and are bound by arithmetic there: they keep the 8-row tiles (one row at a
// time measured 10-20% slower at 640 columns).
template <class WBlock>
void vec_dot_rows_32(int64_t n, float* s, const void* const* rows, const void* x, int64_t n_rows) {
    typedef Q32Blocks<WBlock> Src;
    const uint8_t* xb = (const uint8_t*)x;
    int64_t r = 0;
    if (std::is_same<WBlock, block_q8_0>::value && (size_t)(n / 32) * sizeof(WBlock) <= 2304)
        for (; r < n_rows; r++) tile_32<WBlock, Src, 1, 1>(n / 32, s + r, 1, rows + r, rows + r + 8, xb, 0);
    for (; r + 8 <= n_rows; r += 8) tile_32<WBlock, Src, 8, 1>(n / 32, s + r, 1, rows + r, rows + r + 8, xb, 0);
    for (; r + 4 <= n_rows; r += 4) tile_32<WBlock, Src, 4, 1>(n / 32, s + r, 1, rows + r, rows + r + 4, xb, 0);
    for (; r < n_rows; r++) tile_32<WBlock, Src, 1, 1>(n / 32, s + r, 1, rows + r, rows + r + 1, xb, 0);
}

}  // namespace
}  // namespace optiml
