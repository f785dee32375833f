// AVX2 kernels for grouped neuron-major rows (contract: kernels.h, axpy_group_fn): the codes are summed
// with the int8 coefficients in integers, two neurons per vpmaddubsw.
//
// A pair of neurons' 16 code bytes of a 32-dimension chunk are interleaved (byte b of neuron i, then of
// neuron j, for each b); the low nibbles are then codes of dimensions 0-15 in pairs, the high nibbles
// those of dimensions 16-31, and vpmaddubsw with (q_i, q_j) repeated gives per dimension
// q_i * c_i + q_j * c_j in an int16, in dimension order. |q| <= 127 and c <= 15: a pair adds at most
// 3810, so eight pairs fit an int16 (30480) before they are widened into int32 sums. The sums are
// exact, and the final float steps are the scalar reference's: the bits are the same.
//
// A group is summed pair by pair, each pair's two rows read front to back over a block of up to 2048
// dimensions into int16 sums kept in L1 (long sequential streams, as the 8-bit kernel reads its rows;
// walking all of a group's rows 16 bytes at a time left the memory system idle between short reads).
#include "optiml/sparse.h"
#include "simd_x86.h"
#include "sparse_axpy_grouped_simd.h"

namespace optiml {
namespace {

constexpr int kPrefetchAhead = kGroupPrefetchDims / 2;  // bytes of a row: 256
constexpr int kPairsPerWiden = 8;    // pairs summed in int16 before widening: 8 * 3810 < 32768

// The 32 codes of one chunk of rows x and z, interleaved: lo = dimensions 0-15, hi = 16-31, each as
// (code of x, code of z) byte pairs in dimension order.
__attribute__((always_inline)) inline void pair_codes(const uint8_t* x, const uint8_t* z, __m256i* lo, __m256i* hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i bx = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)x));
    const __m256i bz = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)z));
    // Lane 0: bytes 0-7 of x and z interleaved; lane 1: bytes 8-15.
    const __m256i v = _mm256_blend_epi32(_mm256_unpacklo_epi8(bx, bz), _mm256_unpackhi_epi8(bx, bz), 0xF0);
    *lo = _mm256_and_si256(v, mask);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
}

constexpr int64_t kBlock = 2048;  // dimensions whose sums are kept at once (12 KiB of int16 + int32)

// The float step of a block's outputs (group_scale_into): y, the scales d and minimums m of its first
// dimension, and the group's constants.
template <bool MIN, typename S>
struct ScaleInto {
    float* y;
    const S* d;
    const S* m;  // null without minimums
    __m256i centre;
    __m256 vs, ms;
    // Outputs 8j .. 8j + 7 from their int32 sums.
    __attribute__((always_inline)) void put(int j, __m256i t) const {
        group_scale_into<F32x8, MIN, S>(y + 8 * j, t, d + 8 * j, MIN ? m + 8 * j : nullptr, centre, vs, ms);
    }
    // Outputs 16j .. 16j + 15 from their int16 sums.
    __attribute__((always_inline)) void put16(int j, __m256i t16) const {
        put(2 * j, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(t16)));
        put(2 * j + 1, _mm256_cvtepi16_epi32(_mm256_extracti128_si256(t16, 1)));
    }
};

// One pair of rows (x, z: the chunks of the block, at their byte offset) times (q_x, q_z) into the
// block's int16 sums; FIRST: the pair starts the sums; LAST: the group's last pair, its sums (whole in
// int16: at most 2 * kPairsPerWiden rows) scaled straight into y through out, never stored.
// nx, nz: the next pair's rows (null at the end), fetched in step: four streams in flight, not two.
// sd, sm: the block's scales and minimums (null: not this pair), S_BYTES a chunk, fetched in step too:
// they are read only after the sums, and would otherwise arrive one dependent miss after another.
// fx, fz: the pair three passes ahead (null: none), fetched into L2 in step: the rows are short streams at
// random addresses, and one pass of lead does not cover the memory latency.
// nsd, nsm: the next group's scales and minimums (null: none), fetched into L2 in step (with sd).
template <bool FIRST, bool LAST, class Out>
__attribute__((always_inline)) inline void pair_into(const uint8_t* x, const uint8_t* z, const uint8_t* nx,
                                                     const uint8_t* nz, const uint8_t* fx, const uint8_t* fz,
                                                     const char* sd, const char* sm, const char* nsd,
                                                     const char* nsm, int nc, __m256i qq, __m256i* acc,
                                                     const Out& out) {
    constexpr int S_BYTES = 32 * sizeof(*out.d);
    for (int c = 0; c < nc; c++) {
        if (sd)
            for (int l = 0; l < S_BYTES; l += 64) {
                _mm_prefetch(sd + S_BYTES * c + l, _MM_HINT_T0);
                if (sm) _mm_prefetch(sm + S_BYTES * c + l, _MM_HINT_T0);
                if (nsd) _mm_prefetch(nsd + S_BYTES * c + l, _MM_HINT_T1);
                if (nsm) _mm_prefetch(nsm + S_BYTES * c + l, _MM_HINT_T1);
            }
        if (c % 4 == 0) {
            _mm_prefetch((const char*)x + 16 * c + kPrefetchAhead, _MM_HINT_T0);
            _mm_prefetch((const char*)z + 16 * c + kPrefetchAhead, _MM_HINT_T0);
            if (nx) {
                _mm_prefetch((const char*)nx + 16 * c, _MM_HINT_T0);
                _mm_prefetch((const char*)nz + 16 * c, _MM_HINT_T0);
            }
            if (fx) _mm_prefetch((const char*)fx + 16 * c, _MM_HINT_T1);
            if (fz) _mm_prefetch((const char*)fz + 16 * c, _MM_HINT_T1);
        }
        __m256i lo, hi;
        pair_codes(x + 16 * c, z + 16 * c, &lo, &hi);
        const __m256i plo = _mm256_maddubs_epi16(lo, qq), phi = _mm256_maddubs_epi16(hi, qq);
        const __m256i slo = FIRST ? plo : _mm256_add_epi16(acc[2 * c], plo);
        const __m256i shi = FIRST ? phi : _mm256_add_epi16(acc[2 * c + 1], phi);
        if (LAST) {
            out.put16(2 * c, slo);
            out.put16(2 * c + 1, shi);
        } else {
            acc[2 * c] = slo;
            acc[2 * c + 1] = shi;
        }
    }
}

