// Native test of the SIMD kernel tables against the scalar reference, without Python: built from the
// core sources alone (tools/checks/neon_check.sh cross-compiles it for aarch64 and runs it under qemu-user).
//
// For each SIMD level given on the command line (default: every available level but scalar), each
// entry of its KernelTable is run on random data and compared with the scalar table's entry:
//   * vec_dot: within 2e-5 * sum|w_i x_i| + 1e-6 of the scalar result and of a float64 dot of the
//     dequantized operands (the bound tests/test_simd.py uses: float summation order only);
//   * vec_dot4 and vec_dot_rows: bit-identical to the level's own vec_dot (kernels.h);
//   * from_float (activation conversion): byte-identical to scalar, with ties, zeros, tiny and huge
//     values, NaN and infinities for the float types;
//   * attn_dot: within 2e-5 * sum|x_i y_i| + 1e-6 of scalar (double accumulation);
//   * softmax_exp: each y within 3e-7 relative (ggml's vector exp is within ~1.5 ulp of expf), the
//     sum within 1e-6 relative; silu_mul and gelu_exact_mul within 1e-6 relative;
//   * relu_mul, gelu_mul and the sparse axpy: bit-identical to scalar.
// On aarch64 it also checks that the NEON table overrides every entry the x86 tables have (a scalar
// fallback there would pass the comparisons silently).
// Prints one line per failed check and a closing "N passed, M failed"; exits 1 on any failure.
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "optiml/common.h"
#include "optiml/cpu_features.h"
#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/quant.h"
#include "optiml/sparse.h"

using namespace optiml;

#if defined(OPTIML_ARM)
namespace optiml {
void fill_kernels_neon_dotprod(KernelTable& table);  // native/src/cpu/kernels/kernels_dotprod_neon.cpp
}
#endif

namespace {

int g_passed = 0, g_failed = 0;
bool g_verbose = false;

// One named check: record() its first problem, then finish() counts it once.
struct Check {
    std::string name;
    std::string problem;
    explicit Check(const char* fmt, ...) {
        char buf[256];
        va_list ap;
        va_start(ap, fmt);
        std::vsnprintf(buf, sizeof(buf), fmt, ap);
        va_end(ap);
        name = buf;
    }
    void fail(const char* fmt, ...) {
        if (!problem.empty()) return;
        char buf[512];
        va_list ap;
        va_start(ap, fmt);
        std::vsnprintf(buf, sizeof(buf), fmt, ap);
        va_end(ap);
        problem = buf;
    }
    ~Check() {
        if (problem.empty()) {
            g_passed++;
            if (g_verbose) std::printf("ok   %s\n", name.c_str());
        } else {
            g_failed++;
            std::printf("FAIL %s: %s\n", name.c_str(), problem.c_str());
        }
    }
};

bool same_bits(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

std::mt19937_64 rng(12345);
float normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng); }
float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }  // [lo, hi]

std::vector<float> activations(int64_t n) {
    std::vector<float> x(n);
    const float scale = uniform(0.1f, 3.0f);
    for (auto& v : x) v = normal() * scale;
    return x;
}

// Offsets of the fp16 scale fields of each block format (random bytes there could be inf or NaN).
std::vector<size_t> f16_fields(int32_t type) {
    switch (type) {
        case TYPE_Q4_0: return {offsetof(block_q4_0, d)};
        case TYPE_Q4_1: return {offsetof(block_q4_1, d), offsetof(block_q4_1, m)};
        case TYPE_Q5_0: return {offsetof(block_q5_0, d)};
        case TYPE_Q5_1: return {offsetof(block_q5_1, d), offsetof(block_q5_1, m)};
        case TYPE_Q8_0: return {offsetof(block_q8_0, d)};
        case TYPE_Q2_K: return {offsetof(block_q2_K, d), offsetof(block_q2_K, dmin)};
        case TYPE_Q3_K: return {offsetof(block_q3_K, d)};
        case TYPE_Q4_K: return {offsetof(block_q4_K, d), offsetof(block_q4_K, dmin)};
        case TYPE_Q5_K: return {offsetof(block_q5_K, d), offsetof(block_q5_K, dmin)};
        case TYPE_Q6_K: return {offsetof(block_q6_K, d)};
        case TYPE_IQ4_NL: return {offsetof(block_iq4_nl, d)};
        case TYPE_IQ4_XS: return {offsetof(block_iq4_xs, d)};
        default: return {};
    }
}

