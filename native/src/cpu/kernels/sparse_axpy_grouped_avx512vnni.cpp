// AVX-512 VNNI kernels for grouped neuron-major rows (contract: kernels.h, axpy_group_fn): four neurons'
// codes of a dimension side by side in an int32 lane, summed with their four int8 coefficients by one
// vpdpbusd, straight into int32 (the AVX2 kernel forms int16 pair sums with vpmaddubsw and widens them).
//
// A 32-dimension chunk of four rows is 4 x 16 bytes (Q4_0's nibble order: byte b holds dimension b in
// its low nibble, b + 16 in its high one). Loaded into the four 128-bit lanes of a zmm, a dword
// permute brings bytes 4L..4L+3 of every row into lane L and an in-lane byte shuffle puts the four
// rows' bytes of each dimension side by side; the nibbles then split into dimensions 0-15 and 16-31.
// The sums are exact integers (|t| <= 15 * 127 * kMaxGroupRun < 2^24) and the float steps are the
// scalar reference's, lane for lane: the bits are the same.
//
// As in the AVX2 kernel, a group is summed eight rows at a time over a block of up to 2048 dimensions,
// each row read front to back (long sequential streams), the int32 sums kept in L1.
#include "optiml/sparse.h"
#include "simd_x86.h"
#include "sparse_axpy_grouped_simd.h"

namespace optiml {
namespace {

constexpr int64_t kBlock = 2048;                         // dimensions whose sums are kept at once (8 KiB)
constexpr int kPrefetchAhead = kGroupPrefetchDims / 2;  // bytes of a row: 256

// The codes of one chunk of rows x[0..3]: lo = dimensions 0-15, hi = 16-31, int32 lane j holding the
// four rows' codes of dimension j (row r in byte r).
__attribute__((always_inline)) inline void quad_codes(const uint8_t* const* x, size_t at, __m512i* lo, __m512i* hi) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(x[0] + at)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(x[1] + at)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(x[2] + at)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(x[3] + at)), 3);
    // Lane L: dword L (bytes 4L..4L+3) of rows 0..3; then byte 4k + r <- byte 4r + k.
    v = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
    v = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7,
                                                                    11, 15)));
    const __m512i mask = _mm512_set1_epi8(0x0F);
    *lo = _mm512_and_si512(v, mask);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

// Rows i..i+3 of g at byte offset o (rows past k: row i again, at coefficient 0) and their coefficients
// as the four bytes of an int32.
inline __m512i quad_rows(const GroupTerms& g, int64_t i, size_t o, const uint8_t** x) {
    uint32_t q = 0;
    for (int r = 0; r < 4; r++) {
        const bool real = i + r < g.k;
        x[r] = (const uint8_t*)g.w[real ? i + r : i] + o;
        q |= (uint32_t)(real ? (uint8_t)g.q[i + r] : 0) << (8 * r);
    }
    return _mm512_set1_epi32((int32_t)q);
}

// The float step of 16 outputs from their integer sums t (group_scale_into).
template <bool MIN, typename S>
__attribute__((always_inline)) inline void scale_into(float* y, __m512i t, const S* d, const S* m, __m512i centre,
                                                      __m512 vs, __m512 ms) {
    group_scale_into<F32x16, MIN, S>(y, t, d, m, centre, vs, ms);
}

