// A llama-family model (llama, mistral, qwen2) or Gemma 3 bound to the tensors of a mapped GGUF file, and the
// per-conversation state (KV cache, scratch) that runs it. The forward pass reads top to bottom in
// native/src/model/forward.cpp; the FFN of a layer is its own unit (ffn.cpp) so it can later be
// split by neuron between devices and computed sparsely.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "optiml/common.h"
#include "optiml/gguf.h"
#include "optiml/backend.h"
#include "optiml/kernels.h"
#include "optiml/kv_cache.h"
#include "optiml/matmul.h"
#include "optiml/plan.h"
#include "optiml/recorder.h"
#include "optiml/rope_yarn.h"
#include "optiml/sparse.h"
#include "optiml/threadpool.h"

namespace optiml {

struct Predictors;

enum RopeType { ROPE_NORM = 0, ROPE_NEOX = 2 };  // pairs (2i, 2i+1) or (i, i + n_rot/2)
// act(gate) * up; GELU is tanh-approximated; RELU2 is relu(gate) * relu(up) (dReLU). SWIGLU_OAI (gpt-oss's
// experts): g = min(gate, 7), g * sigmoid(1.702 g) * (clamp(up, -7, 7) + 1).
enum FFNActivation { FFN_SILU = 0, FFN_RELU = 1, FFN_GELU = 2, FFN_RELU2 = 3, FFN_SWIGLU_OAI = 4 };

// How a mixture of experts weighs its chosen experts (llama.cpp's expert_gating_func): a softmax over
// every expert's logit, the top k of those; or the top k logits, then a softmax over those k alone.
enum MoEGating { MOE_GATING_SOFTMAX = 1, MOE_GATING_SOFTMAX_CHOSEN = 3 };

// The name of an activation as `optiml.ffn.activation` spells it.
const char* ffn_activation_name(FFNActivation act);

// Activations of the ReLU family are exactly zero for most neurons: skipping those is lossless.
inline bool is_relu_family(FFNActivation act) { return act == FFN_RELU || act == FFN_RELU2; }

// Hyper-parameters, read once from `{arch}.*` metadata.
struct HParams {
    std::string arch;
    int32_t n_vocab = 0;
    int32_t n_ctx_train = 0;
    int32_t n_embd = 0;
    int32_t n_layer = 0;
    int32_t n_head = 0;
    int32_t n_head_kv = 0;
    int32_t head_dim = 0;  // per head, for q, k and v
    int32_t n_ff = 0;
    int32_t n_rot = 0;  // rotated dimensions per head (<= head_dim)
    // Layers il with (il + 1) a multiple of this have no RoPE (SmolLM3's NoPE layers: 4, as llama.cpp fixes it);
    // 0: every layer has it.
    int32_t no_rope_step = 0;
    float rms_eps = 1e-5f;
    float rope_freq_base = 10000.0f;
    float rope_freq_scale = 1.0f;  // 1 / linear (or YaRN) scaling factor
    RopeType rope_type = ROPE_NORM;
    // YaRN (rope.scaling.type = yarn; gpt-oss): with yarn_ext_factor > 0 each pair's angle blends the
    // interpolated (scaled) and extrapolated ones between the correction dimensions that beta_fast and
    // beta_slow give for n_ctx_orig_yarn, and cos/sin grow by 1 + 0.1 ln(1 / freq_scale).
    float yarn_ext_factor = 0.0f;
    float yarn_attn_factor = 1.0f;
    float yarn_beta_fast = 32.0f;
    float yarn_beta_slow = 1.0f;
    int32_t n_ctx_orig_yarn = 0;
    FFNActivation ffn_act = FFN_SILU;

