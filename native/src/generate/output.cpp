// The output stage: one sequence's row of logits -> its next token and text (see optiml/generate.h).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "optiml/common.h"
#include "optiml/generate.h"
#include "optiml/model.h"
#include "optiml/stop_strings.h"

namespace optiml {

OutputStage::OutputStage(const Tokenizer& tok, Sampler& sampler, std::vector<std::string> stops,
                         std::vector<std::pair<int32_t, float>> bias, int32_t top_logprobs)
    : tok_(tok),
      sampler_(sampler),
      detok_(tok, false),
      stops_(std::move(stops)),
      bias_(std::move(bias)),
      top_logprobs_(top_logprobs) {
    for (size_t i = 0; i < stops_.size(); i++)
        if (stops_[i].empty()) throw ArgumentError(format("stop string %zu is empty", i));
    for (const auto& b : bias_) {
        if (b.first < 0 || b.first >= sampler_.n_vocab())
            throw ArgumentError(format("logit bias token %d is not in [0, %d)", b.first, sampler_.n_vocab()));
        if (!std::isfinite(b.second))
            throw ArgumentError(format("the logit bias of token %d is not a finite number", b.first));
    }
    if (top_logprobs_ < -1 || top_logprobs_ > sampler_.n_vocab())
        throw ArgumentError(format("top_logprobs must be in [-1, %d], got %d", sampler_.n_vocab(), top_logprobs_));
}

void OutputStage::bias_and_mask(float* logits, const uint8_t* allowed) const {
    for (const auto& b : bias_) logits[(size_t)b.first] += b.second;
    if (!allowed) return;
    const int32_t n = sampler_.n_vocab();
    for (int32_t t = 0; t < n; t++)
        if (!((allowed[t >> 3] >> (t & 7)) & 1)) logits[t] = -INFINITY;
}

// log p(t) = logit(t) - (max + log(sum exp(logit - max))), in double; -inf logits give -inf.
void OutputStage::logprobs(const float* logits, int32_t token, TokenOutput& r) {
    const size_t n = (size_t)sampler_.n_vocab();
    double mx = -INFINITY;
    for (size_t i = 0; i < n; i++) mx = std::max(mx, (double)logits[i]);
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += std::exp((double)logits[i] - mx);
    const double lse = mx + std::log(sum);
    r.has_logprobs = true;
    r.logprob = (double)logits[token] - lse;
    r.top.clear();
    if (top_logprobs_ <= 0) return;
    order_.resize(n);
    std::iota(order_.begin(), order_.end(), 0);
    const size_t k = std::min((size_t)top_logprobs_, n);
    std::partial_sort(order_.begin(), order_.begin() + (std::ptrdiff_t)k, order_.end(), [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (size_t i = 0; i < k; i++) r.top.push_back({order_[i], (double)logits[order_[i]] - lse});
}

// The kept token into the text stream: detokenized onto pending_, then what no stop string can still
// claim moves to r.out.
void OutputStage::text(int32_t token, bool last, TokenOutput& r) {
    pending_ += detok_.push(token);
    if (!stops_.empty()) {
        const StopMatch m = find_stop(pending_, stops_);
        if (m.pos >= 0) {
            r.out.append(pending_, 0, (size_t)m.pos);
            pending_.clear();
            r.end = "stop";
            return;
        }
        const size_t ready = pending_.size() - m.hold_back;
        r.out.append(pending_, 0, ready);
        pending_.erase(0, ready);
    } else {
        r.out.append(pending_);
        pending_.clear();
    }
    if (last) {
        r.out += flush();
        r.end = "length";
    }
}

void OutputStage::step(float* logits, const uint8_t* allowed, bool last, TokenOutput& r) {
    if (!logits) throw ArgumentError("logits is a null pointer");
    r.token = -1;
    r.end = nullptr;
    r.out.clear();
    r.has_logprobs = false;
    r.top.clear();
    bias_and_mask(logits, allowed);
    const int32_t t = sampler_.sample(logits);
    if (tok_.is_eog(t)) {
        r.out = flush();
        r.end = "stop";
        return;
    }
    if (top_logprobs_ >= 0) logprobs(logits, t, r);
    sampler_.accept(t);
    r.token = t;
    text(t, last, r);
}

std::string OutputStage::flush() {
    std::string s = pending_ + detok_.flush();  // an unfinished character becomes U+FFFD
    pending_.clear();
    return s;
}

void step_sequence(Session& session, int32_t seq, int32_t pos, int32_t token, OutputStage& out,
                   const uint8_t* allowed, bool last, std::vector<float>& logits, TokenOutput& r) {
    const int32_t n_vocab = session.model().hp.n_vocab;
    if (out.n_vocab() != n_vocab)
        throw ArgumentError(format("the sampler is for %d tokens, the model has %d", out.n_vocab(), n_vocab));
    logits.resize((size_t)n_vocab);
    const uint8_t want = 1;
    session.decode(&token, &seq, &pos, &want, 1, logits.data());
    out.step(logits.data(), allowed, last, r);
}

}  // namespace optiml
