#include "optiml/recorder.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/model.h"
#include "optiml/quant.h"

namespace optiml {

int hist_bin(float v) {
    // Exponent and the top mantissa bits of |v| give the bin directly: no log per value.
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    bits &= 0x7fffffffu;
    const int e = (int)(bits >> 23) - 127;
    if (e < ActivationRecorder::kHistMinExp) return 0;
    if (e >= ActivationRecorder::kHistMaxExp) return ActivationRecorder::kHistBins - 1;
    const int sub = (int)((bits >> (23 - 3)) & 7);  // kHistPerOctave == 8
    return 1 + (e - ActivationRecorder::kHistMinExp) * ActivationRecorder::kHistPerOctave + sub;
}

std::vector<float> ActivationRecorder::hist_edges() {
    std::vector<float> e(kHistBins + 1);
    e[0] = 0.0f;
    for (int b = 1; b < kHistBins; b++) {
        const int oct = (b - 1) / kHistPerOctave, sub = (b - 1) % kHistPerOctave;
        e[b] = std::ldexp(1.0f + sub / (float)kHistPerOctave, kHistMinExp + oct);
    }
    e[kHistBins - 1] = std::ldexp(1.0f, kHistMaxExp);
    e[kHistBins] = std::numeric_limits<float>::infinity();
    return e;
}

ActivationRecorder::ActivationRecorder(const Model& model, std::vector<float> thr, int64_t every, int64_t max_s,
                                       std::vector<float> gw)
    : n_layer(model.hp.n_layer), n_ff(model.hp.n_ff), n_embd(model.hp.n_embd), thresholds(std::move(thr)),
      gate_weight(std::move(gw)), sample_every(every), max_samples(max_s) {
    if (!gate_weight.empty() && (int64_t)gate_weight.size() != (int64_t)n_layer * n_ff)
        throw ArgumentError(format("gate_weight holds %zu values, expected n_layer * n_ff = %lld", gate_weight.size(),
                                   (long long)n_layer * n_ff));
    if ((int64_t)thresholds.size() != n_layer)
        throw ArgumentError(format("%zu thresholds given for %d layers", thresholds.size(), n_layer));
    for (float t : thresholds)
        if (!(t >= 0) || !std::isfinite(t)) throw ArgumentError("thresholds must be finite and >= 0");
    if (every < 0 || max_s < 0) throw ArgumentError("sample_every and max_samples must be >= 0");
    if (every > 0 && n_ff % 8 != 0) throw ArgumentError("samples need n_ff to be a multiple of 8");
    const size_t ln = (size_t)n_layer * n_ff;
    fired.assign(ln, 0);
    sum_abs.assign(ln, 0.0);
    sum_abs_up.assign(ln, 0.0);
    down_norm.assign(ln, 0.0f);
    gate_hist.assign((size_t)n_layer * kHistBins, 0.0);
    gate_err = prod_hist = prod_err = gate_hist;
    layer_seen_.assign(n_layer, 0);
    if (model.hp.is_moe()) {
        n_expert = model.hp.n_expert;
        n_expert_used = model.hp.n_expert_used;
        n_ff_exp = model.hp.n_ff_exp;
        expert_count.assign((size_t)n_layer * n_expert, 0);
        expert_weight.assign((size_t)n_layer * n_expert, 0.0);
        expert_next.assign((size_t)n_layer * n_expert * n_expert, 0);
        expert_fired.assign((size_t)n_layer * n_expert * n_ff_exp, 0);
        last_chosen_.assign((size_t)n_layer * n_expert_used, 0);
        has_last_.assign(n_layer, 0);
    }

    // Down columns' norms: down is [n_embd rows][n_ff cols]; sum the squares of each column.
    std::vector<float> row(n_ff);
    std::vector<double> acc(n_ff);
    for (int il = 0; il < n_layer; il++) {
        const Weight& d = model.layers[il].ffn.down;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t r = 0; r < d.rows; r++) {
            d.dequantize_row_to(r, row.data());  // either layout: a dense run may have left rows16
            for (int64_t j = 0; j < n_ff; j++) acc[j] += (double)row[j] * row[j];
        }
        for (int64_t j = 0; j < n_ff; j++) down_norm[(size_t)il * n_ff + j] = (float)std::sqrt(acc[j]);
    }
}