    // Gemma 2 and 3 (all neutral for llama): embeddings scaled by embd_scale; q scaled by attn_q_scale
    // after RoPE and scores by attn_kq_scale; scores soft-capped (cap * tanh(s / cap)) when attn_softcap
    // > 0 (Gemma 2); layers with swa_layer[il] attend to the last n_swa positions only and rotate with
    // their own base and scale; logits soft-capped when final_softcap > 0.
    float embd_scale = 1.0f;
    float attn_q_scale = 1.0f;
    float attn_kq_scale = 1.0f;
    float attn_softcap = 0.0f;
    int32_t n_swa = 0;
    std::vector<bool> swa_layer;  // [n_layer]; empty: no sliding-window layers
    float rope_freq_base_swa = 10000.0f;
    float rope_freq_scale_swa = 1.0f;
    float final_softcap = 0.0f;
    // `{arch}.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank; -1 not given): how an
    // embedding model's file says its token states become one embedding.
    int32_t pooling_type = -1;

    // Mixture of experts (native/src/model/moe.cpp); n_expert == 0: a dense FFN. Each token's FFN is
    // the weighted sum of the n_expert_used experts (of n_ff_exp neurons) its router rates highest:
    // softmax over all experts, top n_expert_used, those weights renormalized to sum 1 when
    // expert_weights_norm (top-k of the logits then softmax over them, as Mixtral says it, is the
    // same), times expert_weights_scale; plus, when n_ff_shexp > 0, a shared expert scaled by
    // sigmoid(gate_inp_shexp . x) (qwen2moe). MoE layers run on the CPU only.
    int32_t n_expert = 0;
    int32_t n_expert_used = 0;
    int32_t n_ff_exp = 0;
    int32_t n_ff_shexp = 0;
    bool expert_weights_norm = false;
    float expert_weights_scale = 1.0f;
    MoEGating expert_gating = MOE_GATING_SOFTMAX;

    bool is_swa(int il) const { return !swa_layer.empty() && swa_layer[il]; }
    float rope_base(int il) const { return is_swa(il) ? rope_freq_base_swa : rope_freq_base; }
    // Layer il's rotated dimensions: n_rot, or 0 on a layer without RoPE.
    int32_t rot(int il) const { return no_rope_step > 0 && (il + 1) % no_rope_step == 0 ? 0 : n_rot; }
    float rope_scale(int il) const { return is_swa(il) ? rope_freq_scale_swa : rope_freq_scale; }
    // Layer il's YaRN ramp and cos/sin factor (no YaRN: no ramp, factor 1).
    RopeYarnRange rope_yarn(int il) const {
        return rope_yarn_range(n_rot, rope_base(il), rope_scale(il), yarn_ext_factor, yarn_attn_factor, yarn_beta_fast,
                               yarn_beta_slow, n_ctx_orig_yarn);
    }
    bool is_moe() const { return n_expert > 0; }

    int32_t n_embd_q() const { return n_head * head_dim; }
    int32_t n_embd_kv() const { return n_head_kv * head_dim; }
};

// The architectures this build runs, for error messages: "llama, mistral, qwen2".
const char* supported_architectures();

// A 2-D weight bound into the mapping (or a 1-D vector: rows == 1).
struct Weight {
    const char* name = nullptr;  // points into the GGUF's tensor info
    int32_t type = TYPE_F32;
    int64_t cols = 0;  // ne[0]
    int64_t rows = 0;  // ne[1]
    const uint8_t* data = nullptr;
    size_t row_bytes = 0;
    // In the rows16 layout (optiml/rows16.h): only the dense product (matmul_many) and the embedding
    // lookup read such a matrix; row() refuses it.
    bool rows16 = false;

