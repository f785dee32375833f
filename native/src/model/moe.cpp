// Mixture-of-experts layers read from llama.cpp's GGUF layout, with llama.cpp's meaning per architecture
// (src/llama-model.cpp, build_moe_ffn in src/llama-graph.cpp):
//   qwen3moe  softmax over the experts, top k, the k weights renormalized (norm_topk_prob);
//   qwen2moe  softmax, top k, not renormalized, plus a shared expert of expert_shared_feed_forward_length
//             neurons scaled by sigmoid(ffn_gate_inp_shexp . x);
//   llama     with llama.expert_count > 0 (Mixtral): softmax, top k, renormalized (the same as the top k
//             logits' softmax, as Mixtral's paper writes it);
//   gpt-oss   the router and every expert product with a bias; top k of the logits, then the softmax of
//             those k; the experts' activation a clamped SwiGLU (FFN_SWIGLU_OAI).
// `{arch}.expert_weights_norm` and `{arch}.expert_weights_scale`, where a file has them, override the
// architecture's default. The CPU kernel that runs a layer is native/src/cpu/moe_ffn.cpp.
#include "moe.h"

#include <cmath>
#include <string>

#include "optiml/common.h"
#include "optiml/matmul.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

constexpr int64_t kMaxExperts = 4096;

std::string dims(const GGUFTensorInfo& t) {
    std::string s = "[";
    for (uint32_t i = 0; i < (t.n_dims ? t.n_dims : 1); i++) s += (i ? ", " : "") + std::to_string(t.ne[i]);
    return s + "]";
}

// The weight type must have dot-product kernels for rows of `cols`.
void check_type(const GGUFFile& f, const GGUFTensorInfo& t, int64_t cols) {
    try {
        check_matmul_args(t.type, cols);
    } catch (const ArgumentError& e) {
        throw UnsupportedModelError(format("%s: tensor %s: %s", f.path().c_str(), t.name.c_str(), e.what()));
    }
}

const GGUFTensorInfo& need(const GGUFFile& f, const std::string& name, const char* why) {
    const GGUFTensorInfo* t = f.find_tensor(name);
    if (!t) throw GGUFError(format("%s: tensor %s is missing (%s)", f.path().c_str(), name.c_str(), why));
    return *t;
}

// A matrix [cols -> rows] (rows == 1 also takes a 1-D tensor of cols values).
Weight matrix(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows, const char* why) {
    const GGUFTensorInfo& t = need(f, name, why);
    if (t.ne[0] != cols || t.ne[1] != rows || t.ne[2] != 1 || t.ne[3] != 1)
        throw GGUFError(format("%s: tensor %s has shape %s, expected [%lld, %lld]", f.path().c_str(), name.c_str(),
                               dims(t).c_str(), (long long)cols, (long long)rows));
    check_type(f, t, cols);
    Weight w;
    w.name = t.name.c_str();
    w.type = t.type;
    w.cols = cols;
    w.rows = rows;
    w.data = (const uint8_t*)f.tensor_data(t);
    w.row_bytes = row_size(t.type, cols);
    return w;
}

// A 3-D expert tensor of n_expert matrices [cols -> rows].
ExpertWeights experts(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows, int64_t n_expert,
                      const char* what) {
    const GGUFTensorInfo* t = f.find_tensor(name);
    if (!t) {
        // Mixtral files from before llama.cpp merged the experts (early 2024) hold one tensor per expert.
        std::string old = name;
        old.replace(old.find("_exps.weight"), std::string("_exps.weight").size(), ".0.weight");
        if (f.find_tensor(old))
            throw UnsupportedModelError(format(
                "%s holds one tensor per expert (%s ...), the layout of GGUFs from before llama.cpp merged them "
                "into 3-D tensors (%s); convert or re-quantize the model with a current llama.cpp",
                f.path().c_str(), old.c_str(), name.c_str()));
        throw GGUFError(format("%s: tensor %s is missing (the layer's %s)", f.path().c_str(), name.c_str(), what));
    }
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != n_expert || t->ne[3] != 1)
        throw GGUFError(format("%s: tensor %s has shape %s, expected [%lld, %lld, %lld] (%s of %lld experts: the "
                               "metadata's expert_count and feed-forward lengths and the tensor disagree)",
                               f.path().c_str(), name.c_str(), dims(*t).c_str(), (long long)cols, (long long)rows,
                               (long long)n_expert, what, (long long)n_expert));
    check_type(f, *t, cols);
    ExpertWeights e;
    e.name = t->name.c_str();
    e.type = t->type;
    e.cols = cols;
    e.rows = rows;
    e.n_expert = n_expert;
    e.data = (const uint8_t*)f.tensor_data(*t);
    e.row_bytes = row_size(t->type, cols);
    e.expert_bytes = e.row_bytes * (size_t)rows;
    return e;
}