void ActivationRecorder::record(ThreadPool& pool, int il, const float* xn, const float* a, const float* u,
                                const float* h, int32_t n) {
    const float thr = thresholds[il];
    const float* dn = down_norm.data() + (size_t)il * n_ff;
    int64_t* fired_l = fired.data() + (size_t)il * n_ff;
    double* sum_l = sum_abs.data() + (size_t)il * n_ff;
    double* sum_u = sum_abs_up.data() + (size_t)il * n_ff;
    const float* gw = gate_weight.empty() ? nullptr : gate_weight.data() + (size_t)il * n_ff;

    // Neurons split across threads; each thread keeps its own histograms, summed at the end.
    const int nth = pool.size();
    std::vector<double> hists((size_t)nth * 4 * kHistBins, 0.0);
    pool.run([&](int ith, int nth_run) {
        int64_t j0, j1;
        split_range(n_ff, ith, nth_run, &j0, &j1);
        double* gh = hists.data() + (size_t)ith * 4 * kHistBins;
        double* ge = gh + kHistBins;
        double* ph = ge + kHistBins;
        double* pe = ph + kHistBins;
        for (int64_t j = j0; j < j1; j++) {
            const double d2 = (double)dn[j] * dn[j];
            int64_t f = 0;
            double s = 0, su = 0;
            const float w = gw ? gw[j] : 1.0f;
            for (int32_t t = 0; t < n; t++) {
                const float av = a[(size_t)t * n_ff + j] * w, hv = h[(size_t)t * n_ff + j];
                su += std::fabs(u[(size_t)t * n_ff + j]);
                const float ah = std::fabs(hv);
                f += ah > thr;
                s += ah;
                const double e = (double)hv * hv * d2;
                const int bg = hist_bin(av), bp = hist_bin(hv);
                gh[bg] += 1;
                ge[bg] += e;
                ph[bp] += 1;
                pe[bp] += e;
            }
            fired_l[j] += f;
            sum_l[j] += s;
            sum_u[j] += su;
        }
    });
    for (int ith = 0; ith < nth; ith++) {
        const double* src = hists.data() + (size_t)ith * 4 * kHistBins;
        for (int b = 0; b < kHistBins; b++) {
            const size_t o = (size_t)il * kHistBins + b;
            gate_hist[o] += src[b];
            gate_err[o] += src[kHistBins + b];
            prod_hist[o] += src[2 * kHistBins + b];
            prod_err[o] += src[3 * kHistBins + b];
        }
    }

    // Samples: the same global token numbers in every layer (layers see the tokens in the same order).
    if (sample_every > 0) {
        for (int32_t t = 0; t < n; t++) {
            const int64_t g = layer_seen_[il] + t;
            if (g % sample_every != 0) continue;
            const int64_t si = g / sample_every;
            if (si >= max_samples) break;
            if (si >= n_samples) {  // first seen at layer 0: make room
                n_samples = si + 1;
                sample_x.resize((size_t)n_samples * n_layer * n_embd);
                sample_mask.resize((size_t)n_samples * n_layer * (n_ff / 8));
            }
            uint16_t* xs = sample_x.data() + ((size_t)si * n_layer + il) * n_embd;
            for (int32_t i = 0; i < n_embd; i++) xs[i] = fp32_to_fp16(xn[(size_t)t * n_embd + i]);
            uint8_t* ms = sample_mask.data() + ((size_t)si * n_layer + il) * (n_ff / 8);
            std::memset(ms, 0, n_ff / 8);
            for (int32_t j = 0; j < n_ff; j++)
                if (std::fabs(h[(size_t)t * n_ff + j]) > thr) ms[j >> 3] |= (uint8_t)(0x80 >> (j & 7));
        }
    }
    layer_seen_[il] += n;
    if (il == 0) n_tokens += n;
}

void ActivationRecorder::record_experts(int il, const int32_t* chosen, const float* weight, int32_t n, int32_t k) {
    if (k != n_expert_used || n_expert == 0)
        throw ArgumentError(format("record_experts: %d experts a token on a recorder made for %d", k, n_expert_used));
    int64_t* count = expert_count.data() + (size_t)il * n_expert;
    double* wsum = expert_weight.data() + (size_t)il * n_expert;
    int64_t* next = expert_next.data() + (size_t)il * n_expert * n_expert;
    int32_t* last = last_chosen_.data() + (size_t)il * k;
    for (int32_t t = 0; t < n; t++) {
        const int32_t* c = chosen + (size_t)t * k;
        const int32_t* prev = t > 0 ? c - k : (has_last_[il] ? last : nullptr);
        for (int32_t j = 0; j < k; j++) {
            count[c[j]]++;
            wsum[c[j]] += weight[(size_t)t * k + j];
            if (prev)
                for (int32_t i = 0; i < k; i++) next[(size_t)prev[i] * n_expert + c[j]]++;
        }
    }
    if (n > 0) {
        std::memcpy(last, chosen + (size_t)(n - 1) * k, sizeof(int32_t) * k);
        has_last_[il] = 1;
    }
    if (il == 0) n_tokens += n;
}

void ActivationRecorder::record_expert_neurons(int il, int32_t e, const float* h, int64_t rows) {
    const float thr = thresholds[il];
    int64_t* fired_e = expert_fired.data() + ((size_t)il * n_expert + e) * n_ff_exp;
    double* ph = prod_hist.data() + (size_t)il * kHistBins;
    for (int64_t r = 0; r < rows; r++)
        for (int32_t j = 0; j < n_ff_exp; j++) {
            const float v = h[r * n_ff_exp + j];
            fired_e[j] += std::fabs(v) > thr;
            ph[hist_bin(v)] += 1;
        }
}

void ActivationRecorder::new_sequence() { std::fill(has_last_.begin(), has_last_.end(), 0); }

}  // namespace optiml