    bool present() const { return data != nullptr; }
    const uint8_t* row(int64_t r) const {
        if (rows16) throw Error(format("internal: %s is in the rows16 layout, which has no plain rows", name));
        return data + r * row_bytes;
    }
    WeightMatrix matrix() const { return WeightMatrix{type, rows, cols, data, rows16}; }
    // Row r as cols floats, from either layout.
    void dequantize_row_to(int64_t r, float* out) const;
};

struct FFNWeights {
    Weight norm;  // RMSNorm scale, F32 [n_embd]
    Weight gate;  // [n_embd -> n_ff]
    Weight up;    // [n_embd -> n_ff]
    Weight down;  // [n_ff -> n_embd]
    Weight gate_b, up_b, down_b;  // optional biases, F32
    Weight post_norm;  // optional RMSNorm of the FFN's output before the residual add (Gemma 3)
};

// llama.cpp's 3-D expert tensor (ffn_{gate,up,down}_exps): n_expert matrices [cols -> rows] stored one
// after another, so expert e is an ordinary 2-D matrix at data + e * expert_bytes.
struct ExpertWeights {
    const char* name = nullptr;
    int32_t type = TYPE_F32;
    int64_t cols = 0, rows = 0, n_expert = 0;
    const uint8_t* data = nullptr;
    size_t row_bytes = 0, expert_bytes = 0;

    bool present() const { return data != nullptr; }
    WeightMatrix matrix(int64_t e) const { return WeightMatrix{type, rows, cols, data + e * expert_bytes}; }
};

// A mixture-of-experts FFN (the layer's FFNWeights keep its norm; their gate/up/down are absent).
struct MoEWeights {
    Weight gate_inp;                 // the router [n_embd -> n_expert]
    ExpertWeights gate, up, down;    // [n_embd -> n_ff_exp] x n_expert, down [n_ff_exp -> n_embd] x n_expert
    FFNWeights shared;               // the shared expert's gate/up/down (*_shexp), when hp.n_ff_shexp > 0
    Weight gate_inp_shexp;           // [n_embd -> 1]: the shared expert's sigmoid gate (optional)
    // Optional F32 biases (gpt-oss): the router's [n_expert]; the experts' as one row per expert
    // (gate_b/up_b [n_ff_exp] x n_expert, down_b [n_embd] x n_expert), added to each product's output.
    Weight gate_inp_b, gate_b, up_b, down_b;

    bool present() const { return gate_inp.present(); }
};

struct LayerWeights {
    Weight attn_norm;
    Weight wq, wk, wv, wo;
    Weight bq, bk, bv, bo;  // optional biases (Qwen2 has q/k/v; Llama's attention_bias all four), F32
    Weight q_norm, k_norm;  // optional per-head RMSNorm of q and k before RoPE, F32 [head_dim] (Gemma 3)
    Weight attn_post_norm;  // optional RMSNorm of the attention output before the residual add (Gemma 3)
    Weight attn_sinks;      // optional F32 [n_head]: a logit per head that joins every softmax with a zero value (gpt-oss)
    FFNWeights ffn;
    MoEWeights moe;  // a mixture-of-experts layer (hp.n_expert > 0): ffn holds its norm only
};

// Activation sparsity calibrated offline (`optiml calibrate`), read from `optiml.sparsity.*`: in layer l
// a neuron j is skipped when |act(gate)| * neuron_scale[l][j] (1 when absent) (or, with on_product,
// |act(gate) * up|) <= threshold[l].
struct SparsityConfig {
    bool calibrated = false;
    bool on_product = false;
    std::vector<float> threshold;     // [n_layer]
    std::vector<float> neuron_scale;  // [n_layer][n_ff] or empty
    float target = 0.0f;           // the share of neurons calibration aimed to skip
};

class Model {
public:
    // Reads hyper-parameters and binds every tensor, checking names, shapes and types.
    // UnsupportedModelError for architectures or tensor types this build cannot run.
    static std::shared_ptr<Model> load(std::shared_ptr<GGUFFile> file);

