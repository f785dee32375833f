// Model::load: hyper-parameters from `{arch}.*` metadata and every tensor bound by its llama.cpp
// name, with shapes and types checked before anything runs.
#include <algorithm>
#include <cmath>
#include <string>

#include "moe.h"
#include "optiml/common.h"
#include "optiml/model.h"
#include "optiml/plan.h"
#include "optiml/rows16.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

struct ArchInfo {
    const char* name;
    RopeType rope;
};

// Mistral files written by llama.cpp usually say "llama"; some converters write "mistral".
const ArchInfo kArchs[] = {
    {"llama", ROPE_NORM},
    {"mistral", ROPE_NORM},
    {"qwen2", ROPE_NEOX},
    {"gemma2", ROPE_NEOX},  // Gemma 3 without q/k norms, with soft-capped attention scores
    {"gemma3", ROPE_NEOX},
    {"qwen3", ROPE_NEOX},  // qwen2 without biases, with RMS norms over each head's q and k
    {"smollm3", ROPE_NORM},  // llama with every fourth layer without RoPE
    {"qwen3moe", ROPE_NEOX},  // mixtures of experts (moe.cpp), as is llama with experts (Mixtral)
    {"qwen2moe", ROPE_NEOX},
    {"gpt-oss", ROPE_NEOX},  // experts with biases and a clamped SwiGLU, attention sinks, YaRN (moe.cpp)
    {"phi3", ROPE_NEOX},  // q, k, v in one matrix, gate and up in one; LongRoPE's two factor lists
};

const ArchInfo* find_arch(const std::string& name) {
    for (const ArchInfo& a : kArchs)
        if (name == a.name) return &a;
    return nullptr;
}

int32_t positive_i32(const GGUFFile& f, const std::string& key, int64_t max = (int64_t)1 << 30) {
    const int64_t v = f.get_i64(key);
    if (v <= 0 || v > max)
        throw GGUFError(format("%s: metadata %s = %lld is out of range", f.path().c_str(), key.c_str(), (long long)v));
    return (int32_t)v;
}

// `{arch}.rope.scaling.*`: none, linear, or YaRN with llama.cpp's defaults (ext_factor 1, beta_fast 32,
// beta_slow 1, the training context as the original one).
void read_rope_scaling(const GGUFFile& f, HParams& hp) {
    const std::string p = hp.arch + ".";
    const std::string scaling = f.get_string(p + "rope.scaling.type", "none");
    const float factor = f.get_f32(p + "rope.scaling.factor", 0.0f);
    // (cos and sin grow by attn_factor whatever the scaling: Phi-3's LongRoPE; the original context chooses
    // between its long and short factors)
    hp.yarn_attn_factor = f.get_f32(p + "rope.scaling.attn_factor", 1.0f);
    hp.n_ctx_orig_yarn = f.has(p + "rope.scaling.original_context_length")
                             ? positive_i32(f, p + "rope.scaling.original_context_length")
                             : hp.n_ctx_train;
    if (!(hp.yarn_attn_factor > 0) || !std::isfinite(hp.yarn_attn_factor))
        throw GGUFError(format("%s: rope.scaling.attn_factor must be positive", f.path().c_str()));
    if (scaling == "linear" && factor > 0) {
        hp.rope_freq_scale = 1.0f / factor;
    } else if (f.has(p + "rope.scale_linear")) {  // older files
        hp.rope_freq_scale = 1.0f / f.get_f32(p + "rope.scale_linear");
    } else if (scaling == "yarn" && factor > 0) {
        hp.rope_freq_scale = 1.0f / factor;
        hp.yarn_ext_factor = f.get_f32(p + "rope.scaling.yarn_ext_factor", -1.0f);
        if (hp.yarn_ext_factor < 0) hp.yarn_ext_factor = 1.0f;  // llama.cpp: negative means not set
        hp.yarn_attn_factor *= f.get_f32(p + "rope.scaling.yarn_attn_factor", 1.0f);
        hp.yarn_beta_fast = f.get_f32(p + "rope.scaling.yarn_beta_fast", 32.0f);
        hp.yarn_beta_slow = f.get_f32(p + "rope.scaling.yarn_beta_slow", 1.0f);
        if (f.get_f32(p + "rope.scaling.yarn_log_multiplier", 0.0f) != 0.0f)
            throw UnsupportedModelError(format("%s: YaRN with rope.scaling.yarn_log_multiplier (DeepSeek's) is not "
                                               "supported", f.path().c_str()));
        if (!std::isfinite(hp.yarn_ext_factor) || !(hp.yarn_attn_factor > 0) || !std::isfinite(hp.yarn_beta_fast) ||
            !std::isfinite(hp.yarn_beta_slow))
            throw GGUFError(format("%s: the YaRN metadata (rope.scaling.yarn_*) is out of range", f.path().c_str()));
    } else if (scaling != "none" && scaling != "linear" && factor > 1.0f) {
        throw UnsupportedModelError(format("%s: rope scaling '%s' is not supported (none, linear and yarn are)",
                                           f.path().c_str(), scaling.c_str()));
    }
}

