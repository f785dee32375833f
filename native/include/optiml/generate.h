// The generation loop: prompt -> (the output stage (below: sample, end-of-generation check, detokenize,
// stop strings) -> eval)*.
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

// The output stage: what becomes of one sequence's row of logits. Generator (Model.generate, stream,
// chat) and the server (a batched step's rows, and step_sequence below for a request running alone) all
// take their tokens through it, so a greedy server request gets Model.generate's text.
//
//     logit bias (logit += b)  ->  allowed-token mask (-inf outside it: a JSON-schema grammar)
//       ->  Sampler::sample  ->  end-of-generation check  ->  logprobs (when asked)
//       ->  Sampler::accept  ->  Detokenizer  ->  stop strings  ->  the text that may go out
//
// Logprobs are the log-softmax (in double) of the logits after the bias and the mask, before the
// sampler's penalties and temperature (what the OpenAI API reports): the kept token's, and with
// top_logprobs = k > 0 the k best tokens, highest first, ties to the lower id.
//
// The text: pending holds what may begin a stop string (or an unfinished character); at a stop string
// the text from it on is dropped, with what the detokenizer holds. An end-of-generation token is not
// kept (not accepted, no logprobs) and ends the stream with the held text flushed.
struct TokenLogprob {
    int32_t token;
    double logprob;
};

struct TokenOutput {
    int32_t token = -1;         // sampled and kept; -1 at end-of-generation
    const char* end = nullptr;  // nullptr (more to come), "stop" (end of generation, a stop string) or
                                // "length" (the caller said `last`)
    std::string out;            // the text that may go out now; at an end, all that is left of the stream
    bool has_logprobs = false;  // top_logprobs >= 0 and a token was kept
    double logprob = 0;         // the kept token's
    std::vector<TokenLogprob> top;
};

class OutputStage {
public:
    // One sequence's stage. bias: (token, added logit) pairs with tokens in [0, sampler.n_vocab());
    // stops: non-empty UTF-8 strings; top_logprobs: -1 none, 0 the kept token's, k > 0 also the k best.
    // ArgumentError otherwise. The Tokenizer and the Sampler must outlive the stage.
    OutputStage(const Tokenizer& tok, Sampler& sampler, std::vector<std::string> stops,
                std::vector<std::pair<int32_t, float>> bias = {}, int32_t top_logprobs = -1);

    // Takes the next token from `logits` (sampler.n_vocab() values, changed in place by the bias and the
    // mask). allowed: nullptr (every token), or a bitmask of at least n_vocab bits (token t is bit t % 8
    // of byte t / 8; 0: forbidden). last: the token sampled now is the stream's last (max_tokens, a full
    // context): unless the stream ends otherwise, the end is "length" and the held text goes out.
    void step(float* logits, const uint8_t* allowed, bool last, TokenOutput& r);

    // What the stream still holds (a stop string's possible start; an unfinished character as U+FFFD),
    // for an end the caller decides (a grammar that completed); the stream starts over.
    std::string flush();

    const std::string& pending() const { return pending_; }
    int32_t n_vocab() const { return sampler_.n_vocab(); }

private:
    void bias_and_mask(float* logits, const uint8_t* allowed) const;
    void logprobs(const float* logits, int32_t token, TokenOutput& r);
    void text(int32_t token, bool last, TokenOutput& r);

    const Tokenizer& tok_;
    Sampler& sampler_;
    Detokenizer detok_;
    std::vector<std::string> stops_;
    std::vector<std::pair<int32_t, float>> bias_;
    int32_t top_logprobs_;
    std::string pending_;         // decoded text held back
    std::vector<int32_t> order_;  // the top-logprobs selection's buffer
};

// One token of one sequence of a multi-sequence Session, decoded and taken through its output stage in
// one call (the server, while one request runs alone): runs `token` at position `pos` of sequence
// `seq` into `logits`, then out.step(logits, allowed, last, r).
void step_sequence(Session& session, int32_t seq, int32_t pos, int32_t token, OutputStage& out,
                   const uint8_t* allowed, bool last, std::vector<float>& logits, TokenOutput& r);

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
    Sampler& sampler_;
    OutputStage out_;
    std::vector<int32_t> prompt_;
    int32_t n_cached_, max_tokens_;

    State state_ = State::start;
    std::vector<float> logits_;     // of the last evaluated token
    std::vector<int32_t> generated_;
    int32_t n_gen_evaluated_ = 0;
    int32_t to_eval_ = -1;          // sampled token to evaluate before the next sample, -1 if none
    GenerateStats stats_;
    Clock::time_point gen_start_;   // end of the prompt
};

}  // namespace optiml