    HParams hp;
    Weight tok_embd;     // [n_embd -> n_vocab] rows are embeddings
    Weight output_norm;  // F32 [n_embd]
    Weight output;       // [n_embd -> n_vocab]; tok_embd when the embeddings are tied
    Weight rope_freqs;   // optional F32 [n_rot/2]: per-dimension frequency divisors (Llama 3.1)
    // optional F32 [n_rot/2] (Phi-3's LongRoPE): the divisors for a context longer than n_ctx_orig_yarn, and
    // for one within it (a session takes one of them: rope_freqs_for)
    Weight rope_long, rope_short;
    // The frequency divisors a session of n_ctx positions per sequence turns q and k with (llama.cpp's
    // get_rope_factors): rope_freqs, else LongRoPE's long or short list, else none. (llama.cpp compares its
    // context rounded up to 256: the same choice for every released Phi-3, whose original context is 4096.)
    const Weight& rope_freqs_for(int32_t n_ctx) const {
        if (rope_freqs.present() || !rope_long.present()) return rope_freqs;
        return n_ctx > hp.n_ctx_orig_yarn ? rope_long : rope_short;
    }
    std::vector<LayerWeights> layers;
    std::shared_ptr<GGUFFile> file;
    SparsityConfig sparsity;
    // `optiml.placement.*` (optiml solve): per layer the neurons meant for the GPU (placed neurons [0, k));
    // and, when the weights kept the file's order, placed neuron i of layer l is file neuron
    // placement_order[l * n_ff + i]. Both empty for an unplaced file.
    std::vector<int32_t> placement_gpu_neurons;
    // 1 where the placement puts the layer's attention and KV cache on the device (empty: every layer, as
    // far as the budget holds: files from before the solver chose it per layer).
    std::vector<int32_t> placement_gpu_attention;
    std::vector<int32_t> placement_order;
    // How the file's neurons were ordered (optiml.placement.order: "hot-first", "coactive", ...; empty in
    // files from before the key, which are hot-first).
    std::string placement_order_name;
    // Mixtures of experts: per layer the experts meant for the GPU, hottest first (empty: no such placement).
    std::vector<std::vector<int32_t>> placement_gpu_experts;

    // Neuron-major copy of layer il's down matrix (row j = neuron j's down column), made the first time a
    // session computes that layer's whole FFN sparsely on the host. Thread-safe.
    // compact: grouped where the type allows (see SparsitySettings::compact_down). A different choice
    // than the cached copy's replaces it.
    const NeuronMajor& down_neuron_major(ThreadPool& pool, int il, bool compact) const;

    // Bytes of weights, for reporting.
    size_t weight_bytes() const;

    // Puts each matrix (attention, FFN, output; tok_embd with output when tied) into the rows16 layout
    // where want(w) says so and rows16_fits, back into rows elsewhere. Only an in-memory copy of the file
    // can change: a mapped model stays as it is. Takes layout_mutex() exclusively, so it waits for the
    // forward passes that hold it shared.
    void set_rows16(ThreadPool& pool, const std::function<bool(const Weight& w, int layer, bool ffn)>& want);
    // The matrices set_rows16 places: every layer's attention and FFN matrices, then the output (layer -1).
    struct DenseMatrix {
        Weight* w;
        int layer;
        bool ffn;
    };
    std::vector<DenseMatrix> dense_matrices();
    // Held shared by a session's forward pass, exclusively while the layout changes.
    std::shared_mutex& layout_mutex() const { return layout_mutex_; }
    // Sessions bound to this model. The layout serves one session's needs only: with two or more, the
    // weights stay in rows (what every kernel reads).
    void attach_session() { sessions_++; }
    void detach_session() { sessions_--; }
    int attached_sessions() const { return sessions_.load(); }

private:
    mutable std::mutex down_nm_mutex_;
    mutable std::shared_mutex layout_mutex_;
    std::atomic<int> sessions_{0};
    mutable std::vector<std::unique_ptr<NeuronMajor>> down_nm_;
};

// How a session computes the FFN: dense, or skipping neurons whose activation is at most a per-layer
// threshold (zero thresholds on a ReLU-family model: exactly the dense result, faster).
struct SparsitySettings {
    bool enabled = false;
    bool on_product = false;
    std::vector<float> threshold;     // [n_layer]
    std::vector<float> neuron_scale;  // [n_layer][n_ff] or empty: weights of the gate criterion
    // The host's neuron-major down copies: grouped (lossless, about the matrix's size; Q4_0/Q4_1/Q4_K
    // only) or 8-bit rows (about twice a 4-bit matrix's size, and today the faster to sum).
    bool compact_down = false;
};

// The engine: a model bound to devices by a plan, its KV cache of n_seq sequence slots, and the
// scratch of the forward pass. decode() advances any mix of sequences in one step (each weight read
// once for all their tokens); eval() is the one-sequence form (sequence 0).
// Not thread-safe: use one Session per thread (they can share a Model).
class Session {
public:
    // kv_type: TYPE_F16 (as llama.cpp) or TYPE_F32 (exact, twice the memory), or TYPE_Q8_0 / TYPE_Q4_0
    // (half / a quarter of F16's bytes) for the keys; kv_type_v the values' (< 0: kv_type). n_ctx:
    // positions per sequence.
    Session(std::shared_ptr<Model> model, int32_t n_ctx, std::shared_ptr<ThreadPool> pool,
            int32_t kv_type = TYPE_F16, int32_t n_batch = 512, int32_t n_seq = 1,
            const PlanOptions* plan_options = nullptr, int32_t kv_type_v = -1);
    ~Session();