// A random row of n elements of `type`: normal floats for the float types, random bytes with sane
// (+-0.005 .. 0.02) fp16 scales for the block formats.
std::vector<uint8_t> random_row(int32_t type, int64_t n) {
    std::vector<uint8_t> row(row_size(type, n));
    if (type == TYPE_F32 || type == TYPE_F16 || type == TYPE_BF16) {
        std::vector<float> x(n);
        for (auto& v : x) v = normal();
        if (type == TYPE_F32) std::memcpy(row.data(), x.data(), row.size());
        else quantize_row(type, x.data(), row.data(), n);
        return row;
    }
    for (auto& b : row) b = (uint8_t)randint(0, 255);
    const TypeTraits& tt = type_traits(type);
    if (type == TYPE_MXFP4)  // E8M0 scales 2^-9 .. 2^-1 (half-scales of the doubled table values)
        for (size_t blk = 0; blk < row.size() / tt.type_size; blk++) row[blk * tt.type_size] = (uint8_t)randint(119, 126);
    for (size_t blk = 0; blk < row.size() / tt.type_size; blk++)
        for (size_t off : f16_fields(type)) {
            const fp16_t h = fp32_to_fp16(uniform(0.5f, 2.0f) * 1e-2f * (randint(0, 1) ? 1.0f : -1.0f));
            std::memcpy(row.data() + blk * tt.type_size + off, &h, 2);
        }
    return row;
}

// float64 dot of the dequantized operands; *mag = sum of the terms' magnitudes. For Q4_1/Q5_1 the
// kernels use the stored fp16 s = d * sum(q) of each Q8_1 block, so the min term m * (s - d*sum q)
// is added (and counted in *mag).
double reference_dot(int32_t wtype, const uint8_t* w, const uint8_t* xq, int64_t n, double* mag) {
    const int32_t xtype = type_traits(wtype).vec_dot_type;
    std::vector<float> wf(n), xf(n);
    dequantize_row(wtype, w, wf.data(), n);
    dequantize_row(xtype, xq, xf.data(), n);
    double sum = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        sum += (double)wf[i] * xf[i];
        m += std::fabs((double)wf[i] * xf[i]);
    }
    if (xtype == TYPE_Q8_1) {
        const size_t wsize = type_traits(wtype).type_size;
        for (int64_t b = 0; b < n / 32; b++) {
            fp16_t mh;
            std::memcpy(&mh, w + b * wsize + 2, 2);  // Q4_1/Q5_1: d, then m
            const block_q8_1& xb = ((const block_q8_1*)xq)[b];
            double exact = 0;
            for (int j = 0; j < 32; j++) exact += (double)xf[32 * b + j];
            const double t = (double)fp16_to_fp32(mh) * ((double)fp16_to_fp32(xb.s) - exact);
            sum += t;
            m += std::fabs((double)fp16_to_fp32(mh) * fp16_to_fp32(xb.s));
        }
    }
    *mag = m;
    return sum;
}

const int32_t kWeightTypes[] = {TYPE_F32,  TYPE_F16,   TYPE_BF16, TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0,
                                TYPE_Q5_1, TYPE_Q8_0,  TYPE_MXFP4, TYPE_IQ4_NL, TYPE_Q2_K, TYPE_Q3_K,
                                TYPE_Q4_K, TYPE_Q5_K,  TYPE_Q6_K, TYPE_IQ4_XS};

std::vector<int64_t> lengths_for(int32_t wtype) {
    const TypeTraits& wt = type_traits(wtype);
    const int64_t bs = std::max(wt.block_size, type_traits(wt.vec_dot_type).block_size);
    if (bs == 1) return {1, 7, 32, 33, 100, 4096, 4103};
    if (bs == 32) return {32, 64, 96, 352, 4096};
    return {256, 512, 2816};
}

// An activation row of n elements converted (by the scalar table) to wtype's vec_dot_type.
std::vector<uint8_t> converted(const KernelTable& ref, int32_t wtype, const std::vector<float>& x) {
    const int32_t xtype = type_traits(wtype).vec_dot_type;
    std::vector<uint8_t> xq(row_size(xtype, (int64_t)x.size()));
    ref.from_float[xtype](x.data(), xq.data(), (int64_t)x.size());
    return xq;
}