// One group: pair by pair, each pair's two rows read front to back over a block of dimensions (two
// sequential streams, as the 8-bit kernel reads its rows), the sums in int16 in L1, widened into int32
// every kPairsPerWiden pairs when there are more; then the block's outputs scaled into y: by the last
// pair itself when the int16 sums are whole (at most 2 * kPairsPerWiden rows, every group at the
// sparsities decoding sees), after the widened sums otherwise.
template <bool MIN, typename S>
void one_group(int64_t n, float* y, size_t off, const GroupTerms& g, const GroupTerms* next, int n_next) {
    alignas(32) __m256i acc[kBlock / 16];  // int16 sums: dimensions 16j .. 16j + 15
    alignas(32) __m256i t[kBlock / 8];     // int32 sums (more than 2 * kPairsPerWiden rows): 8j .. 8j + 7
    const bool wide = g.k > 2 * kPairsPerWiden;
    const __m256i centre = _mm256_set1_epi32(MIN ? 0 : 8 * g.q_sum);
    const __m256 vs = _mm256_set1_ps(g.s);
    const __m256 ms = _mm256_set1_ps(g.s * (float)g.q_sum);
    for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
        const int nc = (int)((n - b0 < kBlock ? n - b0 : kBlock) / 32);
        const size_t o = off + (size_t)b0 / 2;
        const ScaleInto<MIN, S> out = {y + b0, (const S*)g.d + b0, MIN ? (const S*)g.m + b0 : nullptr, centre, vs, ms};
        for (int64_t i0 = 0; i0 < g.k; i0 += 2 * kPairsPerWiden) {
            const int64_t i1 = i0 + 2 * kPairsPerWiden < g.k ? i0 + 2 * kPairsPerWiden : g.k;
            for (int64_t i = i0; i < i1; i += 2) {
                // An odd last row is paired with itself at coefficient 0.
                const bool two = i + 1 < i1;
                const uint8_t* x = (const uint8_t*)g.w[i] + o;
                const uint8_t* z = two ? (const uint8_t*)g.w[i + 1] + o : x;
                const uint16_t qz = two ? (uint8_t)g.q[i + 1] : 0;
                const __m256i qq = _mm256_set1_epi16((int16_t)((uint8_t)g.q[i] | qz << 8));
                // The next pair (rows i + 2, i + 3) and the pair three passes ahead (i + 8, i + 9), of this
                // group or the following ones (same block of dimensions); a missing second row repeats the
                // first.
                const uint8_t* nxt[2] = {nullptr, nullptr};
                const uint8_t* f[2] = {nullptr, nullptr};
                if (group_rows_ahead(g, next, n_next, i + 2, o, nxt, 2) == 1) nxt[1] = nxt[0];
                group_rows_ahead(g, next, n_next, i + 8, o, f, 2);
                const uint8_t *nx = nxt[0], *nz = nxt[1], *fx = f[0], *fz = f[1];
                // The group's scales, and the next group's, fetched during its first pair.
                const bool scales = i == 0;
                const bool next_scales = scales && n_next > 0;
                const char* sd = scales ? (const char*)((const S*)g.d + b0) : nullptr;
                const char* sm = MIN && scales ? (const char*)((const S*)g.m + b0) : nullptr;
                const char* nsd = next_scales ? (const char*)((const S*)next->d + b0) : nullptr;
                const char* nsm = MIN && next_scales ? (const char*)((const S*)next->m + b0) : nullptr;
                // Up to 2 * kPairsPerWiden rows the group's last pair scales its sums straight into y.
                const bool last = !wide && i + 2 >= g.k;
                if (i == i0 && last)
                    pair_into<true, true>(x, z, nx, nz, fx, fz, sd, sm, nsd, nsm, nc, qq, acc, out);
                else if (i == i0)
                    pair_into<true, false>(x, z, nx, nz, fx, fz, sd, sm, nsd, nsm, nc, qq, acc, out);
                else if (last)
                    pair_into<false, true>(x, z, nx, nz, fx, fz, sd, sm, nsd, nsm, nc, qq, acc, out);
                else
                    pair_into<false, false>(x, z, nx, nz, fx, fz, sd, sm, nsd, nsm, nc, qq, acc, out);
            }
            if (wide)
                for (int j = 0; j < 2 * nc; j++) {
                    const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc[j]));
                    const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc[j], 1));
                    t[2 * j] = i0 == 0 ? lo : _mm256_add_epi32(t[2 * j], lo);
                    t[2 * j + 1] = i0 == 0 ? hi : _mm256_add_epi32(t[2 * j + 1], hi);
                }
        }
        if (wide)
            for (int j = 0; j < 4 * nc; j++) out.put(j, t[j]);
        else if (g.k == 0)
            for (int j = 0; j < 2 * nc; j++) out.put16(j, _mm256_setzero_si256());
    }
}

}  // namespace

void fill_sparse_grouped_avx2(KernelTable& t) {
    fill_axpy_group<one_group<false, fp16_t>, one_group<true, fp16_t>, one_group<true, float>>(t);
}

}  // namespace optiml