// An optional F32 bias [cols] x rows (a router's, or one row per expert).
Weight bias(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows) {
    const GGUFTensorInfo* t = f.find_tensor(name);
    if (!t) return Weight();
    if (t->type != TYPE_F32 || t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        throw GGUFError(format("%s: tensor %s is %s %s, expected F32 [%lld, %lld]", f.path().c_str(), name.c_str(),
                               type_traits(t->type).name, dims(*t).c_str(), (long long)cols, (long long)rows));
    Weight w;
    w.name = t->name.c_str();
    w.type = TYPE_F32;
    w.cols = cols;
    w.rows = rows;
    w.data = (const uint8_t*)f.tensor_data(*t);
    w.row_bytes = sizeof(float) * cols;
    return w;
}

int64_t positive(const GGUFFile& f, const std::string& key, int64_t max) {
    const int64_t v = f.get_i64(key);
    if (v <= 0 || v > max)
        throw GGUFError(format("%s: metadata %s = %lld is out of range (1..%lld)", f.path().c_str(), key.c_str(),
                               (long long)v, (long long)max));
    return v;
}

}  // namespace

bool is_moe_arch(const std::string& arch) { return arch == "qwen3moe" || arch == "qwen2moe" || arch == "gpt-oss"; }

void read_moe_hparams(const GGUFFile& f, HParams& hp) {
    const std::string p = hp.arch + ".";
    const char* path = f.path().c_str();
    const bool moe_arch = is_moe_arch(hp.arch);
    // A llama file with Mixtral's expert tensors but no expert count would otherwise be read as dense and fail
    // on a missing FFN tensor: the expert tensors are named instead.
    auto dense_with_experts = [&](const char* why) {
        for (const char* name : {"blk.0.ffn_up_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"})
            if (f.find_tensor(name))
                throw GGUFError(format("%s: the file has expert tensors (%s), but %s: a mixture of experts needs "
                                       "%sexpert_count and %sexpert_used_count (a damaged or incomplete conversion)",
                                       path, name, why, p.c_str(), p.c_str()));
    };
    if (!f.has(p + "expert_count")) {
        if (moe_arch)
            throw GGUFError(format("%s: %s is a mixture-of-experts architecture, but the metadata has no %sexpert_count",
                                   path, hp.arch.c_str(), p.c_str()));
        dense_with_experts(format("the metadata has no %sexpert_count", p.c_str()).c_str());
        return;
    }
    const int64_t count = f.get_i64(p + "expert_count");
    if (count == 0 && !moe_arch) {  // some converters write expert_count = 0 into dense llama files
        dense_with_experts(format("%sexpert_count is 0", p.c_str()).c_str());
        return;
    }
    if (count <= 0 || count > kMaxExperts)
        throw GGUFError(format("%s: metadata %sexpert_count = %lld; a mixture of experts needs 1..%lld experts", path,
                               p.c_str(), (long long)count, (long long)kMaxExperts));
    if (hp.arch != "llama" && hp.arch != "mistral" && !moe_arch)
        throw UnsupportedModelError(format("%s: %s with experts (%sexpert_count = %lld) is not supported; mixtures of "
                                           "experts run for qwen3moe, qwen2moe and llama (Mixtral)",
                                           path, hp.arch.c_str(), p.c_str(), (long long)count));
    if (!f.has(p + "expert_used_count"))
        throw GGUFError(format("%s: metadata %sexpert_used_count is missing (how many of the %lld experts each token "
                               "uses)", path, p.c_str(), (long long)count));
    const int64_t used = f.get_i64(p + "expert_used_count");
    if (used <= 0 || used > count)
        throw GGUFError(format("%s: metadata %sexpert_used_count = %lld, but each token must use 1..%lld experts "
                               "(expert_count)", path, p.c_str(), (long long)used, (long long)count));
    hp.n_expert = (int32_t)count;
    hp.n_expert_used = (int32_t)used;

    // The experts' width: the file's, else as llama.cpp derives it (Mixtral's experts are feed_forward_length
    // wide; the Qwen MoEs fall back to n_ff / n_expert_used).
    if (f.has(p + "expert_feed_forward_length")) {
        hp.n_ff_exp = (int32_t)positive(f, p + "expert_feed_forward_length", (int64_t)1 << 30);
    } else if (hp.n_ff > 0) {
        hp.n_ff_exp = moe_arch ? hp.n_ff / hp.n_expert_used : hp.n_ff;
    }
    if (hp.n_ff_exp <= 0)
        throw GGUFError(format("%s: the experts' width is unknown: the metadata has neither %sexpert_feed_forward_length "
                               "nor a usable %sfeed_forward_length", path, p.c_str(), p.c_str()));
    if (hp.n_ff <= 0) hp.n_ff = hp.n_ff_exp;  // (sizes the dense scratch, which MoE layers do not use)

    if (f.has(p + "expert_shared_feed_forward_length"))
        hp.n_ff_shexp = (int32_t)positive(f, p + "expert_shared_feed_forward_length", (int64_t)1 << 30);
    else if (hp.arch == "qwen2moe")
        hp.n_ff_shexp = hp.n_ff;  // llama.cpp's default: the shared expert is feed_forward_length wide

    const bool gpt_oss = hp.arch == "gpt-oss";
    if (gpt_oss) {
        hp.expert_gating = MOE_GATING_SOFTMAX_CHOSEN;  // as llama.cpp builds it, whatever the file says
    } else if (f.has(p + "expert_gating_func")) {
        const int64_t g = f.get_i64(p + "expert_gating_func");
        if (g != MOE_GATING_SOFTMAX && g != MOE_GATING_SOFTMAX_CHOSEN)  // llama.cpp's 2 is sigmoid
            throw UnsupportedModelError(format("%s: %sexpert_gating_func = %lld; softmax gating (1) and the softmax "
                                               "of the chosen experts' logits (3) are supported",
                                               path, p.c_str(), (long long)g));
        hp.expert_gating = (MoEGating)g;
    }
    hp.expert_weights_norm = !gpt_oss && f.get_bool(p + "expert_weights_norm", hp.arch != "qwen2moe");
    hp.expert_weights_scale = f.get_f32(p + "expert_weights_scale", 0.0f);
    if (hp.expert_weights_scale == 0.0f) hp.expert_weights_scale = 1.0f;  // llama.cpp: 0 means not scaled
    if (!(hp.expert_weights_scale > 0) || !std::isfinite(hp.expert_weights_scale))
        throw GGUFError(format("%s: metadata %sexpert_weights_scale = %g must be positive", path, p.c_str(),
                               hp.expert_weights_scale));
    if (hp.ffn_act != FFN_SILU && hp.ffn_act != FFN_SWIGLU_OAI)
        throw UnsupportedModelError(format("%s: mixture-of-experts layers run with SiLU or gpt-oss's SwiGLU only, not %s",
                                           path, ffn_activation_name(hp.ffn_act)));
}

