// The generation loop: prompt -> (sample -> end-of-generation check -> detokenize -> stop strings -> eval)*.
//
// A Generator drives one Session from a prompt to the end of generation and hands out the text piece by
// piece. Everything per token (eval, sampling, detokenization, stop-string matching) runs here, so a
// caller in another language (Python) only receives finished text.
//
//     Generator g(session, tokenizer, sampler, prompt, n_cached, max_tokens, stops);
//     std::string piece;
//     while (g.next(piece)) consume(piece);
//
// Generation ends at an end-of-generation token (Tokenizer::is_eog; not part of the output), at the first
// stop string (the text from it on is dropped), after max_tokens sampled tokens, or when the context is
// full. Every piece is non-empty, valid UTF-8 and never splits a character.
//
// The context: the first next() truncates the session to n_cached positions (the caller's promise: the
// session already holds prompt[0 .. n_cached)) and evaluates the rest of the prompt. After that, a
// sampled token is evaluated only when the caller asks for the next piece, so a caller that stops asking
// leaves the session holding exactly prompt + generated()[0 .. n_generated_evaluated()). The last
// sampled token is never evaluated (nothing would use its logits). n_past() == prompt size +
// n_generated_evaluated() once the prompt ran.
//
// Seeded sampling gives the same tokens as a loop calling Sampler::accept(prompt), then per token
// sample / accept / eval (what optiml's Python loop did): the Sampler sees exactly that sequence.
//
// Errors: whatever Session::eval, Sampler or the Detokenizer throw (ContextOverflowError, ArgumentError)
// propagates out of next(); the generator is then finished (next() returns false).
//
// Not thread-safe. The Session, Tokenizer and Sampler must outlive the Generator, and nothing else may
// use the Session or the Sampler while it runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "optiml/sampling.h"
#include "optiml/tokenizer.h"

namespace optiml {

class Session;  // optiml/model.h

struct GenerateStats {
    int32_t prompt_tokens = 0;     // the prompt's length
    int32_t prompt_evaluated = 0;  // prompt tokens actually run (those past n_cached)
    double prompt_s = 0;           // seconds the prompt took
    int32_t gen_tokens = 0;        // tokens sampled and kept (end-of-generation tokens not counted)
    double gen_s = 0;              // wall seconds from the prompt's end to the last token's work (a
                                   // caller's time between next() calls included, as a stopwatch would)
    double busy_s = 0;             // seconds spent inside next() after the prompt: eval, sampling,
                                   // detokenization and stop strings only (the native part of gen_s)
};

// The per-token work shared by Generator and a caller that keeps one sequence's state itself: samples
// from `logits` and takes the token into the text stream. Returns -1 for an end-of-generation token
// (not accepted, nothing else done). Otherwise the token is accepted by the sampler and pushed through
// the detokenizer onto `pending`; the text that may go out moves from `pending` to `out`, and `stopped`
// is set when a stop string matched (`out` then ends before it and `pending` is cleared).
int32_t sample_into_text(Sampler& sampler, const Tokenizer& tok, Detokenizer& detok,
                         const std::vector<std::string>& stops, const float* logits, std::string& pending,
                         std::string& out, bool& stopped);

// One token of one sequence of a multi-sequence Session, for a caller that keeps the sequence's state
// between calls (the server's scheduler, while one request runs alone): runs `token` at position `pos`
// of sequence `seq`, adds `bias` to the logits, then sample_into_text(). The text stream ends (`end`)
// at an end-of-generation token or stop string ("stop"), or after this token when `last` ("length");
// `flush` says whether the detokenizer's held bytes still go out (not after a stop string).
struct SequenceStep {
    int32_t token = -1;  // sampled and kept; -1 at end-of-generation
    const char* end = nullptr;  // nullptr (more to come), "stop" or "length"
    bool flush = false;
    std::string out;
};
SequenceStep step_sequence(Session& session, int32_t seq, int32_t pos, int32_t token,
                           const std::vector<std::pair<int32_t, float>>& bias, Sampler& sampler,
                           const Tokenizer& tok, Detokenizer& detok, const std::vector<std::string>& stops,
                           std::string& pending, bool last, std::vector<float>& logits);

class Generator {
public:
    // Validates the arguments (ArgumentError): a non-empty prompt, 0 <= n_cached < prompt size and
    // n_cached <= session.n_past(), max_tokens >= 0, non-empty stops, a sampler for the model's
    // vocabulary. Runs nothing: the prompt is evaluated by the first next().
    Generator(Session& session, const Tokenizer& tokenizer, Sampler& sampler, std::vector<int32_t> prompt,
              int32_t n_cached, int32_t max_tokens, std::vector<std::string> stops);

    // Runs until a piece of text is ready (returns true, the text in `piece`) or generation has ended
    // (returns false, `piece` empty).
    bool next(std::string& piece);

    bool finished() const { return state_ == State::done; }
    // Whether next() began on the prompt (the session was truncated to n_cached, then ran the prompt).
    bool started() const { return state_ != State::start; }
    // Every token sampled and kept so far (the output's ids; a stop string may cut the text short of them).
    const std::vector<int32_t>& generated() const { return generated_; }
    // How many of generated() the session holds (see the context above).
    int32_t n_generated_evaluated() const { return n_gen_evaluated_; }
    const GenerateStats& stats() const { return stats_; }
    const std::vector<int32_t>& prompt() const { return prompt_; }

private:
    enum class State { start, running, flush, done };
    using Clock = std::chrono::steady_clock;

    void run_prompt();
    // Samples one token and handles it; leaves text that may go out in `out`.
    void step(std::string& out);
    double since(Clock::time_point t) const { return std::chrono::duration<double>(Clock::now() - t).count(); }

    Session& session_;
    const Tokenizer& tok_;
    Sampler& sampler_;
    Detokenizer detok_;
    std::vector<int32_t> prompt_;
    int32_t n_cached_, max_tokens_;
    std::vector<std::string> stops_;

    State state_ = State::start;
    std::vector<float> logits_;     // of the last evaluated token
    std::string pending_;           // decoded text held back (it may begin a stop string)
    std::vector<int32_t> generated_;
    int32_t n_gen_evaluated_ = 0;
    int32_t to_eval_ = -1;          // sampled token to evaluate before the next sample, -1 if none
    GenerateStats stats_;
    Clock::time_point gen_start_;   // end of the prompt
};

}  // namespace optiml