void test_vec_dot(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t wtype : kWeightTypes) {
        if (!t.vec_dot[wtype]) continue;
        for (int64_t n : lengths_for(wtype)) {
            Check c("%s vec_dot %s n=%" PRId64, lv, type_traits(wtype).name, n);
            for (int rep = 0; rep < 3; rep++) {
                const std::vector<uint8_t> w = random_row(wtype, n);
                const std::vector<uint8_t> xq = converted(ref, wtype, activations(n));
                float got, want;
                t.vec_dot[wtype](n, &got, w.data(), xq.data());
                ref.vec_dot[wtype](n, &want, w.data(), xq.data());
                double mag;
                const double exact = reference_dot(wtype, w.data(), xq.data(), n, &mag);
                const double bound = 2e-5 * mag + 1e-6;
                if (!(std::fabs((double)got - want) <= bound))
                    c.fail("got %.9g, scalar %.9g (bound %.3g)", got, want, bound);
                if (!(std::fabs((double)got - exact) <= bound))
                    c.fail("got %.9g, float64 %.9g (bound %.3g)", got, exact, bound);
            }
        }
    }
}

// vec_dot4 and vec_dot_rows must give vec_dot's bits for every (row, token).
void test_batched_dots(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t wtype : kWeightTypes) {
        const int32_t xtype = type_traits(wtype).vec_dot_type;
        for (int64_t n : lengths_for(wtype)) {
            const size_t x_row = row_size(xtype, n), w_row = row_size(wtype, n);
            if (t.vec_dot4[wtype]) {
                Check c("%s vec_dot4 %s n=%" PRId64, lv, type_traits(wtype).name, n);
                const size_t stride = x_row + 64;  // rows apart by more than their size
                std::vector<uint8_t> xs(4 * stride);
                for (int tk = 0; tk < 4; tk++) {
                    const std::vector<uint8_t> xq = converted(ref, wtype, activations(n));
                    std::memcpy(xs.data() + tk * stride, xq.data(), x_row);
                }
                for (int rep = 0; rep < 3; rep++) {
                    const std::vector<uint8_t> w = random_row(wtype, n);
                    float s4[4];
                    t.vec_dot4[wtype](n, s4, w.data(), xs.data(), stride);
                    for (int tk = 0; tk < 4; tk++) {
                        float s1;
                        t.vec_dot[wtype](n, &s1, w.data(), xs.data() + tk * stride);
                        if (!same_bits(s4[tk], s1)) c.fail("token %d: %.9g, vec_dot %.9g", tk, s4[tk], s1);
                    }
                }
            }
            if (t.vec_dot_rows[wtype]) {
                Check c("%s vec_dot_rows %s n=%" PRId64, lv, type_traits(wtype).name, n);
                const std::vector<uint8_t> xq = converted(ref, wtype, activations(n));
                const int pool_rows = 24;
                std::vector<uint8_t> pool(pool_rows * w_row);
                for (int r = 0; r < pool_rows; r++) {
                    const std::vector<uint8_t> w = random_row(wtype, n);
                    std::memcpy(pool.data() + r * w_row, w.data(), w_row);
                }
                for (int n_rows : {1, 3, 4, 5, 8, 13, 17}) {
                    // rows in any order, repeats allowed (the row-sparse product passes active rows)
                    std::vector<const void*> rows(n_rows + kRowsAhead);
                    for (auto& p : rows) p = pool.data() + randint(0, pool_rows - 1) * w_row;
                    std::vector<float> s(n_rows);
                    t.vec_dot_rows[wtype](n, s.data(), rows.data(), xq.data(), n_rows);
                    for (int r = 0; r < n_rows; r++) {
                        float s1;
                        t.vec_dot[wtype](n, &s1, rows[r], xq.data());
                        if (!same_bits(s[r], s1)) c.fail("n_rows=%d row %d: %.9g, vec_dot %.9g", n_rows, r, s[r], s1);
                    }
                }
            }
        }
    }
}

