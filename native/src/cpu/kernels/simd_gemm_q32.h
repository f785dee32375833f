// The batched product (gemm) of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4), with
// the tokens side by side in vector lanes.
//
// A tile of one (row, token) per vector would convert, scale and accumulate each block's integer lanes
// per (row, token): 4-5 vector operations per (row, token, block), of which one is the integer dot.
// Here a vector holds 8 tokens instead: a row's 4-byte group is broadcast against the same group of 8
// tokens (transposed once per call into a panel), 8 vpdpbusd give 8 tokens' exact block sums, and the
// float steps (convert, scale, accumulate) are shared by the 8 tokens: 11-12 operations per (row,
// 8 tokens, block).
//
// Arithmetic: per (row, token), block after block, acc = fma(float(isum_b), d_w * d_x, acc), then for
// Q4_1/Q5_1 acc = fma(m_w, s_x, acc), isum_b the exact integer dot of the block: lane for lane what
// vec_dot and the matrix-vector kernels compute (simd_q32.h), so a token gets the same bits alone or
// in any batch, whatever the tile, the batch size or the thread count.
//
// Weights meet the activations as unsigned codes (Q4_0 and Q5_0 as stored, Q8_0 with 128 added) and
// the offset comes back out per (token, block) as -offset * sum(x), computed in the panel. With VNNI
// the integer dot is vpdpbusd (exact); without it vpmaddubsw, exact while pair sums fit int16: codes
// <= 31 (two groups are added in int16 before widening: 2 * 2 * 31 * 127 < 32767). Q8_0 codes would
// reach 255, so without VNNI Q8_0 uses signed bytes (ByteRows).
#pragma once

#include <type_traits>
#include <vector>

#include "simd_q32.h"

namespace optiml {
namespace {

constexpr int kPanelTokens = 8;

// Block i of 8 tokens: x[g] holds 4-byte group g (elements 4g..4g+3) of each token, token t in
// int32 lane t; dx the tokens' scales, sx their Q8_1 sums d * sum(q) (min formats), nc = -offset *
// sum(q) per token (offset formats). Tokens past the batch are zero everywhere.
struct XPanel {
    __m256i x[8];
    __m256 dx, sx;
    __m256i nc;
};

// 8 x 8 transpose of int32 lanes: out[g] lane t = in[t] lane g.
inline void transpose8_epi32(__m256i v[8]) {
    __m256i a[8], b[8];
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm256_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
        a[2 * k + 1] = _mm256_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        b[4 * k + 0] = _mm256_unpacklo_epi64(a[4 * k + 0], a[4 * k + 2]);
        b[4 * k + 1] = _mm256_unpackhi_epi64(a[4 * k + 0], a[4 * k + 2]);
        b[4 * k + 2] = _mm256_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm256_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_permute2x128_si256(b[k], b[k + 4], 0x20);
        v[k + 4] = _mm256_permute2x128_si256(b[k], b[k + 4], 0x31);
    }
}

// The panels of n_tok tokens (x + t * x_stride), ceil(n_tok / 8) groups of nb blocks each, for
// weight codes that carry offset off.
// With `twice` (at most 4 tokens), lanes 4-7 repeat tokens 0-3, for tiles that put two rows in a
// vector (rows2_tile).
template <class WBlock, int off>
inline void build_panels(const uint8_t* x, size_t x_stride, int64_t n_tok, int64_t nb, XPanel* out,
                         bool twice = false) {
    typedef typename Q32<WBlock>::X XBlock;
    for (int64_t t0 = 0; t0 < n_tok; t0 += kPanelTokens) {
        const int64_t nt = n_tok - t0 < kPanelTokens ? n_tok - t0 : kPanelTokens;
        const XBlock* b[kPanelTokens];
        int lane_token[kPanelTokens];
        for (int t = 0; t < kPanelTokens; t++) {
            lane_token[t] = twice ? t % 4 : t;
            b[t] = (const XBlock*)(x + (t0 + (lane_token[t] < nt ? lane_token[t] : 0)) * x_stride);
        }
        XPanel* p = out + (t0 / kPanelTokens) * nb;
        for (int64_t i = 0; i < nb; i++) {
            __m256i v[8];
            short d[8], s[8];
            for (int t = 0; t < 8; t++) {
                const bool live = lane_token[t] < nt;
                v[t] = live ? load256(b[t][i].qs) : _mm256_setzero_si256();
                d[t] = live ? (short)b[t][i].d : 0;
                s[t] = live ? (short)sum_of(b[t][i]) : 0;
            }
            transpose8_epi32(v);
            __m256i sum = _mm256_setzero_si256();
            for (int g = 0; g < 8; g++) {
                p[i].x[g] = v[g];
                if (off != 0) sum = dot_u8s8(sum, _mm256_set1_epi8(1), v[g]);
            }
            p[i].nc = _mm256_mullo_epi32(sum, _mm256_set1_epi32(-off));
            p[i].dx = _mm256_cvtph_ps(_mm_setr_epi16(d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]));
            p[i].sx = _mm256_cvtph_ps(_mm_setr_epi16(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]));
        }
    }
}

