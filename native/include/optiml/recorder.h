// Recording hooks for `optiml profile`: per layer and per FFN neuron, how often it fires, how large its
// activation is, and histograms of activation magnitudes from which `optiml calibrate` picks thresholds;
// for a mixture of experts, which experts the router chooses and the firing of the neurons inside them.
// A Session with a recorder attached feeds it every token it evaluates (the FFN then runs dense).
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/threadpool.h"

namespace optiml {

class Model;

class ActivationRecorder {
public:
    // Histogram bins of |value|: bin 0 holds values below 2^kHistMinExp (zero included), then
    // kHistPerOctave bins per octave (linear inside the octave) up to 2^kHistMaxExp, then one bin
    // for everything larger.
    static constexpr int kHistMinExp = -20;
    static constexpr int kHistMaxExp = 12;
    static constexpr int kHistPerOctave = 8;
    static constexpr int kHistBins = (kHistMaxExp - kHistMinExp) * kHistPerOctave + 2;

    // thresholds: per layer, a neuron fires when |act(gate) * up| > threshold. Every sample_every-th
    // token (0: none) has its FFN inputs and firing masks kept, up to max_samples tokens.
    // gate_weight: empty, or [n_layer][n_ff] factors: gate_hist then bins |act(gate)| * gate_weight
    // (the weighted criterion of `optiml calibrate`).
    ActivationRecorder(const Model& model, std::vector<float> thresholds, int64_t sample_every, int64_t max_samples,
                       std::vector<float> gate_weight = {});

    // One layer's FFN for n tokens: xn the FFN input after its norm [n][n_embd], a = act(gate),
    // u = up and h = act(gate) * up [n][n_ff]. Called by the forward pass, layer by layer.
    void record(ThreadPool& pool, int layer, const float* xn, const float* a, const float* u, const float* h,
                int32_t n);

    // A mixture-of-experts layer's router choice for n tokens: chosen[t * k + j] and weight[t * k + j],
    // best first (the MoE FFN calls it after routing). Consecutive tokens of one sequence (within a step,
    // and across steps until new_sequence) add to expert_next.
    void record_experts(int layer, const int32_t* chosen, const float* weight, int32_t n, int32_t k);
    // h = act(gate) * up of `rows` tokens routed to expert e of a MoE layer [rows][n_ff_exp]: the neurons
    // that fire inside the expert, and prod_hist as for a dense layer (thresholds come from it).
    void record_expert_neurons(int layer, int32_t expert, const float* h, int64_t rows);
    // The next token evaluated starts a sequence (the session's context was emptied).
    void new_sequence();

    // Bin edges: kHistBins + 1 values, the first 0 and the last +inf.
    static std::vector<float> hist_edges();

    int32_t n_layer, n_ff, n_embd;
    int64_t n_tokens = 0;            // tokens recorded (counted at layer 0)
    std::vector<float> thresholds;   // [n_layer]
    std::vector<float> down_norm;    // [n_layer][n_ff]: L2 norm of each neuron's down column
    std::vector<int64_t> fired;      // [n_layer][n_ff]
    std::vector<double> sum_abs;     // [n_layer][n_ff]: sum of |h|
    std::vector<double> sum_abs_up;  // [n_layer][n_ff]: sum of |up|
    std::vector<float> gate_weight;  // [n_layer][n_ff] or empty
    std::vector<double> gate_hist, gate_err, prod_hist, prod_err;  // [n_layer][kHistBins]
    // Samples: [n_samples][n_layer][n_embd] as f16 bits, and [n_samples][n_layer][n_ff / 8] packed
    // masks (bit 7 of byte 0 is neuron 0, as numpy.packbits).
    int64_t sample_every, max_samples, n_samples = 0;
    std::vector<uint16_t> sample_x;
    std::vector<uint8_t> sample_mask;
    // Mixtures of experts (n_expert > 0): per layer and expert, the tokens routed to it and the sum of
    // their weights; expert_next[l][a][b]: a token chose b after the token before it chose a; expert_fired
    // [l][e][j]: neuron j of expert e fired (|h| > threshold) on a token routed to it.
    int32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0;
    std::vector<int64_t> expert_count;  // [n_layer][n_expert]
    std::vector<double> expert_weight;  // [n_layer][n_expert]
    std::vector<int64_t> expert_next;   // [n_layer][n_expert][n_expert]
    std::vector<int64_t> expert_fired;  // [n_layer][n_expert][n_ff_exp]

private:
    std::vector<int64_t> layer_seen_;  // tokens seen per layer, to place samples
    std::vector<int32_t> last_chosen_;  // [n_layer][k]: the previous token's experts
    std::vector<uint8_t> has_last_;     // [n_layer]
};

// The histogram bin of |v|.
int hist_bin(float v);

}  // namespace optiml