// Every pattern-th layer global, the others sliding-window (llama.cpp's set_swa_pattern).
void set_swa_pattern(HParams& hp, int pattern) {
    hp.swa_layer.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) hp.swa_layer[il] = il % pattern < pattern - 1;
}

// The scalings, soft-caps and sliding windows of the architectures that have them (gpt-oss, Gemma 2 and 3).
void read_attention_variant(const GGUFFile& f, HParams& hp) {
    const std::string p = hp.arch + ".";
    hp.attn_kq_scale = 1.0f / std::sqrt((float)hp.head_dim);
    if (hp.arch == "gpt-oss") {
        // As llama.cpp builds gpt-oss: every even layer attends to a window of sliding_window positions, with
        // the same RoPE (and YaRN) as the others.
        hp.n_swa = positive_i32(f, p + "attention.sliding_window");
        set_swa_pattern(hp, 2);
        hp.rope_freq_base_swa = f.get_f32(p + "rope.freq_base_swa", hp.rope_freq_base);
        hp.rope_freq_scale_swa = hp.rope_freq_scale;
        if (!(hp.rope_freq_base_swa > 0))
            throw GGUFError(format("%s: rope.freq_base_swa must be positive", f.path().c_str()));
    }
    if (hp.arch == "gemma2") {
        // As llama.cpp builds Gemma 2: embeddings times sqrt(n_embd); q scaled by 1/sqrt(head_dim)
        // (1/sqrt(n_embd/n_head) for the 46-layer 27B) and the scores not scaled again but soft-capped
        // (50 unless the file says); every other layer, the first included, sliding-window (4096 positions
        // unless the file says) with the global layers' RoPE; logits soft-capped (30 unless the file says).
        hp.embd_scale = std::sqrt((float)hp.n_embd);
        hp.attn_q_scale = hp.n_layer == 46 ? 1.0f / std::sqrt((float)(hp.n_embd / hp.n_head))
                                           : 1.0f / std::sqrt((float)hp.head_dim);
        hp.attn_kq_scale = 1.0f;
        hp.attn_softcap = f.get_f32(p + "attn_logit_softcapping", 50.0f);
        hp.final_softcap = f.get_f32(p + "final_logit_softcapping", 30.0f);
        hp.n_swa = f.has(p + "attention.sliding_window") ? positive_i32(f, p + "attention.sliding_window") : 4096;
        set_swa_pattern(hp, f.has(p + "attention.sliding_window_pattern")
                                ? positive_i32(f, p + "attention.sliding_window_pattern", 4096)
                                : 2);
        hp.rope_freq_base_swa = f.get_f32(p + "rope.freq_base_swa", hp.rope_freq_base);
        hp.rope_freq_scale_swa = hp.rope_freq_scale;
        if (!(hp.attn_softcap > 0) || !(hp.final_softcap > 0) || !(hp.rope_freq_base_swa > 0))
            throw GGUFError(format("%s: attn_logit_softcapping, final_logit_softcapping and rope.freq_base_swa "
                                   "must be positive", f.path().c_str()));
    }
    if (hp.arch == "gemma3") {
        // As llama.cpp builds Gemma 3: embeddings times sqrt(n_embd); q scaled by 1/sqrt(head_dim)
        // (1/sqrt(n_embd/n_head) for the 62-layer 27B, whose query_pre_attn_scalar says so) and the
        // scores not scaled again; every 6th layer global, the others sliding-window with their own
        // RoPE base (10000 unless the file says) and no RoPE scaling.
        hp.embd_scale = std::sqrt((float)hp.n_embd);
        hp.attn_q_scale = hp.n_layer == 62 ? 1.0f / std::sqrt((float)(hp.n_embd / hp.n_head))
                                           : 1.0f / std::sqrt((float)hp.head_dim);
        hp.attn_kq_scale = 1.0f;
        hp.n_swa = f.has(p + "attention.sliding_window") ? positive_i32(f, p + "attention.sliding_window") : 0;
        if (hp.n_swa > 0)
            set_swa_pattern(hp, f.has(p + "attention.sliding_window_pattern")
                                    ? positive_i32(f, p + "attention.sliding_window_pattern", 4096)
                                    : 6);
        hp.rope_freq_base_swa = f.get_f32(p + "rope.freq_base_swa", 10000.0f);
        hp.rope_freq_scale_swa = 1.0f;
        hp.final_softcap = f.get_f32(p + "final_logit_softcapping", 0.0f);
        if (!(hp.rope_freq_base_swa > 0) || hp.final_softcap < 0)
            throw GGUFError(format("%s: rope.freq_base_swa must be positive and final_logit_softcapping not "
                                   "negative", f.path().c_str()));
    }
}

