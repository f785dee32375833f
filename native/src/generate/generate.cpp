// The generation loop (see optiml/generate.h).
#include "optiml/generate.h"

#include "optiml/common.h"
#include "optiml/model.h"
#include "optiml/stop_strings.h"

namespace optiml {

Generator::Generator(Session& session, const Tokenizer& tokenizer, Sampler& sampler, std::vector<int32_t> prompt,
                     int32_t n_cached, int32_t max_tokens, std::vector<std::string> stops)
    : session_(session),
      tok_(tokenizer),
      sampler_(sampler),
      detok_(tokenizer, false),
      prompt_(std::move(prompt)),
      n_cached_(n_cached),
      max_tokens_(max_tokens),
      stops_(std::move(stops)) {
    const int32_t n_vocab = session_.model().hp.n_vocab;
    if (prompt_.empty()) throw ArgumentError("the prompt is empty");
    if (n_cached_ < 0 || n_cached_ >= (int32_t)prompt_.size())
        throw ArgumentError(format("n_cached (%d) must be in [0, %zu): the prompt's last token must run", n_cached_,
                                   prompt_.size()));
    if (n_cached_ > session_.n_past())
        throw ArgumentError(format("n_cached (%d) is more than the context holds (%d)", n_cached_, session_.n_past()));
    if (max_tokens_ < 0) throw ArgumentError(format("max_tokens must be >= 0, got %d", max_tokens_));
    for (size_t i = 0; i < stops_.size(); i++)
        if (stops_[i].empty()) throw ArgumentError(format("stop string %zu is empty", i));
    if (sampler_.n_vocab() != n_vocab)
        throw ArgumentError(format("the sampler is for %d tokens, the model has %d", sampler_.n_vocab(), n_vocab));
    logits_.resize((size_t)n_vocab);
}

int32_t sample_into_text(Sampler& sampler, const Tokenizer& tok, Detokenizer& detok,
                         const std::vector<std::string>& stops, const float* logits, std::string& pending,
                         std::string& out, bool& stopped) {
    stopped = false;
    const int32_t t = sampler.sample(logits);
    if (tok.is_eog(t)) return -1;
    sampler.accept(t);
    pending += detok.push(t);
    if (stops.empty()) {
        out.append(pending);
        pending.clear();
        return t;
    }
    const StopMatch m = find_stop(pending, stops);
    if (m.pos >= 0) {
        out.append(pending, 0, (size_t)m.pos);
        pending.clear();
        stopped = true;
        return t;
    }
    const size_t ready = pending.size() - m.hold_back;
    out.append(pending, 0, ready);
    pending.erase(0, ready);
    return t;
}

SequenceStep step_sequence(Session& session, int32_t seq, int32_t pos, int32_t token,
                           const std::vector<std::pair<int32_t, float>>& bias, Sampler& sampler,
                           const Tokenizer& tok, Detokenizer& detok, const std::vector<std::string>& stops,
                           std::string& pending, bool last, std::vector<float>& logits) {
    const int32_t n_vocab = session.model().hp.n_vocab;
    if (sampler.n_vocab() != n_vocab)
        throw ArgumentError(format("the sampler is for %d tokens, the model has %d", sampler.n_vocab(), n_vocab));
    for (const auto& b : bias)
        if (b.first < 0 || b.first >= n_vocab)
            throw ArgumentError(format("logit bias token %d is not in [0, %d)", b.first, n_vocab));
    logits.resize((size_t)n_vocab);
    const uint8_t want = 1;
    session.decode(&token, &seq, &pos, &want, 1, logits.data());
    for (const auto& b : bias) logits[(size_t)b.first] += b.second;
    SequenceStep r;
    bool stopped = false;
    r.token = sample_into_text(sampler, tok, detok, stops, logits.data(), pending, r.out, stopped);
    if (r.token < 0 || stopped) {
        r.end = "stop";
        r.flush = r.token < 0;
    } else if (last) {
        r.end = "length";
        r.flush = true;
    }
    return r;
}

void Generator::run_prompt() {
    if (n_cached_ > session_.n_past())  // the session changed since the constructor
        throw ArgumentError(format("n_cached (%d) is more than the context holds (%d)", n_cached_, session_.n_past()));
    const auto t0 = Clock::now();
    stats_.prompt_tokens = (int32_t)prompt_.size();
    stats_.prompt_evaluated = (int32_t)prompt_.size() - n_cached_;
    session_.truncate(n_cached_);
    session_.eval(prompt_.data() + n_cached_, stats_.prompt_evaluated, false, logits_.data());
    stats_.prompt_s = since(t0);
    gen_start_ = Clock::now();
    for (int32_t t : prompt_) sampler_.accept(t);  // the penalties see the prompt, as llama.cpp's do
    state_ = State::running;
}

void Generator::step(std::string& out) {
    if ((int32_t)generated_.size() >= max_tokens_) {  // only for max_tokens == 0; see below otherwise
        state_ = State::flush;
        return;
    }
    bool stopped = false;
    const int32_t tok = sample_into_text(sampler_, tok_, detok_, stops_, logits_.data(), pending_, out, stopped);
    if (tok < 0) {
        state_ = State::flush;
        return;
    }
    generated_.push_back(tok);
    stats_.gen_tokens++;
    stats_.gen_s = since(gen_start_);
    if (stopped) {  // what the detokenizer holds is dropped with the text after the stop
        state_ = State::done;
        return;
    }
    // The last token is not run: no logits are needed after it, and a full context cannot take it.
    if ((int32_t)generated_.size() == max_tokens_ || session_.n_past() >= session_.n_ctx())
        state_ = State::flush;
    else
        to_eval_ = tok;  // run when the next piece is asked for, so an abandoned stream leaves it out
}

bool Generator::next(std::string& piece) {
    piece.clear();
    if (state_ == State::done) return false;
    try {
        if (state_ == State::start) run_prompt();
        const auto t0 = Clock::now();
        while (state_ == State::running && piece.empty()) {
            if (to_eval_ >= 0) {
                const int32_t tok = to_eval_;
                to_eval_ = -1;
                session_.eval(&tok, 1, false, logits_.data());
                n_gen_evaluated_++;
                stats_.gen_s = since(gen_start_);
            }
            step(piece);
        }
        if (piece.empty() && state_ == State::flush) {
            piece = pending_ + detok_.flush();  // an unfinished character becomes U+FFFD
            pending_.clear();
            state_ = State::done;
        }
        stats_.busy_s += since(t0);
    } catch (...) {
        state_ = State::done;
        throw;
    }
    return !piece.empty();
}

}  // namespace optiml