// Inputs for the activation conversions: random, zeros, constants, tiny, huge, many .5 ties, exact
// ties after the scale (amax 127 gives d = 1; amax 63.5 gives d = 0.5), and which sign wins when
// +max and -max are both present.
std::vector<std::vector<float>> conversion_inputs(int64_t n, bool float_type) {
    std::vector<std::vector<float>> out;
    out.push_back(activations(n));
    out.push_back(std::vector<float>(n, 0.0f));
    out.push_back(std::vector<float>(n, 0.7f));
    out.push_back(std::vector<float>(n, -3.25f));
    std::vector<float> v(n);
    for (auto& e : v) e = normal() * 1e-30f;
    out.push_back(v);
    if (float_type) {  // denormals (for the int8 types 1/d overflows and the scalar cast is undefined)
        for (auto& e : v) e = normal() * 1e-42f;
        out.push_back(v);
    }
    for (auto& e : v) e = normal() * 1e30f;
    out.push_back(v);
    for (auto& e : v) e = (float)randint(-200, 199) * 0.5f;
    out.push_back(v);
    std::vector<float> ties(n);
    for (auto& e : ties) e = (float)randint(-126, 125) + 0.5f;
    for (float mark : {127.0f, -127.0f}) {
        for (int step : {32, 256}) {
            v = ties;
            for (int64_t i = 0; i < n; i += step) v[i] = mark;
            out.push_back(v);
        }
    }
    v = ties;
    for (int64_t i = 0; i + 1 < n; i += 32) {
        v[i] = -127.0f;
        v[i + 1] = 127.0f;
    }
    out.push_back(v);
    for (auto& e : v) e = (float)randint(-60, 59) + 0.25f;
    for (int64_t i = 0; i < n; i += 32) v[i] = 63.5f;
    out.push_back(v);
    if (float_type) {  // specials: NaN (several payloads) only where the formats promise them (BF16)
        v.assign(n, 1.0f);
        const float specials[] = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                  0.0f, -0.0f, 1e-45f, -1e-40f, 3.4e38f, 1.00390625f, 1.01171875f, 65504.0f,
                                  65520.0f, 1e-8f, 5.96e-8f, 2.98e-8f};
        for (int64_t i = 0; i < n; i++) v[i] = specials[i % (sizeof(specials) / sizeof(specials[0]))];
        out.push_back(v);
    }
    return out;
}

void test_from_float(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t xtype : {TYPE_Q8_0, TYPE_Q8_1, TYPE_Q8_K, TYPE_F16, TYPE_BF16, TYPE_F32}) {
        if (!t.from_float[xtype]) continue;
        const bool float_type = xtype == TYPE_F16 || xtype == TYPE_BF16 || xtype == TYPE_F32;
        std::vector<int64_t> sizes = xtype == TYPE_Q8_K ? std::vector<int64_t>{256, 512, 4096}
                                                        : std::vector<int64_t>{32, 64, 256, 4096};
        if (float_type) sizes.insert(sizes.end(), {1, 7, 33, 1001});
        for (int64_t n : sizes) {
            Check c("%s from_float %s n=%" PRId64, lv, type_traits(xtype).name, n);
            auto inputs = conversion_inputs(n, float_type);
            if (xtype == TYPE_BF16 || xtype == TYPE_F32) {  // NaNs with payloads
                std::vector<float> v(n, 2.0f);
                const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7FC00001u, 0x7F800001u, 0xFF812345u};
                for (int64_t i = 0; i < n; i += 3) v[i] = fp32_from_bits(nans[(i / 3) % 5]);
                inputs.push_back(v);
            }
            for (size_t k = 0; k < inputs.size(); k++) {
                const size_t bytes = row_size(xtype, n);
                std::vector<uint8_t> got(bytes, 0xAA), want(bytes, 0x55);
                t.from_float[xtype](inputs[k].data(), got.data(), n);
                ref.from_float[xtype](inputs[k].data(), want.data(), n);
                if (got != want) {
                    size_t at = 0;
                    while (got[at] == want[at]) at++;
                    c.fail("input set %zu: first differing byte %zu (got 0x%02x, scalar 0x%02x)", k, at, got[at],
                           want[at]);
                }
            }
        }
    }
}

void test_attn_dot(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t type : {TYPE_F32, TYPE_F16}) {
        if (!t.attn_dot[type]) continue;
        for (int64_t n : {1, 7, 16, 33, 64, 100, 128, 256}) {
            Check c("%s attn_dot %s n=%" PRId64, lv, type_traits(type).name, n);
            for (int rep = 0; rep < 5; rep++) {
                const std::vector<uint8_t> a = random_row(type, n), b = random_row(type, n);
                float got, want;
                t.attn_dot[type](n, &got, a.data(), b.data());
                ref.attn_dot[type](n, &want, a.data(), b.data());
                std::vector<float> af(n), bf(n);
                dequantize_row(type, a.data(), af.data(), n);
                dequantize_row(type, b.data(), bf.data(), n);
                double mag = 0;
                for (int64_t i = 0; i < n; i++) mag += std::fabs((double)af[i] * bf[i]);
                const double bound = 2e-5 * mag + 1e-6;
                if (!(std::fabs((double)got - want) <= bound)) c.fail("got %.9g, scalar %.9g", got, want);
            }
        }
    }
}