HParams read_hparams(const GGUFFile& f) {
    HParams hp;
    // A split GGUF (llama.cpp's gguf-split: NAME-00001-of-00003.gguf) keeps the metadata in the first part and
    // spreads the tensors over all of them; this loader maps one file, so say so rather than miss a tensor.
    if (f.has("split.count") && f.get_i64("split.count") > 1)
        throw UnsupportedModelError(format(
            "%s is part %lld of a GGUF split into %lld files; OptiML loads single-file GGUFs: merge the parts "
            "first (llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf) or choose an unsplit quantization",
            f.path().c_str(), (long long)(f.has("split.no") ? f.get_i64("split.no") + 1 : 1),
            (long long)f.get_i64("split.count")));
    hp.arch = f.get_string("general.architecture");
    const ArchInfo* arch = find_arch(hp.arch);
    if (!arch)
        throw UnsupportedModelError(format("%s: architecture %s is not supported (supported: %s)",
                                           f.path().c_str(), gguf_quote(hp.arch).c_str(), supported_architectures()));
    const std::string p = hp.arch + ".";
    hp.n_embd = positive_i32(f, p + "embedding_length");
    hp.n_layer = positive_i32(f, p + "block_count", 4096);
    // (a mixture of experts may give only its experts' width: read_moe_hparams)
    hp.n_ff = f.has(p + "feed_forward_length") || !f.has(p + "expert_count") ? positive_i32(f, p + "feed_forward_length")
                                                                             : 0;
    hp.n_head = positive_i32(f, p + "attention.head_count", 4096);
    hp.n_head_kv = f.has(p + "attention.head_count_kv") ? positive_i32(f, p + "attention.head_count_kv", 4096)
                                                          : hp.n_head;
    hp.n_ctx_train = f.has(p + "context_length") ? positive_i32(f, p + "context_length") : 2048;
    if (hp.n_head % hp.n_head_kv != 0)
        throw GGUFError(format("%s: %d attention heads cannot share %d KV heads evenly", f.path().c_str(),
                               hp.n_head, hp.n_head_kv));
    hp.head_dim = f.has(p + "attention.key_length") ? positive_i32(f, p + "attention.key_length", 65536)
                                                    : hp.n_embd / hp.n_head;
    if (f.has(p + "attention.value_length") && positive_i32(f, p + "attention.value_length", 65536) != hp.head_dim)
        throw UnsupportedModelError(format("%s: key and value head sizes differ; not supported", f.path().c_str()));
    if (hp.head_dim > 512)
        throw UnsupportedModelError(format("%s: head size %d is larger than the 512 this build supports",
                                           f.path().c_str(), hp.head_dim));
    hp.n_rot = f.has(p + "rope.dimension_count") ? positive_i32(f, p + "rope.dimension_count", 65536) : hp.head_dim;
    if (hp.n_rot > hp.head_dim || hp.n_rot % 2)
        throw GGUFError(format("%s: rope.dimension_count %d does not fit head size %d", f.path().c_str(), hp.n_rot,
                               hp.head_dim));
    hp.rms_eps = f.get_f32(p + "attention.layer_norm_rms_epsilon", 1e-5f);
    hp.rope_freq_base = f.get_f32(p + "rope.freq_base", 10000.0f);
    hp.rope_type = arch->rope;

    read_rope_scaling(f, hp);
    if (!(hp.rope_freq_base > 0) || !(hp.rope_freq_scale > 0) || !(hp.rms_eps > 0))
        throw GGUFError(format("%s: rope freq base/scale and RMS epsilon must be positive", f.path().c_str()));

    const bool gemma = hp.arch == "gemma2" || hp.arch == "gemma3";
    const std::string act = f.get_string("optiml.ffn.activation",
                                         gemma ? "gelu" : hp.arch == "gpt-oss" ? "swiglu_oai" : "silu");
    if (act == "silu") hp.ffn_act = FFN_SILU;
    else if (act == "relu") hp.ffn_act = FFN_RELU;
    else if (act == "gelu") hp.ffn_act = FFN_GELU;
    else if (act == "relu2") hp.ffn_act = FFN_RELU2;
    else if (act == "swiglu_oai") hp.ffn_act = FFN_SWIGLU_OAI;
    else
        throw UnsupportedModelError(format("%s: FFN activation '%s' is not supported (silu, relu, relu2, gelu, swiglu_oai)",
                                           f.path().c_str(), act.c_str()));

    read_moe_hparams(f, hp);
    if (hp.arch == "smollm3") hp.no_rope_step = 4;  // (llama.cpp's graph fixes it; the file says nothing)

    read_attention_variant(f, hp);
    hp.pooling_type = f.has(p + "pooling_type") ? (int32_t)f.get_i64(p + "pooling_type") : -1;
    if (hp.pooling_type < -1 || hp.pooling_type > 4)
        throw GGUFError(format("%s: pooling_type %d is not one of llama.cpp's (0-4)", f.path().c_str(), hp.pooling_type));
    return hp;
}