    // Appends n tokens to sequence 0 at positions n_past.. and runs them (in batches of n_batch). Writes
    // the logits of the last token to `logits` ([n_vocab]) or, with all_logits, of every token
    // ([n][n_vocab]). ContextOverflowError when the context cannot hold them.
    void eval(const int32_t* tokens, int32_t n, bool all_logits, float* logits);

    // One step over a batch: token t is tokens[t] of sequence seq[t] at position pos[t]; each sequence's
    // tokens in the batch have consecutive positions starting at most at its current length (a start
    // below it forgets what followed). Writes the logits of each token with want[t] != 0, in batch
    // order, to logits ([count][n_vocab]). Returns that count.
    int32_t decode(const int32_t* tokens, const int32_t* seq, const int32_t* pos, const uint8_t* want, int32_t n,
                   float* logits);

    // Appends n tokens to sequence `seq` (from its current length on) and writes each token's final hidden
    // state, the residual stream after the output norm (llama.cpp's embeddings), to hidden ([n][n_embd]).
    void hidden_states(const int32_t* tokens, int32_t n, int32_t seq, float* hidden);

    int32_t n_past() const { return kv_->seq_len(0); }
    int32_t n_ctx() const { return n_ctx_; }
    int32_t n_seq() const { return kv_->n_seq(); }
    // Forgets everything of sequence 0 after the first n positions (0 = reset).
    void truncate(int32_t n);  // sequence 0 to its first n positions (0: empty; a recorder then starts anew)
    KVCache& kv() { return *kv_; }
    // CPU attention offload: sequence s's KV cache moves to host memory (on_host) or back to the device,
    // and from the next step its attention runs on the host (see forward_offload.cpp).
    void place_seq(int32_t s, bool on_host) { kv_->place(s, on_host); }

    const Model& model() const { return *model_; }
    const Plan& plan() const { return plan_; }
    size_t kv_bytes() const;
    // Bytes allocated on the plan's device (0 without one), by use.
    std::vector<std::pair<std::string, size_t>> device_allocations() const;
    // Steps the device launched from a recording (Backend::replay): 0 without a device that records.
    int64_t recorded_steps() const { return device_ ? device_->recorded_launches() : 0; }
    // What the plan's device launched since the last reset, per layer and kind (Backend::launch_counts:
    // the CUDA backend counts; others report nothing), and its calls that enqueued work.
    std::vector<LaunchCount> launch_counts() const { return device_ ? device_->launch_counts() : std::vector<LaunchCount>{}; }
    int64_t host_launches() const { return device_ ? device_->host_launches() : 0; }
    void reset_launch_counts() {
        if (device_) device_->reset_launch_counts();
    }