// attn_dot_rows: every row the same bits as attn_dot on it alone (a token's attention must not
// depend on how many rows a kernel takes at once), for row counts around the kernels' group sizes
// and rows with gaps between them (the stride of the V and K caches).
void test_attn_dot_rows(const KernelTable& t) {
    const char* lv = simd_level_name(t.level);
    for (int32_t type : {TYPE_F32, TYPE_F16}) {
        if (!t.attn_dot_rows[type]) continue;
        const size_t elem = type_traits(type).type_size;
        for (int64_t n : {1, 16, 33, 64, 96, 100, 160, 256}) {
            for (int64_t n_rows : {1, 2, 3, 4, 5, 7, 8, 17, 64}) {
                Check c("%s attn_dot_rows %s n=%" PRId64 " rows=%" PRId64, lv, type_traits(type).name, n, n_rows);
                const int64_t row_len = n + 13;  // elements between row starts
                const std::vector<uint8_t> rows = random_row(type, row_len * n_rows), y = random_row(type, n);
                std::vector<float> got(n_rows);
                t.attn_dot_rows[type](n, got.data(), rows.data(), row_len * elem, y.data(), n_rows);
                for (int64_t r = 0; r < n_rows; r++) {
                    float want;
                    t.attn_dot[type](n, &want, rows.data() + r * row_len * elem, y.data());
                    if (std::memcmp(&got[r], &want, 4) != 0) c.fail("row %" PRId64 ": %.9g, alone %.9g", r, got[r], want);
                }
            }
        }
    }
}

bool close_rel(float got, float want, double rel, double abs_tol) {
    if (std::isnan(want)) return std::isnan(got);
    if (std::isinf(want)) return got == want;
    return std::fabs((double)got - want) <= rel * std::fabs((double)want) + abs_tol;
}

void test_softmax(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int64_t n : {1, 5, 8, 37, 256, 1000}) {
        Check c("%s softmax_exp n=%" PRId64, lv, n);
        for (int rep = 0; rep < 4; rep++) {
            std::vector<float> x(n);
            // spans: ordinary scores, then down to the underflow range where the exp takes its
            // two-factor path (x - max below about -87), and -inf (masked positions)
            const float spread = rep == 0 ? 5.0f : rep == 1 ? 30.0f : 120.0f;
            for (auto& v : x) v = uniform(-spread, 0.0f);
            if (rep == 3)
                for (int64_t i = 0; i < n; i += 7) x[i] = -std::numeric_limits<float>::infinity();
            const float max = rep == 2 ? 0.0f : 1.5f;
            std::vector<float> y(n), yr(n);
            const double sum = t.softmax_exp(n, y.data(), x.data(), max);
            const double sr = ref.softmax_exp(n, yr.data(), x.data(), max);
            for (int64_t i = 0; i < n; i++)
                if (!close_rel(y[i], yr[i], 3e-7, 1e-37))
                    c.fail("x=%.9g: %.9g, scalar %.9g", x[i], y[i], yr[i]);
            if (!(std::fabs(sum - sr) <= 1e-6 * std::fabs(sr) + 1e-30)) c.fail("sum %.12g, scalar %.12g", sum, sr);
        }
    }
}