// `optiml.sparsity.*`: written by `optiml calibrate`; checked here so a bad file fails at load.
SparsityConfig read_sparsity(const GGUFFile& f, const HParams& hp) {
    SparsityConfig sc;
    if (!f.has("optiml.sparsity.threshold")) return sc;
    const std::vector<float> thr = f.get_f32_array("optiml.sparsity.threshold");
    if ((int64_t)thr.size() != hp.n_layer)
        throw GGUFError(format("%s: optiml.sparsity.threshold has %zu values for %d layers", f.path().c_str(),
                               thr.size(), hp.n_layer));
    for (float t : thr)
        if (!(t >= 0) || !std::isfinite(t))
            throw GGUFError(format("%s: optiml.sparsity.threshold holds %g; thresholds must be finite and >= 0",
                                   f.path().c_str(), t));
    const std::string crit = f.get_string("optiml.sparsity.criterion", "gate");
    if (crit != "gate" && crit != "product")
        throw GGUFError(format("%s: optiml.sparsity.criterion is '%s' (gate or product)", f.path().c_str(),
                               crit.c_str()));
    if (f.has("optiml.sparsity.neuron_scale")) {
        sc.neuron_scale = f.get_f32_array("optiml.sparsity.neuron_scale");
        if ((int64_t)sc.neuron_scale.size() != (int64_t)hp.n_layer * hp.n_ff)
            throw GGUFError(format("%s: optiml.sparsity.neuron_scale has %zu values; expected n_layer * n_ff = %lld",
                                   f.path().c_str(), sc.neuron_scale.size(), (long long)hp.n_layer * hp.n_ff));
        for (float v : sc.neuron_scale)
            if (!(v >= 0) || !std::isfinite(v))
                throw GGUFError(format("%s: optiml.sparsity.neuron_scale holds %g; must be finite and >= 0",
                                       f.path().c_str(), v));
    }
    sc.calibrated = true;
    sc.on_product = crit == "product";
    sc.threshold = thr;
    sc.target = f.get_f32("optiml.sparsity.target", 0.0f);
    return sc;
}