template <bool MIN, typename S>
void one_group(int64_t n, float* y, size_t off, const GroupTerms& g, const GroupTerms* next, int n_next) {
    alignas(64) int32_t acc[kBlock];  // sums between passes (groups of more than 8 rows)
    const __m512i centre = _mm512_set1_epi32(MIN ? 0 : 8 * g.q_sum);
    const __m512 vs = _mm512_set1_ps(g.s);
    const __m512 ms = _mm512_set1_ps(g.s * (float)g.q_sum);
    constexpr int sb = 32 * sizeof(S);  // scale bytes of a chunk
    constexpr int kScaleAhead = 8;      // chunks: the scales are read in the last pass, fetched this far ahead
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
        const int nc = (int)((n - b0 < kBlock ? n - b0 : kBlock) / 32);
        const size_t o = off + (size_t)b0 / 2;
        const S* d = (const S*)g.d + b0;
        const S* m = MIN ? (const S*)g.m + b0 : nullptr;
        float* yb = y + b0;
        for (int l = 0; l < sb * kScaleAhead && l < sb * nc; l += 64) {  // the first chunks' scales; the
            _mm_prefetch((const char*)d + l, _MM_HINT_T0);                 // loop fetches the rest ahead
            if (MIN) _mm_prefetch((const char*)m + l, _MM_HINT_T0);
        }
        if (g.k == 0)  // sums of zero, still scaled in (the contract's centring term)
            for (int j = 0; j < 2 * nc; j++)
                scale_into<MIN, S>(yb + 16 * j, _mm512_setzero_si512(), d + 16 * j, MIN ? m + 16 * j : nullptr, centre,
                                   vs, ms);
        // Passes of eight rows. The first starts the sums from zero, the last scales them straight into y:
        // a group of at most eight rows (most of them at high sparsity) never touches acc.
        for (int64_t i = 0; i < g.k; i += 8) {
            const bool first = i == 0, last = i + 8 >= g.k;
            const uint8_t* xa[4];
            const uint8_t* xb[4];
            const __m512i qa = quad_rows(g, i, o, xa);
            const bool two = i + 4 < g.k;
            const __m512i qb = two ? quad_rows(g, i + 4, o, xb) : _mm512_setzero_si512();
            // The sixteen rows after these (of this group, then the next groups' first ones), fetched into
            // L2 a line per row every four chunks: two passes of lead, so their lines arrive long before
            // they are read, whatever the memory latency (rows are short streams at random addresses,
            // which the hardware prefetchers learn too late). Missing ones repeat the last (no branches
            // in the loop).
            const uint8_t* nx[16];
            const int n_nx = group_rows_ahead(g, next, n_next, i + 8, o, nx, 16);
            for (int r = n_nx; r < 16; r++) nx[r] = n_nx ? nx[n_nx - 1] : xa[0];
            // The next group's scales (and minimums) of this block, into L2 during this group's first pass.
            const char* nd = first && n_next > 0 ? (const char*)((const S*)next[0].d + b0) : nullptr;
            const char* nm = MIN && nd ? (const char*)((const S*)next[0].m + b0) : nullptr;
            for (int c = 0; c < nc; c++) {
                if (nd)
                    for (int l = 0; l < sb; l += 64) {
                        _mm_prefetch(nd + sb * c + l, _MM_HINT_T1);
                        if (MIN) _mm_prefetch(nm + sb * c + l, _MM_HINT_T1);
                    }
                if (last && c + kScaleAhead < nc)
                    for (int l = 0; l < sb; l += 64) {
                        _mm_prefetch((const char*)d + sb * (c + kScaleAhead) + l, _MM_HINT_T0);
                        if (MIN) _mm_prefetch((const char*)m + sb * (c + kScaleAhead) + l, _MM_HINT_T0);
                    }
                if (c % 4 == 0) {
                    for (int r = 0; r < 4; r++) {
                        _mm_prefetch((const char*)xa[r] + 16 * c + kPrefetchAhead, _MM_HINT_T0);
                        if (two) _mm_prefetch((const char*)xb[r] + 16 * c + kPrefetchAhead, _MM_HINT_T0);
                    }
                    for (int r = 0; r < 16; r++) _mm_prefetch((const char*)nx[r] + 16 * c, _MM_HINT_T1);
                }
                __m512i lo, hi;
                __m512i a0 = first ? _mm512_setzero_si512() : _mm512_load_si512(acc + 32 * c);
                __m512i a1 = first ? _mm512_setzero_si512() : _mm512_load_si512(acc + 32 * c + 16);
                quad_codes(xa, 16 * (size_t)c, &lo, &hi);
                a0 = _mm512_dpbusd_epi32(a0, lo, qa);
                a1 = _mm512_dpbusd_epi32(a1, hi, qa);
                if (two) {
                    quad_codes(xb, 16 * (size_t)c, &lo, &hi);
                    a0 = _mm512_dpbusd_epi32(a0, lo, qb);
                    a1 = _mm512_dpbusd_epi32(a1, hi, qb);
                }
                if (last) {
                    scale_into<MIN, S>(yb + 32 * c, a0, d + 32 * c, MIN ? m + 32 * c : nullptr, centre, vs, ms);
                    scale_into<MIN, S>(yb + 32 * c + 16, a1, d + 32 * c + 16, MIN ? m + 32 * c + 16 : nullptr, centre,
                                       vs, ms);
                } else {
                    _mm512_store_si512(acc + 32 * c, a0);
                    _mm512_store_si512(acc + 32 * c + 16, a1);
                }
            }
        }
    }
}

}  // namespace

void fill_sparse_grouped_avx512vnni(KernelTable& t) {
    fill_axpy_group<one_group<false, fp16_t>, one_group<true, fp16_t>, one_group<true, float>>(t);
}

}  // namespace optiml