void test_act_mul(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    struct Act {
        const char* name;
        act_mul_fn fn, rfn;
        bool exact;
    } acts[] = {{"silu_mul", t.silu_mul, ref.silu_mul, false},
                {"relu_mul", t.relu_mul, ref.relu_mul, true},
                {"gelu_mul", t.gelu_mul, ref.gelu_mul, true},
                {"gelu_exact_mul", t.gelu_exact_mul, ref.gelu_exact_mul, false}};
    for (const Act& a : acts) {
        if (!a.fn) continue;
        for (int64_t n : {1, 3, 4, 9, 64, 1003}) {
            Check c("%s %s n=%" PRId64, lv, a.name, n);
            for (int rep = 0; rep < 3; rep++) {
                std::vector<float> g(n), u(n);
                const float scale = rep == 0 ? 1.0f : rep == 1 ? 4.0f : 30.0f;
                for (auto& v : g) v = normal() * scale;
                for (auto& v : u) v = normal();
                // the table GELU's edges, exact halfway f16 values, and exp overflow for silu
                const float edges[] = {-10.0f, 10.0f, -9.999f, 9.999f, -10.001f, 10.001f, 0.0f, -0.0f,
                                       1.00048828125f, -2.00097656f, 100.0f, -100.0f};
                for (size_t k = 0; k < sizeof(edges) / sizeof(edges[0]) && (int64_t)k * 2 < n; k++)
                    g[2 * k] = edges[k];
                std::vector<float> gr = g;
                a.fn(n, g.data(), u.data());
                a.rfn(n, gr.data(), u.data());
                for (int64_t i = 0; i < n; i++) {
                    const bool ok = a.exact ? same_bits(g[i], gr[i]) : close_rel(g[i], gr[i], 1e-6, 1e-30);
                    if (!ok) c.fail("i=%" PRId64 ": %.9g, scalar %.9g", i, g[i], gr[i]);
                }
            }
        }
    }
}

// Sparse axpy: y[r] += sum_i a[i] * w_i[r] over rows at a byte offset, bit-identical to scalar.
void test_axpy(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t type : {TYPE_F32, TYPE_F16, TYPE_Q8_0}) {
        if (!t.axpy[type]) continue;
        const int64_t dim = 320;
        const int n_neurons = 16;
        std::vector<std::vector<uint8_t>> rows;
        for (int r = 0; r < n_neurons; r++) rows.push_back(random_row(type, dim));
        const std::vector<int64_t> ns = type == TYPE_Q8_0 ? std::vector<int64_t>{32, 64, 96, 160, 288}
                                                          : std::vector<int64_t>{32, 64, 96, 160, 37, 5, 1};
        for (int64_t n : ns) {
            Check c("%s axpy %s n=%" PRId64, lv, type_traits(type).name, n);
            for (int k : {0, 1, 2, 3, 4, 5, 9, 16}) {
                std::vector<const void*> w(k);
                std::vector<float> a(k);
                for (int i = 0; i < k; i++) {
                    w[i] = rows[randint(0, n_neurons - 1)].data();
                    a[i] = normal();
                }
                const int64_t first = (dim - n) / 64 * 32;  // a whole-block offset, first + n <= dim
                const size_t off = row_size(type, first);
                std::vector<float> y(n), yr(n);
                for (int64_t r = 0; r < n; r++) y[r] = yr[r] = normal();
                t.axpy[type](n, y.data(), w.data(), off, a.data(), k);
                ref.axpy[type](n, yr.data(), w.data(), off, a.data(), k);
                for (int64_t r = 0; r < n; r++)
                    if (!same_bits(y[r], yr[r])) c.fail("k=%d r=%" PRId64 ": %.9g, scalar %.9g", k, r, y[r], yr[r]);
            }
        }
    }
}