    // Sparse FFN from the next eval on; ArgumentError for thresholds that do not fit the model.
    void set_sparsity(const SparsitySettings& s);
    // Which neuron-major down copies the sparse FFN uses (SparsitySettings::compact_down), whether or not
    // a sparsity criterion is set (predictors use them too); made now when either is in use.
    void set_compact_down(bool compact);
    const SparsitySettings& sparsity() const { return sparsity_; }
    // Per layer: FFN neurons computed and neuron slots seen (tokens x n_ff) since the last reset (a mixture
    // of experts: every slot counted computed, its experts run whole).
    std::vector<int64_t> ffn_active() const;
    const std::vector<int64_t>& ffn_seen() const { return ffn_seen_; }
    void reset_sparsity_counts();

    // Activation predictors (optiml/predictor.h) for the host's sparse FFN from the next eval on: gate,
    // up and down only for the neurons they predict active (with the sparsity criterion, when enabled,
    // applied to those; without it every predicted neuron counts). nullptr detaches. ArgumentError when
    // they do not fit the model.
    void set_predictors(std::shared_ptr<const Predictors> p);
    bool has_predictors() const { return predictors_ != nullptr; }
    // Predictors decide by groups of g consecutive neurons (FFNSparsity::group; 1: by neuron).
    void set_predictor_group(int32_t g);
    int32_t predictor_group() const { return predictor_group_; }
    // Whether the host reads its neurons of a placed file that kept its weights' order from copies in
    // the placed order (with predictors; LayerExec::host_placed): on (the default) costs the copies'
    // memory, off frees them and reads the file's rows where they are.
    void set_placed_copies(bool on);
    bool placed_copies() const { return placed_copies_; }
    // Layers whose FFN the host reads from such a copy, and the bytes of those copies.
    std::vector<int32_t> placed_copy_layers() const;
    size_t placed_copy_bytes() const;

    // Called between the n_batch-token pieces of a decode that has more pieces to run; it may throw to
    // stop there, the pieces run so far kept in the KV cache (the bindings raise Ctrl-C's KeyboardInterrupt
    // this way, so a long prompt stops within a piece). Empty: never called.
    void set_interrupt_check(std::function<void()> check) { interrupt_check_ = std::move(check); }

    // While a recorder is attached, every evaluated token's FFN activations go to it (the FFN runs
    // dense, on the host: ArgumentError when the plan puts any layer on a device). nullptr detaches.
    void set_recorder(std::shared_ptr<ActivationRecorder> rec);

    // The timeline of the steps run between the two calls: every span of the host (index 0) and of
    // the plan's device (index 1), in time order (see Backend::trace_start).
    struct TimedSpan {
        int32_t device;
        Span span;
    };
    void timeline_start();
    std::vector<TimedSpan> timeline_stop();

private:
    struct LayerExec;
    void forward(const int32_t* tokens, const BatchView& b, const int32_t* out_rows, int32_t n_out, float* logits);
    void forward_offload(const int32_t* tokens, const BatchView& b, const int32_t* out_rows, int32_t n_out,
                         float* logits);
    bool forward_recorded(const BatchView& kb, const int32_t* out_rows, int32_t n_out, float* logits);
    void write_hidden(int32_t n, float* hidden) const;
    // hidden_states: decode writes each piece's final states here (every forward leaves the residual on the host)
    float* hidden_out_ = nullptr;
    void output(Backend* home, int32_t n, const int32_t* out_rows, int32_t n_out, float* logits);
    void ffn_layer(int il, int32_t n, Backend* home, int32_t r0 = 0);
    void ffn_split_exact(int il, int32_t n, int32_t r0, Backend* home, const StepScratch& ds, const StepScratch& ks);
    void ffn_split_units(int il, int32_t n, int32_t r0, const FFNSparsity& sp, const StepScratch& ds,
                         const StepScratch& ks);
    void device_segment(const std::vector<int32_t>& key, int il, int64_t active, const std::function<void()>& enqueue);
    // device_segment's kinds of unit, and the longest step recorded (whole, or in units).
    enum {
        kSegmentAttention,       // a layer's attention
        kSegmentLayer,           // attention and FFN, both on the device
        kSegmentNorm,            // the FFN's norm and its copy to the host (ffn_split_units)
        kSegmentShare,           // the device's share of a sparse split
        kSegmentGateUp,          // the device's gate and up of a dense split, with their copies to the host
        kSegmentJoin,            // the host's FFN output to the device, joined into the residual
        kSegmentJoinSum,         // the same, summed with the device's share first (a sparse split)
        kSegmentShareFromHost,   // kSegmentShare with the input from the host and the output back
        kSegmentGateUpFromHost,  // kSegmentGateUp with the input from the host
    };
    static constexpr int32_t kMaxRecordedTokens = 16;  // beyond, launches are a small share of a step
    struct MoESplit;
    void moe_split(int il, int32_t n, Backend* home, int32_t r0);
    void alloc_moe_split();
    StepScratch scratch_rows(const Backend* be, int32_t r0) const;
    void trace_layer(int layer);
    void move(Backend* from, const float* src, Backend* to, float* dst, size_t n_floats);
    const StepScratch& scratch(const Backend* be) const;
    void bind_devices();
    void alloc_split_scratch();
    void prepare_sparse();
    void prepare_placed(int il);
    bool refresh_rows(std::unique_ptr<NeuronMajor>& nm, bool& made_compact, const Weight& down, const int32_t* rows,
                      int64_t n);
    bool reads_placed_copies() const;
    void free_placed();