inline __m256i bcast32(const uint8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// The dword at p in lanes 0-3, the one at q in lanes 4-7.
inline __m256i bcast32x2(const uint8_t* p, const uint8_t* q) {
    int32_t u, v;
    std::memcpy(&u, p, 4);
    std::memcpy(&v, q, 4);
    return _mm256_blend_epi32(_mm256_set1_epi32(u), _mm256_set1_epi32(v), 0xF0);
}

// Two groups of one row (unsigned codes w0, w1, broadcast) against 8 tokens (x0, x1), added into acc.
inline __m256i dot_groups2(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
    if constexpr (kVnni256) return dot_u8s8(dot_u8s8(acc, w0, x0), w1, x1);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

// A block's scale (and min) in every lane, converted in the vector unit: the fp16 pair d, m of
// Q4_1 is one dword, broadcast, converted and spread by two in-lane shuffles.
template <class WBlock>
inline void scales_of(const WBlock& a, __m256& d, __m256& m) {
    if constexpr (Q32<WBlock>::has_min) {
        int32_t dm;
        std::memcpy(&dm, &a.d, 4);
        const __m256 f = _mm256_cvtph_ps(_mm_set1_epi32(dm));
        d = _mm256_permute_ps(f, 0x00);
        m = _mm256_permute_ps(f, 0x55);
    } else {
        d = _mm256_cvtph_ps(_mm_set1_epi16((short)a.d));
        m = d;
    }
}

// Two rows' scales (and mins): row a's in lanes 0-3, row b's in lanes 4-7; the same conversions of
// the same fp16 values as scales_of.
template <class WBlock>
inline void scales2_of(const WBlock& a, const WBlock& b, __m256& d, __m256& m) {
    int32_t da = 0, db = 0;
    std::memcpy(&da, &a.d, Q32<WBlock>::has_min ? 4 : 2);
    std::memcpy(&db, &b.d, Q32<WBlock>::has_min ? 4 : 2);
    const __m256 f = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm_set1_epi32(da), _mm_set1_epi32(db)));
    d = _mm256_permute_ps(f, 0x00);
    m = Q32<WBlock>::has_min ? _mm256_permute_ps(f, 0x55) : d;
}