// `optiml.placement.*`: written by `optiml solve`; checked here so a bad file fails at load.
void read_placement(const GGUFFile& f, const HParams& hp, std::vector<int32_t>& gpu_neurons,
                    std::vector<int32_t>& gpu_attention, std::vector<int32_t>& order) {
    if (f.has("optiml.placement.gpu_attention")) {
        gpu_attention = f.get_i32_array("optiml.placement.gpu_attention");
        if (gpu_attention.size() != (size_t)hp.n_layer)
            throw GGUFError(format("%s: optiml.placement.gpu_attention has %zu values for %d layers",
                                   f.path().c_str(), gpu_attention.size(), hp.n_layer));
        for (int32_t v : gpu_attention)
            if (v != 0 && v != 1)
                throw GGUFError(format("%s: optiml.placement.gpu_attention holds %d; expected 0 or 1 per layer",
                                       f.path().c_str(), v));
    }
    if (f.has("optiml.placement.gpu_neurons")) {
        gpu_neurons = f.get_i32_array("optiml.placement.gpu_neurons");
        if (gpu_neurons.size() != (size_t)hp.n_layer)
            throw GGUFError(format("%s: optiml.placement.gpu_neurons has %zu values for %d layers", f.path().c_str(),
                                   gpu_neurons.size(), hp.n_layer));
        for (int32_t k : gpu_neurons)
            if (k < 0 || k > hp.n_ff)
                throw GGUFError(format("%s: optiml.placement.gpu_neurons holds %d, outside [0, %d]", f.path().c_str(),
                                       k, hp.n_ff));
    }
    if (f.has("optiml.placement.neuron_order")) {
        order = f.get_i32_array("optiml.placement.neuron_order");
        if (order.size() != (size_t)hp.n_layer * hp.n_ff)
            throw GGUFError(format("%s: optiml.placement.neuron_order has %zu values; expected n_layer * n_ff = %lld",
                                   f.path().c_str(), order.size(), (long long)hp.n_layer * hp.n_ff));
        std::vector<uint8_t> seen(hp.n_ff);
        for (int il = 0; il < hp.n_layer; il++) {
            std::fill(seen.begin(), seen.end(), 0);
            for (int32_t i = 0; i < hp.n_ff; i++) {
                const int32_t j = order[(size_t)il * hp.n_ff + i];
                if (j < 0 || j >= hp.n_ff || seen[j]++)
                    throw GGUFError(format("%s: optiml.placement.neuron_order of layer %d is not a permutation of "
                                           "0..%d", f.path().c_str(), il, hp.n_ff - 1));
            }
        }
    }
}

// `optiml.placement.gpu_experts` (optiml solve, mixtures of experts): each layer's list of experts for the
// GPU, hottest first, concatenated; `optiml.placement.gpu_expert_count` says how many are each layer's.
void read_expert_placement(const GGUFFile& f, const HParams& hp, std::vector<std::vector<int32_t>>& lists) {
    const bool has_ids = f.has("optiml.placement.gpu_experts"), has_count = f.has("optiml.placement.gpu_expert_count");
    if (!has_ids && !has_count) return;
    if (has_ids != has_count)
        throw GGUFError(format("%s: optiml.placement.gpu_experts and gpu_expert_count go together; the file has one",
                               f.path().c_str()));
    const std::vector<int32_t> ids = f.get_i32_array("optiml.placement.gpu_experts");
    const std::vector<int32_t> count = f.get_i32_array("optiml.placement.gpu_expert_count");
    if (count.size() != (size_t)hp.n_layer)
        throw GGUFError(format("%s: optiml.placement.gpu_expert_count has %zu values for %d layers", f.path().c_str(),
                               count.size(), hp.n_layer));
    size_t at = 0;
    for (int32_t c : count) {
        if (c < 0 || at + c > ids.size())
            throw GGUFError(format("%s: optiml.placement.gpu_expert_count does not add up to the %zu experts of "
                                   "optiml.placement.gpu_experts", f.path().c_str(), ids.size()));
        lists.emplace_back(ids.begin() + at, ids.begin() + at + c);
        at += c;
    }
    if (at != ids.size())
        throw GGUFError(format("%s: optiml.placement.gpu_expert_count adds up to %zu of the %zu experts of "
                               "optiml.placement.gpu_experts", f.path().c_str(), at, ids.size()));
    const std::string why = expert_lists_error(hp, lists);
    if (!why.empty()) throw GGUFError(format("%s: optiml.placement.gpu_experts: %s", f.path().c_str(), why.c_str()));
}