    std::shared_ptr<Model> model_;
    std::shared_ptr<ThreadPool> pool_;
    int32_t n_ctx_, n_batch_;
    Plan plan_;
    std::unique_ptr<Backend> host_, device_;
    std::unique_ptr<KVCache> kv_;
    std::vector<LayerExec> exec_;
    std::vector<LayerWeights> device_layers_;  // uploaded attention weights (and norms) of device layers
    Weight rope_freqs_;  // model_->rope_freqs_for(n_ctx_)
    Weight device_rope_freqs_;
    Weight device_output_norm_, device_output_;  // with plan_.output_on_device
    float* device_logits_ = nullptr;             // [plan_.logits_rows][n_vocab] on the device
    StepScratch host_s_, device_s_;
    // Host memory (pinned for the device) where a split layer's device share sends its gate and up
    // products, [n_batch][k] each (ffn_layer: the host finishes the FFN as one device would).
    float *split_gate_ = nullptr, *split_up_ = nullptr;
    std::unique_ptr<MoESplit> moe_split_;  // with layers whose experts are split between the devices
    std::vector<int32_t> slot_buf_;  // the step's device KV slots, read by the device's queued ops
    bool whole_on_device_ = false;   // every layer (attention, KV, whole FFN) and the logits on the device
    std::vector<int32_t> step_key_;  // forward_recorded's key of the step
    bool segments_ = false;          // forward's step records the device's units (device_segment)
    bool in_segment_ = false;        // device_segment is enqueuing a unit
    bool staging_pinned_ = false;    // the host scratch and split staging are page-locked for the device
    std::vector<int32_t> off_tok_, off_seq_, off_slot_, off_pos_, off_rows_;  // forward_offload's reordered batch

    SparsitySettings sparsity_;
    std::vector<int64_t> host_active_, device_active_, ffn_seen_;
    std::shared_ptr<ActivationRecorder> recorder_;
    std::function<void()> interrupt_check_;
    std::shared_ptr<const Predictors> predictors_;
    int32_t predictor_group_ = 1;
    bool placed_copies_ = true;

    // The layout of the model's dense matrices (Model::set_rows16) follows this session's needs: rows16
    // where only this CPU's dense product reads a matrix, rows where anything else does. Placed before
    // the first step (not at construction, which the sparsity settings usually follow at once), and at
    // once wherever rows are needed now.
    void place_weights();
    bool weights_placed_ = false;
};

}  // namespace optiml
