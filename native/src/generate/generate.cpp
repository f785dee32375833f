// The generation loop (see optiml/generate.h).
#include "optiml/generate.h"

#include "optiml/common.h"
#include "optiml/model.h"

namespace optiml {

Generator::Generator(Session& session, const Tokenizer& tokenizer, Sampler& sampler, std::vector<int32_t> prompt,
                     int32_t n_cached, int32_t max_tokens, std::vector<std::string> stops)
    : session_(session),
      sampler_(sampler),
      out_(tokenizer, sampler, std::move(stops)),
      prompt_(std::move(prompt)),
      n_cached_(n_cached),
      max_tokens_(max_tokens) {
    const int32_t n_vocab = session_.model().hp.n_vocab;
    if (prompt_.empty()) throw ArgumentError("the prompt is empty");
    if (n_cached_ < 0 || n_cached_ >= (int32_t)prompt_.size())
        throw ArgumentError(format("n_cached (%d) must be in [0, %zu): the prompt's last token must run", n_cached_,
                                   prompt_.size()));
    if (n_cached_ > session_.n_past())
        throw ArgumentError(format("n_cached (%d) is more than the context holds (%d)", n_cached_, session_.n_past()));
    if (max_tokens_ < 0) throw ArgumentError(format("max_tokens must be >= 0, got %d", max_tokens_));
    if (sampler_.n_vocab() != n_vocab)
        throw ArgumentError(format("the sampler is for %d tokens, the model has %d", sampler_.n_vocab(), n_vocab));
    logits_.resize((size_t)n_vocab);
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
    TokenOutput r;
    out_.step(logits_.data(), nullptr, false, r);
    out = std::move(r.out);
    if (r.token < 0) {  // end of generation: `out` is the text the stream held
        state_ = State::done;
        return;
    }
    const int32_t tok = r.token;
    generated_.push_back(tok);
    stats_.gen_tokens++;
    stats_.gen_s = since(gen_start_);
    if (r.end) {  // a stop string: what the detokenizer holds is dropped with the text after it
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
            piece = out_.flush();
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