class Binder {
public:
    explicit Binder(const GGUFFile& f) : f_(f) {}

    // A matrix [cols -> rows] whose type has dot-product kernels.
    Weight matrix(const std::string& name, int64_t cols, int64_t rows, bool required = true) const {
        Weight w = bind(name, required);
        if (!w.present()) return w;
        if (w.cols != cols || w.rows != rows)
            throw GGUFError(format("%s: tensor %s has shape [%lld, %lld], expected [%lld, %lld]", f_.path().c_str(),
                                   name.c_str(), (long long)w.cols, (long long)w.rows, (long long)cols,
                                   (long long)rows));
        try {
            check_matmul_args(w.type, w.cols);
        } catch (const ArgumentError& e) {
            throw UnsupportedModelError(format("%s: tensor %s: %s", f_.path().c_str(), name.c_str(), e.what()));
        }
        return w;
    }

    // Rows [r0, r0 + n) of a matrix bound above: the parts of a fused matrix (Phi-3's q, k, v; gate, up).
    static Weight rows(const Weight& w, int64_t r0, int64_t n) {
        Weight part = w;
        part.data = w.data + r0 * w.row_bytes;
        part.rows = n;
        return part;
    }

    // An F32 vector of n (norm scales, biases).
    Weight vector(const std::string& name, int64_t n, bool required = true) const {
        Weight w = bind(name, required);
        if (!w.present()) return w;
        if (w.type != TYPE_F32 || w.cols != n || w.rows != 1)
            throw UnsupportedModelError(format("%s: tensor %s must be F32 of %lld values (it is %s [%lld, %lld])",
                                               f_.path().c_str(), name.c_str(), (long long)n,
                                               type_traits(w.type).name, (long long)w.cols, (long long)w.rows));
        return w;
    }

private:
    Weight bind(const std::string& name, bool required) const {
        Weight w;
        const GGUFTensorInfo* t = f_.find_tensor(name);
        if (!t) {
            if (required) throw GGUFError(format("%s: tensor %s is missing", f_.path().c_str(), name.c_str()));
            return w;
        }
        if (t->ne[2] != 1 || t->ne[3] != 1)
            throw GGUFError(format("%s: tensor %s has more than 2 dimensions", f_.path().c_str(), name.c_str()));
        w.name = t->name.c_str();
        w.type = t->type;
        w.cols = t->ne[0];
        w.rows = t->ne[1];
        w.data = (const uint8_t*)f_.tensor_data(*t);
        w.row_bytes = row_size(t->type, t->ne[0]);
        return w;
    }

    const GGUFFile& f_;
};

}  // namespace

const char* supported_architectures() {
    return "llama, mistral, qwen2, qwen3, gemma2, gemma3, smollm3, phi3, qwen3moe, qwen2moe, gpt-oss, "
           "llama with experts (Mixtral)";
}

const char* ffn_activation_name(FFNActivation act) {
    switch (act) {
        case FFN_SILU: return "silu";
        case FFN_RELU: return "relu";
        case FFN_GELU: return "gelu";
        case FFN_RELU2: return "relu2";
        case FFN_SWIGLU_OAI: return "swiglu_oai";
    }
    return "?";
}

// q, k and v: three matrices, or one (attn_qkv, as Phi-3 stores them) whose rows are q's, k's, then v's.
static void bind_qkv(const Binder& b, const HParams& hp, const std::string& p, LayerWeights& L) {
    const Weight qkv = b.matrix(p + "attn_qkv.weight", hp.n_embd, hp.n_embd_q() + 2 * hp.n_embd_kv(), false);
    if (!qkv.present()) {
        L.wq = b.matrix(p + "attn_q.weight", hp.n_embd, hp.n_embd_q());
        L.wk = b.matrix(p + "attn_k.weight", hp.n_embd, hp.n_embd_kv());
        L.wv = b.matrix(p + "attn_v.weight", hp.n_embd, hp.n_embd_kv());
        return;
    }
    L.wq = Binder::rows(qkv, 0, hp.n_embd_q());
    L.wk = Binder::rows(qkv, hp.n_embd_q(), hp.n_embd_kv());
    L.wv = Binder::rows(qkv, hp.n_embd_q() + hp.n_embd_kv(), hp.n_embd_kv());
}

