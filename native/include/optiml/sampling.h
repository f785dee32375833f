// Token sampling: turns one row of logits into a token id.
//
// The chain follows llama.cpp's default sampler order (common/sampling: penalties, dry, top_n_sigma,
// top_k, typ_p, top_p, min_p, xtc, temperature, then dist); OptiML implements the subset
//
//     penalties -> top-k -> top-p -> min-p -> temperature -> softmax -> draw
//
// Consequences worth knowing (same as llama.cpp):
//  * top-p and min-p look at the distribution at temperature 1 (temperature comes after them), so the
//    temperature reshapes only the probabilities among the survivors, never which tokens survive.
//  * Greedy (temperature <= 0, or so small that 1/temperature overflows) applies the penalties and then
//    takes the argmax; ties go to the lowest token id. Filters are skipped: none can remove the argmax.
//  * top-p and min-p both keep a best-first prefix, so their result is the shorter prefix. The code runs
//    min-p first (an O(n) filter) so that top-p sorts only min-p's survivors; top-p's threshold still
//    refers to the mass before min-p, so the result is llama.cpp's top-p-then-min-p.
//
// Definitions (all on the candidates left by the previous step; logits are float32):
//  * penalties: for each distinct token t among the last `repeat_last_n` accepted tokens, with c its
//    count in that window: logit = logit > 0 ? logit / repeat_penalty : logit * repeat_penalty, then
//    logit -= c * frequency_penalty + presence_penalty.
//  * top-k: keep the k highest logits (k <= 0: off; k >= the candidates: no-op).
//  * top-p: softmax, sort descending, keep the shortest prefix whose cumulative probability >= top_p
//    (the token that crosses top_p is kept; at least one token). top_p >= 1: off.
//  * min-p: keep tokens with p >= min_p * p_max, i.e. logit >= max_logit + log(min_p). min_p <= 0: off.
//  * temperature: p ~ exp((logit - max_logit) / temperature) over the survivors.
// Ties in logit order are broken by token id (lower first), so top-k/top-p keep a well-defined set.
//
// Logits: -inf means "never choose this token" (e.g. a grammar or a banned token). NaN and +inf (also
// after penalties) throw ArgumentError, as does a row where every logit is -inf.
//
// Randomness: std::mt19937_64, whose output sequence the C++ standard fixes, and a uniform in [0, 1)
// made from its top 53 bits here (std::uniform_real_distribution / discrete_distribution are
// implementation-defined). Each sample() consumes exactly one RNG output, except when a single token
// survives the chain (greedy included), which needs no draw. Same seed + same logits + same accepted tokens = same tokens, on every
// standard library. (Probabilities use the platform's expf, so a draw landing within ~1e-7 of a bucket
// edge could in principle differ between libms.)
//
// A Sampler is not thread-safe; use one per sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace optiml {

// The seed value that asks for a random seed (drawn from std::random_device on construction and on
// every reset()). Same value as llama.cpp's LLAMA_DEFAULT_SEED. Sampler::seed() tells the seed drawn.
constexpr uint64_t SAMPLING_RANDOM_SEED = 0xFFFFFFFFull;

struct SamplingParams {
    float temperature = 0.8f;        // <= 0: greedy (argmax, ties -> lowest id). NaN/inf: error
    int32_t top_k = 40;              // <= 0: off
    float top_p = 0.95f;             // >= 1: off; 0: the likeliest token alone
    float min_p = 0.05f;             // <= 0: off; must be <= 1
    float repeat_penalty = 1.0f;     // 1: off; must be > 0 and finite
    int32_t repeat_last_n = 64;      // window of recent tokens for all penalties (0: off, -1: whole history)
    float frequency_penalty = 0.0f;  // logit -= count * frequency_penalty (may be negative)
    float presence_penalty = 0.0f;   // logit -= (count > 0) * presence_penalty (may be negative)
    uint64_t seed = SAMPLING_RANDOM_SEED;  // any other value: reproducible draws
};

// Throws ArgumentError (with the parameter's name) when `p` or `n_vocab` cannot be used.
void validate_sampling_params(const SamplingParams& p, int32_t n_vocab);

class Sampler {
public:
    Sampler(const SamplingParams& p, int32_t n_vocab);

    // Applies the chain to logits[0 .. n_vocab) and draws a token. Does not record it: call accept().
    int32_t sample(const float* logits);

    // Records a token (prompt tokens too) for the penalties.
    void accept(int32_t token);

    // Clears the history and re-seeds (a fixed seed restarts the same sequence; the random seed draws
    // a new one).
    void reset();

    // The distribution sample() would draw from, as token ids and probabilities sorted by probability
    // descending (ties: lower id first). Does not advance the RNG. Greedy: the argmax with prob 1.
    void probs(const float* logits, std::vector<int32_t>& ids, std::vector<double>& probs);

    const SamplingParams& params() const { return params_; }
    int32_t n_vocab() const { return n_vocab_; }
    uint64_t seed() const { return seed_; }  // the seed in use (the drawn one for SAMPLING_RANDOM_SEED)
    // The tokens the penalties look at now, oldest first.
    std::vector<int32_t> penalty_window() const;

private:
    struct Candidate {
        float logit;
        int32_t id;
    };

    // Runs penalties and the filters; leaves the survivors in cand_[0 .. n_cand_) and their
    // unnormalized weights in weight_[0 .. n_cand_), with the total in weight_sum_.
    void prepare(const float* logits);
    bool prepare_greedy(const float* logits);
    void apply_penalties();
    void drop_neg_inf_and_check();
    void top_k(int32_t k);
    void top_p(float p, double total);
    double mass() const;  // sum of exp(logit - max_logit) over the candidates
    void min_p(float p);
    void sort_prefix(size_t m);  // makes cand_[0 .. m) the m best, in order
    void reseed();
    double uniform01();

    SamplingParams params_;
    int32_t n_vocab_;
    uint64_t seed_ = 0;
    std::mt19937_64 rng_;

    // Penalty history: a ring of the last repeat_last_n tokens (or all of them for -1).
    std::vector<int32_t> ring_;
    size_t ring_head_ = 0;  // next slot to overwrite once the ring is full
    std::vector<int32_t> counts_;  // occurrences of each token id in the window

    // Reused per-call buffers (no allocation after the first call).
    std::vector<Candidate> cand_;
    size_t n_cand_ = 0;
    size_t n_sorted_ = 0;  // cand_[0 .. n_sorted_) is known to be the best n_sorted_ in order
    float max_logit_ = 0;
    std::vector<float> weight_;
    double weight_sum_ = 0;
};

}  // namespace optiml