// Where a tile reads a row's codes from, two groups at a time: pair(i, k, w0, w1) gives block i's
// groups group0(k) and group1(k), k = 0..3, as broadcast unsigned bytes.
//
// Q4_0/Q4_1 straight from their blocks: dword k of qs holds elements 4k..4k+3 in its low nibbles and
// 16+4k.. in its high ones. Unpacking in the tile runs beside the integer dots (other execution
// ports) where a separate unpacking pass would not. With VNNI the high nibbles are not shifted down:
// b & 0xF0 is 16 * code, its dots go to a second sum (high16; at most 16 * 240 * 128 per block, far
// inside int32), and that sum, a multiple of 16, is shifted back exactly once per block: 2 logic
// operations per pair instead of 3. vpmaddubsw's int16 pairs would overflow on 16 * code, so
// without VNNI the nibbles are shifted.
template <class WBlock>
struct NibbleRows {
    static constexpr int offset = Q32<WBlock>::offset;
    static constexpr bool high16 = kVnni256;
    static __m256i dot(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
        return dot_groups2(acc, w0, x0, w1, x1);
    }
    static int group0(int k) { return k; }
    static int group1(int k) { return k + 4; }
    const WBlock* a;
    void set(const void* row) { a = (const WBlock*)row; }
    // Broadcast packed bytes b -> the low nibbles' codes w0, the high nibbles' w1 (16 * code with high16).
    static void split(__m256i b, __m256i& w0, __m256i& w1) {
        const __m256i m = _mm256_set1_epi8(0x0F);
        w0 = _mm256_and_si256(b, m);
        w1 = high16 ? _mm256_xor_si256(b, w0) : _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
    }
    void pair(int64_t i, int k, __m256i& w0, __m256i& w1) const { split(bcast32(a[i].qs + 4 * k), w0, w1); }
    void scales(int64_t i, __m256& d, __m256& m) const { scales_of(a[i], d, m); }
    // This row in lanes 0-3, row o in lanes 4-7.
    void pair2(const NibbleRows& o, int64_t i, int k, __m256i& w0, __m256i& w1) const {
        split(bcast32x2(a[i].qs + 4 * k, o.a[i].qs + 4 * k), w0, w1);
    }
    void scales2(const NibbleRows& o, int64_t i, __m256& d, __m256& m) const { scales2_of(a[i], o.a[i], d, m); }
};
// Q8_0 from its blocks. With VNNI as unsigned codes (signed bytes + 128, offset 128); without it the
// codes would leave vpmaddubsw's exact range, so the signed bytes meet the activations as |w| . (x with
// w's sign), exact for x in [-127, 127], each group widened to int32 on its own.
struct ByteRows {
    static constexpr bool high16 = false;
    static constexpr int offset = kVnni256 ? 128 : 0;
    // Signed bytes as the codes the dot takes: + 128 with VNNI (unsigned), as they are without.
    static __m256i codes(__m256i b) { return offset ? _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)) : b; }
    static int group0(int k) { return 2 * k; }
    static int group1(int k) { return 2 * k + 1; }
    const block_q8_0* a;
    void set(const void* row) { a = (const block_q8_0*)row; }
    void pair(int64_t i, int k, __m256i& w0, __m256i& w1) const {
        w0 = codes(bcast32((const uint8_t*)a[i].qs + 8 * k));
        w1 = codes(bcast32((const uint8_t*)a[i].qs + 8 * k + 4));
    }
    static __m256i dot(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
        if (offset) return dot_groups2(acc, w0, x0, w1, x1);
        acc = dot_u8s8(acc, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
        return dot_u8s8(acc, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
    }
    void scales(int64_t i, __m256& d, __m256& m) const { scales_of(a[i], d, m); }
    void pair2(const ByteRows& o, int64_t i, int k, __m256i& w0, __m256i& w1) const {
        // Both groups of each row in one broadcast qword, the offset added once, then spread.
        int64_t u, v;
        std::memcpy(&u, (const uint8_t*)a[i].qs + 8 * k, 8);
        std::memcpy(&v, (const uint8_t*)o.a[i].qs + 8 * k, 8);
        const __m256i b = codes(_mm256_blend_epi32(_mm256_set1_epi64x(u), _mm256_set1_epi64x(v), 0xF0));
        w0 = _mm256_shuffle_epi32(b, 0x00);
        w1 = _mm256_shuffle_epi32(b, 0x55);
    }
    void scales2(const ByteRows& o, int64_t i, __m256& d, __m256& m) const { scales2_of(a[i], o.a[i], d, m); }
};
// Q5_0/Q5_1: the fifth bit is spread over qh, so rows are unpacked to 32 code bytes per block first
// (once per call, shared by every token group). MXFP4 too: its nibbles looked up in the table (+ 12) and its
// E8M0 scale converted once per call instead of once per token group (measured on Zen 4, 4096 x 4096, 2
// threads: 250 GFLOP/s at 64 tokens against 150 looking up in the tile; 110 against Q4_0's 117 at 4 tokens).
struct CodeBlock {
    uint8_t q[32];
    float d, m;
};
// Signed: the codes are signed values (IQ4_NL's table), met as |w| . (x with w's sign), as Q8_0's bytes.
template <int Offset, bool Signed = false>
struct CodeRows {
    static constexpr int offset = Offset;
    static constexpr bool high16 = false;
    static __m256i dot(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
        if constexpr (Signed) {
            acc = dot_u8s8(acc, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
            return dot_u8s8(acc, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
        }
        return dot_groups2(acc, w0, x0, w1, x1);
    }
    static int group0(int k) { return 2 * k; }
    static int group1(int k) { return 2 * k + 1; }
    const CodeBlock* a;
    void set(const void* row) { a = (const CodeBlock*)row; }
    void pair(int64_t i, int k, __m256i& w0, __m256i& w1) const {
        w0 = bcast32(a[i].q + 8 * k);
        w1 = bcast32(a[i].q + 8 * k + 4);
    }
    void scales(int64_t i, __m256& d, __m256& m) const {
        d = _mm256_set1_ps(a[i].d);
        m = _mm256_set1_ps(a[i].m);
    }
    void pair2(const CodeRows& o, int64_t i, int k, __m256i& w0, __m256i& w1) const {
        w0 = bcast32x2(a[i].q + 8 * k, o.a[i].q + 8 * k);
        w1 = bcast32x2(a[i].q + 8 * k + 4, o.a[i].q + 8 * k + 4);
    }
    void scales2(const CodeRows& o, int64_t i, __m256& d, __m256& m) const {
        d = _mm256_set_m128(_mm_set1_ps(o.a[i].d), _mm_set1_ps(a[i].d));
        m = _mm256_set_m128(_mm_set1_ps(o.a[i].m), _mm_set1_ps(a[i].m));
    }
};

template <class WBlock> struct PanelSource { typedef NibbleRows<WBlock> T; };
template <> struct PanelSource<block_q8_0> { typedef ByteRows T; };
template <> struct PanelSource<block_q5_0> { typedef CodeRows<16> T; };
template <> struct PanelSource<block_q5_1> { typedef CodeRows<0> T; };
template <> struct PanelSource<block_mxfp4> { typedef CodeRows<12> T; };
template <> struct PanelSource<block_iq4_nl> { typedef CodeRows<0, true> T; };
template <class Src> struct IsCodeRows : std::false_type {};
template <int O, bool S> struct IsCodeRows<CodeRows<O, S>> : std::true_type {};

// Q5_0/Q5_1/MXFP4/IQ4_NL rows as code bytes and float scales, once per call.
template <class WBlock>
inline void unpack_code_row(const void* row, int64_t nb, CodeBlock* out) {
    const WBlock* a = (const WBlock*)row;
    for (int64_t i = 0; i < nb; i++) {
        _mm256_storeu_si256((__m256i*)out[i].q, Q32<WBlock>::codes(a[i]));
        out[i].d = scale_of(a[i]);
        out[i].m = min_of(a[i]);
    }
}

// NR rows against one panel group (8 tokens): out[r][t]. With Pairs (panels built `twice`, at most 4
// tokens), a vector holds rows 2v (lanes 0-3) and 2v + 1 (lanes 4-7) against the same 4 tokens: half
// the integer dots, logic and float steps of a vector per row with 4 lanes idle.
template <class WBlock, int NR, bool Pairs = false>
inline void panel_tile(int64_t nb, const void* const* rows, const void* const* ahead, const XPanel* p,
                       float out[][kPanelTokens]) {
    typedef typename PanelSource<WBlock>::T Src;
    constexpr bool offset = Src::offset != 0;
    constexpr int NV = Pairs ? NR / 2 : NR;  // vectors
    static_assert(!Pairs || NR % 2 == 0, "a tile of row pairs takes an even number of rows");
    Src src[NR];
    __m256 acc[NV];
    for (int r = 0; r < NR; r++) src[r].set(rows[r]);
    for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps();
    auto codes = [&](int v, int64_t i, int k, __m256i& w0, __m256i& w1) {
        if constexpr (Pairs) src[2 * v].pair2(src[2 * v + 1], i, k, w0, w1);
        else src[v].pair(i, k, w0, w1);
    };
    for (int64_t i = 0; i < nb; i++) {
        __m256i isum[NV];
        for (int v = 0; v < NV; v++) isum[v] = offset ? p[i].nc : _mm256_setzero_si256();
        if (ahead)
            for (int r = 0; r < NR; r++) _mm_prefetch((const char*)ahead[r] + i * sizeof(WBlock), _MM_HINT_T1);
        if constexpr (Src::high16) {
            __m256i hsum[NV];
            for (int v = 0; v < NV; v++) hsum[v] = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) {
                const __m256i x0 = p[i].x[Src::group0(k)], x1 = p[i].x[Src::group1(k)];
                for (int v = 0; v < NV; v++) {
                    __m256i w0, w1;
                    codes(v, i, k, w0, w1);
                    isum[v] = dot_u8s8(isum[v], w0, x0);
                    hsum[v] = dot_u8s8(hsum[v], w1, x1);
                }
            }
            for (int v = 0; v < NV; v++) isum[v] = _mm256_add_epi32(isum[v], _mm256_srai_epi32(hsum[v], 4));
        } else {
            for (int k = 0; k < 4; k++) {
                const __m256i x0 = p[i].x[Src::group0(k)], x1 = p[i].x[Src::group1(k)];
                for (int v = 0; v < NV; v++) {
                    __m256i w0, w1;
                    codes(v, i, k, w0, w1);
                    isum[v] = Src::dot(isum[v], w0, x0, w1, x1);
                }
            }
        }
        for (int v = 0; v < NV; v++) {
            __m256 d, m;
            if constexpr (Pairs) src[2 * v].scales2(src[2 * v + 1], i, d, m);
            else src[v].scales(i, d, m);
            acc[v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[v]), _mm256_mul_ps(d, p[i].dx), acc[v]);
            if constexpr (Q32<WBlock>::has_min) acc[v] = _mm256_fmadd_ps(m, p[i].sx, acc[v]);
        }
    }
    for (int v = 0; v < NV; v++) {
        if constexpr (Pairs) {
            _mm_storeu_ps(out[2 * v], _mm256_castps256_ps128(acc[v]));
            _mm_storeu_ps(out[2 * v + 1], _mm256_extractf128_ps(acc[v], 1));
        } else {
            _mm256_storeu_ps(out[v], acc[v]);
        }
    }
}

// gemm_fn: s[t * n_rows + r] = row r . token t. The tokens are transposed into panels once per call
// (Q5_0/Q5_1 rows unpacked too); then NR rows at a time (the last rows one by one) run against every
// panel group.
template <class WBlock, int NR>
void gemm_panels_32(int64_t n, float* s, const void* const* rows, int64_t n_rows, const void* x, size_t x_stride,
                    int64_t n_tok) {
    constexpr bool unpacked = IsCodeRows<typename PanelSource<WBlock>::T>::value;
    const int64_t nb = n / 32;
    const int64_t n_groups = (n_tok + kPanelTokens - 1) / kPanelTokens;
    static thread_local std::vector<XPanel> panels;
    static thread_local std::vector<CodeBlock> codes;
    static thread_local LocalVector<const void*> unpacked_rows;
    if ((int64_t)panels.size() < n_groups * nb) panels.resize(n_groups * nb);
    // Up to 4 tokens: two rows per vector (4 lanes each) instead of one row with half its lanes idle.
    const bool pairs = n_tok <= 4;
    build_panels<WBlock, PanelSource<WBlock>::T::offset>((const uint8_t*)x, x_stride, n_tok, nb, panels.data(),
                                                         pairs);
    if (unpacked) {
        if ((int64_t)codes.size() < n_rows * nb) codes.resize(n_rows * nb);
        if ((int64_t)unpacked_rows.size() < n_rows) unpacked_rows.resize(n_rows);
        for (int64_t r = 0; r < n_rows; r++) {
            unpack_code_row<WBlock>(rows[r], nb, codes.data() + r * nb);
            unpacked_rows[r] = codes.data() + r * nb;
        }
        rows = unpacked_rows.data();
    }

    if (!unpacked)  // the first tile's rows (the others are fetched in step with the tile before them)
        for (int64_t r = 0; r < NR && r < n_rows; r++)
            for (size_t off = 0; off < nb * sizeof(WBlock); off += 64) _mm_prefetch((const char*)rows[r] + off, _MM_HINT_T0);
    float out[NR][kPanelTokens];
    auto run = [&](auto nr_const, int64_t r0) {
        constexpr int nr = decltype(nr_const)::value;
        for (int64_t g = 0; g < n_groups; g++) {
            // The next rows are fetched in step with the first group's pass over these: several rows
            // read in step are short interleaved streams that the hardware prefetcher follows poorly.
            // Into L2, not L1: SmolLM2's rows from DRAM, 8 tokens, 1 thread, 122-130 GFLOP/s into L1
            // against 135-150 into L2 (one tile ahead; two ahead was no better).
            const void* const* ahead = g == 0 && !unpacked && r0 + 2 * nr <= n_rows ? rows + r0 + nr : nullptr;
            if (nr > 1 && pairs) panel_tile<WBlock, nr, (nr > 1)>(nb, rows + r0, ahead, panels.data() + g * nb, out);
            else panel_tile<WBlock, nr>(nb, rows + r0, ahead, panels.data() + g * nb, out);
            const int64_t t0 = g * kPanelTokens;
            const int64_t nt = n_tok - t0 < kPanelTokens ? n_tok - t0 : kPanelTokens;
            for (int64_t t = 0; t < nt; t++)
                for (int k = 0; k < nr; k++) s[(t0 + t) * n_rows + r0 + k] = out[k][t];
        }
    };
    int64_t r0 = 0;
    for (; r0 + NR <= n_rows; r0 += NR) run(std::integral_constant<int, NR>(), r0);
    for (; r0 < n_rows; r0++) run(std::integral_constant<int, 1>(), r0);
}

}  // namespace
}  // namespace optiml