// gate and up: two matrices, or for Phi-3 one ffn_up of 2 n_ff rows, the gate's then the up's (llama.cpp's
// swiglu on the fused product).
static void bind_gate_up(const Binder& b, const HParams& hp, const std::string& p, FFNWeights& ffn) {
    if (hp.arch != "phi3") {
        ffn.gate = b.matrix(p + "ffn_gate.weight", hp.n_embd, hp.n_ff);
        ffn.up = b.matrix(p + "ffn_up.weight", hp.n_embd, hp.n_ff);
        return;
    }
    const Weight fused = b.matrix(p + "ffn_up.weight", hp.n_embd, 2 * (int64_t)hp.n_ff);
    ffn.gate = Binder::rows(fused, 0, hp.n_ff);
    ffn.up = Binder::rows(fused, hp.n_ff, hp.n_ff);
}

std::shared_ptr<Model> Model::load(std::shared_ptr<GGUFFile> file) {
    auto model = std::make_shared<Model>();
    Model& M = *model;
    M.file = file;
    const GGUFFile& f = *file;
    HParams& hp = M.hp;
    hp = read_hparams(f);
    Binder b(f);

    const GGUFTensorInfo* emb = f.find_tensor("token_embd.weight");
    if (!emb) throw GGUFError(format("%s: tensor token_embd.weight is missing", f.path().c_str()));
    hp.n_vocab = (int32_t)emb->ne[1];
    M.tok_embd = b.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
    if (!can_dequantize(M.tok_embd.type))
        throw UnsupportedModelError(format("%s: token_embd.weight of type %s cannot be dequantized",
                                           f.path().c_str(), type_traits(M.tok_embd.type).name));
    M.output_norm = b.vector("output_norm.weight", hp.n_embd);
    M.output = b.matrix("output.weight", hp.n_embd, hp.n_vocab, /*required=*/false);
    if (!M.output.present()) M.output = M.tok_embd;  // tied embeddings
    M.rope_freqs = b.vector("rope_freqs.weight", hp.n_rot / 2, /*required=*/false);
    M.rope_long = b.vector("rope_factors_long.weight", hp.n_rot / 2, /*required=*/false);
    M.rope_short = b.vector("rope_factors_short.weight", hp.n_rot / 2, /*required=*/false);
    if (M.rope_long.present() != M.rope_short.present())
        throw GGUFError(format("%s: rope_factors_long.weight and rope_factors_short.weight come together",
                               f.path().c_str()));

    M.layers.resize(hp.n_layer);
    for (int i = 0; i < hp.n_layer; i++) {
        LayerWeights& L = M.layers[i];
        const std::string p = "blk." + std::to_string(i) + ".";
        L.attn_norm = b.vector(p + "attn_norm.weight", hp.n_embd);
        bind_qkv(b, hp, p, L);
        L.wo = b.matrix(p + "attn_output.weight", hp.n_embd_q(), hp.n_embd);
        L.bq = b.vector(p + "attn_q.bias", hp.n_embd_q(), false);
        L.bk = b.vector(p + "attn_k.bias", hp.n_embd_kv(), false);
        L.bv = b.vector(p + "attn_v.bias", hp.n_embd_kv(), false);
        L.bo = b.vector(p + "attn_output.bias", hp.n_embd, false);
        // gpt-oss names its FFN's input norm post_attention_norm (the norm after the attention's residual add).
        const bool gpt_oss = hp.arch == "gpt-oss";
        L.ffn.norm = b.vector(p + (gpt_oss ? "post_attention_norm.weight" : "ffn_norm.weight"), hp.n_embd);
        L.attn_sinks = b.vector(p + "attn_sinks.weight", hp.n_head, gpt_oss);
        if (hp.is_moe()) {
            bind_moe_layer(f, hp, i, L);
        } else {
            bind_gate_up(b, hp, p, L.ffn);
            L.ffn.down = b.matrix(p + "ffn_down.weight", hp.n_ff, hp.n_embd);
            L.ffn.gate_b = b.vector(p + "ffn_gate.bias", hp.n_ff, false);
            L.ffn.up_b = b.vector(p + "ffn_up.bias", hp.n_ff, false);
            L.ffn.down_b = b.vector(p + "ffn_down.bias", hp.n_embd, false);
        }
        // (post-norms are part of Gemma 2 and 3, q/k norms of Gemma 3 and Qwen3; absent elsewhere)
        const bool gemma = hp.arch == "gemma2" || hp.arch == "gemma3";
        const bool qk_norm = hp.arch == "gemma3" || hp.arch == "qwen3" || hp.arch == "qwen3moe";
        L.q_norm = b.vector(p + "attn_q_norm.weight", hp.head_dim, qk_norm);
        L.k_norm = b.vector(p + "attn_k_norm.weight", hp.head_dim, qk_norm);
        if (!gpt_oss) L.attn_post_norm = b.vector(p + "post_attention_norm.weight", hp.n_embd, gemma);
        L.ffn.post_norm = b.vector(p + "post_ffw_norm.weight", hp.n_embd, gemma);
    }
    M.sparsity = read_sparsity(f, hp);
    read_placement(f, hp, M.placement_gpu_neurons, M.placement_gpu_attention, M.placement_order);
    if (f.has("optiml.placement.order")) M.placement_order_name = f.get_string("optiml.placement.order");
    read_expert_placement(f, hp, M.placement_gpu_experts);
    return model;
}