// Grouped rows (the lossless 4-bit copy of a Q4_0/Q4_1/Q4_K down): one group's codes summed with int8
// coefficients in integers, then scaled, bit-identical to scalar.
void test_axpy_group(const KernelTable& t, const KernelTable& ref) {
    const char* lv = simd_level_name(t.level);
    for (int32_t type : {TYPE_Q4_0, TYPE_Q4_1, TYPE_Q4_K}) {
        if (!t.axpy_group[type]) continue;
        const int64_t dim = 320;
        const int n_neurons = 16;
        std::vector<std::vector<uint8_t>> rows;
        for (int r = 0; r < n_neurons; r++) {
            rows.emplace_back(dim / 2);
            for (uint8_t& b : rows.back()) b = (uint8_t)randint(0, 255);
        }
        // Scales as the kernel of this type reads them: fp16 for Q4_0/Q4_1, float for Q4_K.
        const size_t ss = grouped_scale_size(type);
        std::vector<uint8_t> d(dim * ss), m(dim * ss);
        for (int64_t r = 0; r < dim; r++) {
            const float dv = 0.01f * normal(), mv = 0.05f * normal();
            if (ss == 2) {
                const fp16_t dh = fp32_to_fp16(dv), mh = fp32_to_fp16(mv);
                std::memcpy(&d[r * 2], &dh, 2);
                std::memcpy(&m[r * 2], &mh, 2);
            } else {
                std::memcpy(&d[r * 4], &dv, 4);
                std::memcpy(&m[r * 4], &mv, 4);
            }
        }
        for (int64_t n : {32, 64, 96, 160, 288}) {
            Check c("%s axpy_group %s n=%" PRId64, lv, type_traits(type).name, n);
            // k past 16 and 32: the int16 sums are widened every 16 rows (AVX2: 8 pairs); 40 repeats rows.
            for (int k : {0, 1, 2, 3, 5, 9, 16, 17, 31, 32, 40}) {
                std::vector<const void*> w(k);
                std::vector<int8_t> q(k);
                int32_t q_sum = 0;
                for (int i = 0; i < k; i++) {
                    w[i] = rows[randint(0, n_neurons - 1)].data();
                    // The extremes (+-127, the largest int16 partial sums) in every other list.
                    q[i] = (int8_t)(k % 2 ? (i % 2 ? -127 : 127) : randint(-127, 127));
                    q_sum += q[i];
                }
                const float s = 0.02f * std::fabs(normal()) + 1e-4f;
                const int64_t first = (dim - n) / 64 * 32;  // whole 32-dimension chunks, first + n <= dim
                std::vector<float> y(n), yr(n);
                for (int64_t r = 0; r < n; r++) y[r] = yr[r] = normal();
                const uint8_t* ds = d.data() + first * ss;
                const uint8_t* ms = m.data() + first * ss;
                // The group as one call, and as the second of three (the others: its first and last rows,
                // other scales): a level may keep y in registers across groups.
                GroupTerms one = {w.data(), q.data(), k, q_sum, s, ds, ms};
                t.axpy_group[type](n, y.data(), first / 2, &one, 1);
                ref.axpy_group[type](n, yr.data(), first / 2, &one, 1);
                for (int64_t r = 0; r < n; r++)
                    if (!same_bits(y[r], yr[r])) c.fail("k=%d r=%" PRId64 ": %.9g, scalar %.9g", k, r, y[r], yr[r]);
                const int8_t q3[2] = {-127, 55};
                const int64_t k3 = k < 2 ? k : 2;
                GroupTerms three[3] = {{w.data(), q3, k3, q3[0] + (k3 > 1 ? q3[1] : 0), 0.5f * s, ms, ds},
                                       one,
                                       {w.data() + k - k3, q3, k3, q3[0] + (k3 > 1 ? q3[1] : 0), 2.0f * s, ms, ds}};
                t.axpy_group[type](n, y.data(), first / 2, three, 3);
                ref.axpy_group[type](n, yr.data(), first / 2, three, 3);
                for (int64_t r = 0; r < n; r++)
                    if (!same_bits(y[r], yr[r])) c.fail("k=%d r=%" PRId64 ": %.9g, scalar %.9g", k, r, y[r], yr[r]);
            }
        }
    }
}

#if defined(OPTIML_ARM)
// Every entry the x86 tables implement must be NEON's own, not the scalar fallback.
void test_neon_coverage(const KernelTable& t, const KernelTable& ref) {
    Check c("neon table coverage");
    auto need = [&](const void* mine, const void* scalar, const char* what) {
        if (!mine || mine == scalar) c.fail("%s falls back to scalar", what);
    };
    for (int32_t wtype : kWeightTypes)
        need((const void*)t.vec_dot[wtype], (const void*)ref.vec_dot[wtype], type_traits(wtype).name);
    for (int32_t wtype : {TYPE_Q4_0, TYPE_Q4_1, TYPE_Q5_0, TYPE_Q5_1, TYPE_Q8_0, TYPE_MXFP4, TYPE_IQ4_NL}) {
        need((const void*)t.vec_dot4[wtype], (const void*)ref.vec_dot4[wtype], "vec_dot4");
        need((const void*)t.vec_dot_rows[wtype], (const void*)ref.vec_dot_rows[wtype], "vec_dot_rows");
    }
    for (int32_t xtype : {TYPE_Q8_0, TYPE_Q8_1, TYPE_Q8_K, TYPE_F16, TYPE_BF16})
        need((const void*)t.from_float[xtype], (const void*)ref.from_float[xtype], "from_float");
    need((const void*)t.attn_dot[TYPE_F32], (const void*)ref.attn_dot[TYPE_F32], "attn_dot F32");
    need((const void*)t.attn_dot[TYPE_F16], (const void*)ref.attn_dot[TYPE_F16], "attn_dot F16");
    need((const void*)t.softmax_exp, (const void*)ref.softmax_exp, "softmax_exp");
    need((const void*)t.silu_mul, (const void*)ref.silu_mul, "silu_mul");
    need((const void*)t.relu_mul, (const void*)ref.relu_mul, "relu_mul");
    need((const void*)t.gelu_mul, (const void*)ref.gelu_mul, "gelu_mul");
    for (int32_t type : {TYPE_F32, TYPE_F16, TYPE_Q8_0})
        need((const void*)t.axpy[type], (const void*)ref.axpy[type], "axpy");
    for (int32_t type : {TYPE_Q4_0, TYPE_Q4_1, TYPE_Q4_K})
        need((const void*)t.axpy_group[type], (const void*)ref.axpy_group[type], "axpy_group");
}