void bind_moe_layer(const GGUFFile& f, const HParams& hp, int il, LayerWeights& L) {
    const std::string p = "blk." + std::to_string(il) + ".";
    MoEWeights& m = L.moe;
    const int64_t E = hp.n_embd, F = hp.n_ff_exp, X = hp.n_expert;
    m.gate_inp = matrix(f, p + "ffn_gate_inp.weight", E, X, "the layer's router");
    m.gate = experts(f, p + "ffn_gate_exps.weight", E, F, X, "gate of the experts");
    m.up = experts(f, p + "ffn_up_exps.weight", E, F, X, "up of the experts");
    m.down = experts(f, p + "ffn_down_exps.weight", F, E, X, "down of the experts");
    m.gate_inp_b = bias(f, p + "ffn_gate_inp.bias", X, 1);
    m.gate_b = bias(f, p + "ffn_gate_exps.bias", F, X);
    m.up_b = bias(f, p + "ffn_up_exps.bias", F, X);
    m.down_b = bias(f, p + "ffn_down_exps.bias", E, X);
    if (hp.n_ff_shexp > 0) {
        const int64_t S = hp.n_ff_shexp;
        m.shared.gate = matrix(f, p + "ffn_gate_shexp.weight", E, S, "the shared expert's gate");
        m.shared.up = matrix(f, p + "ffn_up_shexp.weight", E, S, "the shared expert's up");
        m.shared.down = matrix(f, p + "ffn_down_shexp.weight", S, E, "the shared expert's down");
        if (hp.arch == "qwen2moe" || f.find_tensor(p + "ffn_gate_inp_shexp.weight"))
            m.gate_inp_shexp = matrix(f, p + "ffn_gate_inp_shexp.weight", E, 1, "the shared expert's gate");
    }
}

}  // namespace optiml