const NeuronMajor& Model::down_neuron_major(ThreadPool& pool, int il, bool compact) const {
    std::lock_guard<std::mutex> lock(down_nm_mutex_);
    if (down_nm_.empty()) down_nm_.resize(layers.size());
    const WeightMatrix down = layers[il].ffn.down.matrix();
    const bool want_grouped = compact && can_group_neuron_major(down.type, down.rows);
    if (!down_nm_[il] || down_nm_[il]->grouped != want_grouped) {
        down_nm_[il].reset();  // the old copy goes first: never both at once
        down_nm_[il] = std::make_unique<NeuronMajor>(compact ? neuron_major_copy(pool, down)
                                                             : repack_neuron_major(pool, down, TYPE_Q8_0));
    }
    return *down_nm_[il];
}

void Weight::dequantize_row_to(int64_t r, float* out) const {
    if (rows16) dequantize_rows16_row(type, data, r, cols, out);
    else dequantize_row(type, row(r), out, cols);
}

std::vector<Model::DenseMatrix> Model::dense_matrices() {
    std::vector<DenseMatrix> out;
    for (int il = 0; il < (int)layers.size(); il++) {
        LayerWeights& L = layers[il];
        for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo}) out.push_back({w, il, false});
        for (Weight* w : {&L.ffn.gate, &L.ffn.up, &L.ffn.down}) out.push_back({w, il, true});
    }
    out.push_back({&output, -1, false});
    return out;
}

void Model::set_rows16(ThreadPool& pool, const std::function<bool(const Weight& w, int layer, bool ffn)>& want) {
    if (!file->mapping()->in_memory()) return;  // a mapping is read-only (and shared with the page cache)
    std::unique_lock<std::shared_mutex> lock(layout_mutex_);
    auto place = [&](Weight& w, bool to_rows16) {
        if (!w.present() || !rows16_fits(w.type, w.rows, w.cols)) return;
        if (w.rows16 == to_rows16) return;
        // The bytes are the private copy the model owns (in_memory), so they may be rewritten.
        uint8_t* data = const_cast<uint8_t*>(w.data);
        if (to_rows16) repack_rows16(w.type, data, w.rows, w.cols, &pool);
        else unpack_rows16(w.type, data, w.rows, w.cols, &pool);
        w.rows16 = to_rows16;
    };
    for (const DenseMatrix& m : dense_matrices()) place(*m.w, want(*m.w, m.layer, m.ffn));
    const bool tied = output.data == tok_embd.data;
    if (tied) tok_embd.rows16 = output.rows16;  // the same bytes
    else place(tok_embd, false);  // only the lookup reads it: nothing to gain
}

size_t Model::weight_bytes() const {
    size_t n = 0;
    for (const GGUFTensorInfo& t : file->tensors()) n += t.n_bytes;
    return n;
}

}  // namespace optiml
