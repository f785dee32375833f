// What the grouped rows' kernels (contract: kernels.h, axpy_group_fn) share across instruction sets,
// written once against a float vector type FV (simd_x86.h, simd_neon.h): the float step from a group's
// exact integer sums to y, and the entry that runs a kernel's one_group over the groups of a call. How the
// integer sums are formed differs by instruction set (sparse_axpy_grouped_avx2.cpp: vpmaddubsw pair
// sums; _avx512vnni.cpp: vpdpbusd on four rows; _neon.cpp: widening multiply-accumulates).
#pragma once

namespace optiml {
namespace {

template <class FV> inline typename FV::V group_scales(const fp16_t* s) { return FV::load_f16(s); }
template <class FV> inline typename FV::V group_scales(const float* s) { return FV::load_f32(s); }

// Outputs y[0 .. FV::N) from their integer sums t, the scalar reference's float steps lane for lane:
// y = fma(d * s, (float)(t - centre), y), then with minimums (MIN) y = fma(m, s * q_sum, y).
// vs = s and ms = s * q_sum in every lane; d and m are the scales and minimums of these outputs.
template <class FV, bool MIN, class S>
__attribute__((always_inline)) inline void group_scale_into(float* y, typename FV::VI t, const S* d, const S* m,
                                                            typename FV::VI centre, typename FV::V vs,
                                                            typename FV::V ms) {
    const typename FV::V v = FV::i32_to_f32(FV::sub_i32(t, centre));
    typename FV::V out = FV::fma(FV::mul(group_scales<FV>(d), vs), v, FV::load_f32(y));
    if (MIN) out = FV::fma(group_scales<FV>(m), ms, out);
    FV::store(y, out);
}

// One group of a call: its rows into y, told the groups after it (next[0 .. n_next)) to prefetch.
typedef void (*one_group_fn)(int64_t n, float* y, size_t off, const GroupTerms& g, const GroupTerms* next,
                             int n_next);

template <one_group_fn G>
void axpy_group_by(int64_t n, float* y, size_t off, const GroupTerms* groups, int n_groups) {
    for (int gi = 0; gi < n_groups; gi++) G(n, y, off, groups[gi], groups + gi + 1, n_groups - gi - 1);
}

// The table's entries from a kernel's one_group<MIN, S>: Q4_0 (fp16 scales, no minimums), Q4_1 (fp16
// scales and minimums), Q4_K (float scales and minimums).
template <one_group_fn Q4_0, one_group_fn Q4_1, one_group_fn Q4_K>
inline void fill_axpy_group(KernelTable& t) {
    t.axpy_group[TYPE_Q4_0] = axpy_group_by<Q4_0>;
    t.axpy_group[TYPE_Q4_1] = axpy_group_by<Q4_1>;
    t.axpy_group[TYPE_Q4_K] = axpy_group_by<Q4_K>;
}

}  // namespace
}  // namespace optiml