// The dot-product build of the kernels (kernels_dotprod_neon.cpp) is used exactly when the CPU has
// the instructions (or the whole build targets them).
void test_neon_dotprod_choice(const KernelTable& t) {
    KernelTable dp;
    std::memset(&dp, 0, sizeof(dp));
    fill_kernels_neon_dotprod(dp);  // only fills pointers: safe on any CPU
    const bool uses = t.vec_dot[TYPE_Q4_0] == dp.vec_dot[TYPE_Q4_0];
#if defined(__ARM_FEATURE_DOTPROD)
    const bool want = true;  // the baseline file itself is built for dotprod then
#else
    const bool want = cpu_features().neon_dotprod;
#endif
    Check c("neon dotprod kernels chosen when the cpu has dotprod");
    std::printf("neon kernels in use: %s\n", uses ? "dotprod build" : "baseline build (widening multiplies)");
    if (uses != want) c.fail("cpu neon_dotprod=%d but the %s build is in use", (int)cpu_features().neon_dotprod,
                             uses ? "dotprod" : "baseline");
}
#endif

}  // namespace

int main(int argc, char** argv) {
    std::vector<SimdLevel> levels;
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "-v") == 0) {
            g_verbose = true;
            continue;
        }
        bool found = false;
        for (int l = 1; l < SIMD_LEVEL_COUNT; l++)
            if (std::strcmp(argv[i], simd_level_name((SimdLevel)l)) == 0) {
                levels.push_back((SimdLevel)l);
                found = true;
            }
        if (!found) {
            std::fprintf(stderr, "usage: %s [-v] [avx2|avx512|neon ...]  (default: every available level)\n", argv[0]);
            return 2;
        }
    }
    if (levels.empty())
        for (int l = 1; l < SIMD_LEVEL_COUNT; l++)
            if (simd_level_available((SimdLevel)l)) levels.push_back((SimdLevel)l);

#if defined(__ARM_FEATURE_DOTPROD)
    const char* build = "aarch64 with dotprod";
#elif defined(__aarch64__)
    const char* build = "aarch64 baseline (armv8-a)";
#else
    const char* build = "x86";
#endif
    std::printf("test_kernels: build %s; cpu neon=%d neon_dotprod=%d avx2=%d avx512f=%d\n", build,
                (int)cpu_features().neon, (int)cpu_features().neon_dotprod, (int)cpu_features().avx2,
                (int)cpu_features().avx512f);
    if (levels.empty()) {
        std::printf("FAIL no SIMD level is available in this build on this CPU\n0 passed, 1 failed\n");
        return 1;
    }
    const KernelTable& ref = kernel_table(SIMD_SCALAR);
    for (SimdLevel level : levels) {
        if (!simd_level_available(level)) {
            Check c("%s available", simd_level_name(level));
            c.fail("level not available in this build or on this CPU");
            continue;
        }
        const KernelTable& t = kernel_table(level);
#if defined(OPTIML_ARM)
        if (level == SIMD_NEON) {
            test_neon_coverage(t, ref);
            test_neon_dotprod_choice(t);
        }
#endif
        test_vec_dot(t, ref);
        test_batched_dots(t, ref);
        test_from_float(t, ref);
        test_attn_dot(t, ref);
        test_attn_dot_rows(t);
        test_softmax(t, ref);
        test_act_mul(t, ref);
        test_axpy(t, ref);
        test_axpy_group(t, ref);
    }
    std::printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
