// Token sampling (see optiml/sampling.h for the chain and its definitions).
//
// Cost per call for a vocabulary of n: one O(n) copy, O(window) penalties, one O(n) pass that drops
// -inf and validates, then top-k by heap selection (about one compare per token for small k). Without
// top-k, min-p filters in O(n) first and top-p sorts only as long a prefix of what is left as its
// cumulative probability needs (doubling chunks). Never a full sort of the vocabulary unless top-p
// alone (min-p and top-k off) needs it on a very flat distribution. Measured on one core, n = 256k:
// defaults ~0.8 ms, greedy ~0.5 ms. All buffers are members, sized once: no allocation per call.
#include "optiml/sampling.h"

#include <algorithm>
#include <cmath>

#include "optiml/common.h"

namespace optiml {

namespace {

// Best first: higher logit, then lower id. A strict total order, so nth_element / sort / partial_sort
// give the same result on every standard library (reproducible draws need that).
struct Better {
    template <typename C>
    bool operator()(const C& a, const C& b) const {
        return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
    }
};

bool finite(float x) { return std::isfinite(x); }

// A temperature so small that 1/T overflows would make (logit - max) / T = 0 * inf = NaN for the max;
// it means "greedy" anyway.
bool is_greedy(const SamplingParams& p) { return p.temperature <= 0.0f || !std::isfinite(1.0f / p.temperature); }

}  // namespace

void validate_sampling_params(const SamplingParams& p, int32_t n_vocab) {
    if (n_vocab <= 0) throw ArgumentError(format("n_vocab must be > 0, got %d", n_vocab));
    if (!finite(p.temperature))
        throw ArgumentError(format("temperature must be a finite number (<= 0 for greedy), got %g", p.temperature));
    if (!(p.top_p >= 0.0f) || std::isnan(p.top_p))
        throw ArgumentError(format("top_p must be >= 0 (0 keeps the likeliest token alone, >= 1 turns it off), got %g",
                                   p.top_p));
    if (!(p.min_p <= 1.0f) || std::isnan(p.min_p))
        throw ArgumentError(format("min_p must be <= 1 (<= 0 turns it off), got %g", p.min_p));
    if (!finite(p.repeat_penalty) || !(p.repeat_penalty > 0.0f))
        throw ArgumentError(format("repeat_penalty must be a finite number > 0 (1 turns it off), got %g",
                                   p.repeat_penalty));
    if (p.repeat_last_n < -1)
        throw ArgumentError(format("repeat_last_n must be >= -1 (-1: whole history, 0: off), got %d",
                                   p.repeat_last_n));
    if (!finite(p.frequency_penalty))
        throw ArgumentError(format("frequency_penalty must be finite, got %g", p.frequency_penalty));
    if (!finite(p.presence_penalty))
        throw ArgumentError(format("presence_penalty must be finite, got %g", p.presence_penalty));
}

Sampler::Sampler(const SamplingParams& p, int32_t n_vocab) : params_(p), n_vocab_(n_vocab) {
    validate_sampling_params(p, n_vocab);
    cand_.resize((size_t)n_vocab);
    weight_.resize((size_t)n_vocab);
    if (p.repeat_last_n != 0) {
        counts_.assign((size_t)n_vocab, 0);
        if (p.repeat_last_n > 0) ring_.reserve((size_t)p.repeat_last_n);
    }
    reseed();
}

void Sampler::reseed() {
    seed_ = params_.seed;
    if (seed_ == SAMPLING_RANDOM_SEED) {
        std::random_device rd;
        seed_ = ((uint64_t)rd() << 32) ^ (uint64_t)rd();
    }
    rng_.seed(seed_);
}

void Sampler::reset() {
    ring_.clear();
    ring_head_ = 0;
    std::fill(counts_.begin(), counts_.end(), 0);
    reseed();
}

// 53 random bits -> a double in [0, 1); exact, and the same on every platform.
double Sampler::uniform01() { return (double)(rng_() >> 11) * 0x1.0p-53; }

void Sampler::accept(int32_t token) {
    if (token < 0 || token >= n_vocab_)
        throw ArgumentError(format("token %d is out of range for a vocabulary of %d", token, n_vocab_));
    const int32_t n = params_.repeat_last_n;
    if (n == 0) return;
    if (n < 0 || ring_.size() < (size_t)n) {
        ring_.push_back(token);
    } else {
        counts_[(size_t)ring_[ring_head_]]--;  // the oldest token leaves the window
        ring_[ring_head_] = token;
        ring_head_ = (ring_head_ + 1) % (size_t)n;
    }
    counts_[(size_t)token]++;
}

std::vector<int32_t> Sampler::penalty_window() const {
    std::vector<int32_t> out;
    out.reserve(ring_.size());
    for (size_t i = 0; i < ring_.size(); i++) out.push_back(ring_[(ring_head_ + i) % ring_.size()]);
    return out;
}

// cand_ is still in id order here (cand_[t].id == t), so a token's logit is found by index.
void Sampler::apply_penalties() {
    const SamplingParams& p = params_;
    if (ring_.empty()) return;
    if (p.repeat_penalty == 1.0f && p.frequency_penalty == 0.0f && p.presence_penalty == 0.0f) return;
    // Once per distinct token: its count is negated while visited, then restored.
    for (int32_t t : ring_) {
        const int32_t c = counts_[(size_t)t];
        if (c <= 0) continue;
        float& l = cand_[(size_t)t].logit;
        l = l > 0.0f ? l / p.repeat_penalty : l * p.repeat_penalty;
        l -= (float)c * p.frequency_penalty + p.presence_penalty;
        counts_[(size_t)t] = -c;
    }
    for (int32_t t : ring_) counts_[(size_t)t] = std::abs(counts_[(size_t)t]);
}

void Sampler::drop_neg_inf_and_check() {
    size_t n = 0;
    float mx = -INFINITY;
    for (size_t i = 0; i < (size_t)n_vocab_; i++) {
        const Candidate c = cand_[i];
        if (c.logit == -INFINITY) continue;
        if (!finite(c.logit))
            throw ArgumentError(format("logit of token %d is %s%s; logits must be finite or -inf", c.id,
                                       std::isnan(c.logit) ? "NaN" : "+inf",
                                       ring_.empty() ? "" : " (after penalties)"));
        mx = std::max(mx, c.logit);
        cand_[n++] = c;
    }
    if (n == 0) throw ArgumentError("every logit is -inf: no token can be sampled");
    n_cand_ = n;
    n_sorted_ = 0;
    max_logit_ = mx;
}

void Sampler::sort_prefix(size_t m) {
    m = std::min(m, n_cand_);
    if (m <= n_sorted_) return;
    Candidate* b = cand_.data();
    const size_t want = m - n_sorted_, rest = n_cand_ - n_sorted_;
    if (want * 16 <= rest) {
        // Few out of many (top-k = 40 of 256k): heap selection is one compare per candidate, as nearly
        // all of them lose against the heap's worst. ~5x faster than nth_element here.
        std::partial_sort(b + n_sorted_, b + m, b + n_cand_, Better());
    } else {
        if (m < n_cand_) std::nth_element(b + n_sorted_, b + m, b + n_cand_, Better());
        std::sort(b + n_sorted_, b + m, Better());
    }
    n_sorted_ = m;
}

void Sampler::top_k(int32_t k) {
    if (k <= 0 || (size_t)k >= n_cand_) return;
    sort_prefix((size_t)k);
    n_cand_ = (size_t)k;
}

double Sampler::mass() const {
    double total = 0;
    for (size_t i = 0; i < n_cand_; i++) total += std::exp(cand_[i].logit - max_logit_);
    return total;
}

// `total` is the mass of the candidates top-k left, measured before min-p ran (see prepare()).
void Sampler::top_p(float p, double total) {
    if (p >= 1.0f) return;
    const float mx = max_logit_;
    const double target = (double)p * total;
    double cum = 0;
    for (size_t i = 0; i < n_cand_; i++) {
        if (i == n_sorted_) sort_prefix(std::max<size_t>(64, 2 * n_sorted_));
        cum += std::exp(cand_[i].logit - mx);
        if (cum >= target) {
            n_cand_ = i + 1;
            return;
        }
    }
    // The survivors of min-p hold less than top_p of the mass: top-p would keep all of them (or
    // rounding left cum just below target).
}

void Sampler::min_p(float p) {
    if (p <= 0.0f) return;
    // p_i >= p * p_max  <=>  logit_i - max_logit >= log(p); the max always survives.
    const double min_delta = std::log((double)p);
    auto keep = [&](const Candidate& c) { return (double)c.logit - (double)max_logit_ >= min_delta; };
    size_t n = 0, sorted_kept = 0;
    for (size_t i = 0; i < n_cand_; i++) {
        if (!keep(cand_[i])) continue;
        if (i < n_sorted_) sorted_kept++;
        cand_[n++] = cand_[i];
    }
    // Survivors of the sorted prefix are a prefix of it, and compaction keeps their order.
    n_cand_ = n;
    n_sorted_ = sorted_kept;
}

// Greedy with no penalty to apply: one pass over the logits, the same answer and errors as the full
// chain (first maximum in id order; NaN or +inf rejected) without copying the vocabulary into
// candidates, which costs more than the argmax itself at a 150k-token vocabulary.
bool Sampler::prepare_greedy(const float* logits) {
    const SamplingParams& p = params_;
    if (!is_greedy(p)) return false;
    if (!ring_.empty() && (p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f))
        return false;
    int32_t best = -1;
    float mx = -INFINITY;
    for (int32_t i = 0; i < n_vocab_; i++) {
        const float l = logits[i];
        if (l > mx) {
            mx = l;
            best = i;
        } else if (std::isnan(l)) {
            return false;  // the full chain says which token and why
        }
    }
    if (best < 0 || !finite(mx)) return false;  // every logit -inf, or a +inf: the full chain's errors
    cand_[0] = Candidate{mx, best};
    n_cand_ = n_sorted_ = 1;
    max_logit_ = mx;
    weight_[0] = 1.0f;
    weight_sum_ = 1.0;
    return true;
}

void Sampler::prepare(const float* logits) {
    if (!logits) throw ArgumentError("logits is a null pointer");
    if (prepare_greedy(logits)) return;
    Candidate* c = cand_.data();
    for (int32_t i = 0; i < n_vocab_; i++) c[i] = Candidate{logits[i], i};
    apply_penalties();
    drop_neg_inf_and_check();

    const SamplingParams& p = params_;
    if (is_greedy(p)) {
        // Greedy: first maximum in id order (cand_ is still in id order) = lowest id among ties.
        size_t best = 0;
        for (size_t i = 1; i < n_cand_; i++)
            if (cand_[i].logit > cand_[best].logit) best = i;
        cand_[0] = cand_[best];
        n_cand_ = n_sorted_ = 1;
        weight_[0] = 1.0f;
        weight_sum_ = 1.0;
        return;
    }
    top_k(p.top_k);
    // llama.cpp runs top-p, then min-p. Both keep a best-first prefix, so the result is the shorter of
    // the two prefixes; min-p is a cheap O(n) filter that needs no sort, so it runs first and top-p
    // then sorts only min-p's survivors. top-p's threshold still refers to the mass before min-p.
    const double total = p.top_p < 1.0f ? mass() : 0.0;
    min_p(p.min_p);
    top_p(p.top_p, total);

    const float mx = max_logit_, inv_t = 1.0f / p.temperature;
    double sum = 0;
    for (size_t i = 0; i < n_cand_; i++) {
        weight_[i] = std::exp((cand_[i].logit - mx) * inv_t);
        sum += weight_[i];
    }
    weight_sum_ = sum;  // >= 1: the max logit's weight is exp(0)
}

int32_t Sampler::sample(const float* logits) {
    prepare(logits);
    if (n_cand_ == 1) return cand_[0].id;  // greedy or a single survivor: no draw, RNG untouched
    const double u = uniform01() * weight_sum_;
    double cum = 0;
    size_t last_positive = 0;
    for (size_t i = 0; i < n_cand_; i++) {
        if (weight_[i] <= 0.0f) continue;
        cum += weight_[i];
        last_positive = i;
        if (u < cum) return cand_[i].id;
    }
    return cand_[last_positive].id;  // u landed in the rounding gap at the very top
}

void Sampler::probs(const float* logits, std::vector<int32_t>& ids, std::vector<double>& probs) {
    prepare(logits);
    // Order the survivors best first (only here: sample() never needs the full order).
    const size_t n = n_cand_;
    if (n_sorted_ < n) {
        sort_prefix(n);
        const float mx = max_logit_, inv_t = 1.0f / params_.temperature;  // not greedy: n_sorted_ would be 1
        for (size_t i = 0; i < n; i++)
            weight_[i] = std::exp((cand_[i].logit - mx) * inv_t);
    }
    ids.resize(n);
    probs.resize(n);
    for (size_t i = 0; i < n; i++) {
        ids[i] = cand_[i].id;
        probs[i] = (double)weight_[i] / weight_sum_;
    }
}

}  // namespace optiml
