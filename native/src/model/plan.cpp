// make_plan: where each part of each layer runs (plan.h).
#include "optiml/plan.h"

#include <algorithm>

#include "optiml/common.h"
#include "optiml/cuda.h"
#include "optiml/kv_cache.h"
#include "optiml/model.h"
#include "optiml/quant.h"

namespace optiml {

size_t kv_layer_bytes(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t kv_type, int32_t kv_type_v) {
    if (kv_type_v < 0) kv_type_v = kv_type;
    return (size_t)n_seq * (size_t)n_ctx * (row_size(kv_type, hp.n_embd_kv()) + row_size(kv_type_v, hp.n_embd_kv()));
}

size_t scratch_bytes(const HParams& hp, int32_t n_batch) {
    // x, xn, q, k, v, attn, gate, up, y, y2 (StepScratch), each [n_batch][...] floats.
    const size_t per_token = 4 * (size_t)hp.n_embd + 2 * (size_t)hp.n_embd_q() + 2 * (size_t)hp.n_embd_kv() +
                             2 * (size_t)hp.n_ff;
    return per_token * (size_t)n_batch * sizeof(float);
}

static size_t weight_bytes(const Weight& w) { return w.present() ? w.row_bytes * (size_t)w.rows : 0; }

size_t moe_split_scratch_bytes(const HParams& hp, int32_t n_batch) {
    const size_t nb = (size_t)n_batch;
    // The logits, every (token, expert) row, the shared expert's output and gate, and the routing (weights
    // and rows) for a sum on the device.
    return sizeof(float) * nb *
           ((size_t)hp.n_expert + (size_t)hp.n_expert_used * hp.n_embd + hp.n_embd + 1 + 2 * (size_t)hp.n_expert_used);
}

size_t attn_layer_bytes(const Model& m, int il) {
    const LayerWeights& L = m.layers[il];
    size_t n = 0;
    for (const Weight* w : {&L.attn_norm, &L.wq, &L.wk, &L.wv, &L.wo, &L.bq, &L.bk, &L.bv, &L.bo, &L.q_norm, &L.k_norm,
                            &L.attn_post_norm, &L.ffn.norm, &L.ffn.post_norm, &L.ffn.down_b, &L.attn_sinks})
        n += weight_bytes(*w);
    return n;
}

// One expert's matrices and its rows of the experts' biases (gpt-oss; row_bytes is 0 where absent).
size_t expert_bytes(const Model& m, int il) {
    const MoEWeights& e = m.layers[il].moe;
    return e.gate.expert_bytes + e.up.expert_bytes + e.down.expert_bytes + e.gate_b.row_bytes + e.up_b.row_bytes +
           e.down_b.row_bytes;
}

size_t moe_home_bytes(const Model& m, int il) {
    const MoEWeights& e = m.layers[il].moe;
    size_t n = weight_bytes(e.gate_inp) + weight_bytes(e.gate_inp_shexp) + weight_bytes(e.gate_inp_b);
    for (const Weight* w : {&e.shared.gate, &e.shared.up, &e.shared.down}) n += weight_bytes(*w);
    return n;
}

// A mixture of experts whole on a device: its router, every expert and the shared expert.
static size_t moe_layer_bytes(const Model& m, int il) {
    return moe_home_bytes(m, il) + expert_bytes(m, il) * (size_t)m.hp.n_expert;
}

std::string expert_lists_error(const HParams& hp, const std::vector<std::vector<int32_t>>& lists) {
    if (!hp.is_moe()) return "the model has no experts";
    if (lists.size() != (size_t)hp.n_layer) return format("%zu lists for %d layers", lists.size(), hp.n_layer);
    std::vector<uint8_t> seen(hp.n_expert);
    for (size_t il = 0; il < lists.size(); il++) {
        std::fill(seen.begin(), seen.end(), 0);
        for (int32_t e : lists[il]) {
            if (e < 0 || e >= hp.n_expert)
                return format("layer %zu lists expert %d; the model's experts are 0..%d", il, e, hp.n_expert - 1);
            if (seen[e]++) return format("layer %zu lists expert %d twice", il, e);
        }
    }
    return "";
}

size_t ffn_share_bytes(const Model& m, int il, int32_t k, bool contiguous) {
    if (k <= 0) return 0;
    if (m.layers[il].moe.present()) return moe_layer_bytes(m, il);
    const FFNWeights& w = m.layers[il].ffn;
    const HParams& hp = m.hp;
    size_t n = (w.gate.row_bytes + w.up.row_bytes) * (size_t)k;
    n += sizeof(float) * (size_t)k * (w.gate_b.present() + w.up_b.present());
    if (contiguous || k == hp.n_ff)
        n += row_size(w.down.type, k) * (size_t)hp.n_embd;
    else  // neuron-major 8-bit rows, and their per-dimension scales
        n += row_size(TYPE_Q8_0, hp.n_embd) * (size_t)k + sizeof(float) * (size_t)hp.n_embd;
    return n;
}

size_t output_bytes(const Model& m, int32_t logits_rows) {
    return weight_bytes(m.output_norm) + weight_bytes(m.output) + sizeof(float) * (size_t)logits_rows * m.hp.n_vocab;
}

int32_t ffn_share_align(const Model& m, int il) {
    if (m.layers[il].moe.present()) return m.hp.n_ff;  // all or nothing
    return (int32_t)type_traits(m.layers[il].ffn.down.type).block_size;
}

int32_t Plan::layers_on_device() const {
    int32_t n = 0;
    for (const LayerPlan& l : layers) n += l.attn_on_device;
    return n;
}

bool Plan::splits_experts() const {
    for (const LayerPlan& l : layers)
        if (!l.device_experts.empty()) return true;
    return false;
}

int64_t Plan::neurons_on_device() const {
    int64_t n = 0;
    for (const LayerPlan& l : layers) n += l.ffn_on_device;
    return n;
}

static std::string mib(size_t b) { return format("%.1f MiB", b / 1048576.0); }

std::string Plan::summary(const Model& m) const {
    const HParams& hp = m.hp;
    // A mixture of experts' layer: all its experts on the device (ffn_on_device n_ff), some, or none.
    auto experts_on_device = [&](const LayerPlan& l) {
        return l.ffn_on_device == hp.n_ff ? hp.n_expert : (int32_t)l.device_experts.size();
    };
    std::string s;
    if (!uses_device()) {
        s += format("device: none (everything on the CPU)%s%s\n", reason.empty() ? "" : ": ", reason.c_str());
    } else {
        s += format("device: %s, budget %s, used %s (%s)\n", device.c_str(),
                    budget < 0 ? "unlimited" : mib((size_t)budget).c_str(), mib(device_bytes.total()).c_str(),
                    reason.c_str());
        s += format("  attention weights %s, FFN weights %s, KV cache %s, scratch %s, output %s%s\n",
                    mib(device_bytes.attn_weights).c_str(), mib(device_bytes.ffn_weights).c_str(),
                    mib(device_bytes.kv).c_str(), mib(device_bytes.scratch).c_str(), mib(device_bytes.output).c_str(),
                    output_on_device ? " (the logits on the device)" : "");
        if (hp.is_moe()) {
            int64_t on = 0;
            for (const LayerPlan& l : layers) on += experts_on_device(l);
            s += format("  %d of %d layers' attention on the device; %lld of %lld experts (%.1f%%)\n",
                        layers_on_device(), hp.n_layer, (long long)on, (long long)hp.n_layer * hp.n_expert,
                        100.0 * on / ((double)hp.n_layer * hp.n_expert));
        } else {
            s += format("  %d of %d layers' attention on the device; %lld of %lld FFN neurons (%.1f%%)%s\n",
                        layers_on_device(), hp.n_layer, (long long)neurons_on_device(),
                        (long long)hp.n_layer * hp.n_ff, 100.0 * neurons_on_device() / ((double)hp.n_layer * hp.n_ff),
                        neuron_order.empty() ? "" : "; neurons gathered by the file's stored order");
        }
        if (splits_experts()) {
            int64_t n = 0, split = 0;
            for (const LayerPlan& l : layers) n += (int64_t)l.device_experts.size(), split += !l.device_experts.empty();
            s += format("  experts split in %lld layers: %lld of their %lld experts on the device, the rest on the "
                        "CPU, both at once\n", (long long)split, (long long)n, (long long)split * hp.n_expert);
        }
    }
    s += format("host: KV cache %s, scratch %s; context %d x %d sequence(s), batch %d\n", mib(host_kv_bytes).c_str(),
                mib(host_scratch_bytes).c_str(), n_ctx, n_seq, n_batch);
    s += format("KV cache types: keys %s, values %s\n", kv_type_name(kv_type).c_str(),
                kv_type_name(kv_type_v).c_str());
    if (n_seq_device < n_seq)
        s += format("KV cache of %d of %d sequences on the device, the others in host memory (their attention on "
                    "the CPU)\n", n_seq_device, n_seq);
    if (uses_device()) {
        s += "layer  attention  FFN on device\n";
        for (size_t il = 0; il < layers.size(); il++) {
            const LayerPlan& l = layers[il];
            if (hp.is_moe())
                s += format("%5zu  %-9s  %5d / %d experts\n", il, l.attn_on_device ? device.c_str() : "cpu",
                            experts_on_device(l), hp.n_expert);
            else
                s += format("%5zu  %-9s  %5d / %d\n", il, l.attn_on_device ? device.c_str() : "cpu", l.ffn_on_device,
                            hp.n_ff);
        }
    }
    return s;
}

namespace {

// Resolves o.device into p.device (empty: the CPU alone) and, for a GPU without a budget, p.budget.
void choose_device(const PlanOptions& o, Plan& p) {
    std::string dev = o.device;
    if (dev == "auto") {
        dev = cuda_devices().empty() ? "cpu" : "cuda";
        if (dev == "cuda") {
            // The CUDA backend has not yet been verified on a GPU (issue #16): auto stays on the CPU until
            // it has; device='cuda' asks for it explicitly.
            dev = "cpu";
            p.reason = "a CUDA device is present; auto stays on the CPU until the CUDA backend is verified "
                       "(ask for device='cuda')";
        } else {
            p.reason = cuda_compiled() ? "no CUDA device found" : "built without CUDA";
        }
    }
    if (dev == "cpu" || dev == "cpu:0") {
        if (o.n_gpu_layers > 0 || !o.gpu_neurons.empty() || !o.gpu_experts.empty())
            p.reason = (p.reason.empty() ? "" : p.reason + ": ") +
                       "n_gpu_layers / gpu_neurons / gpu_experts ignored: the device is the CPU";
    } else if (device_index(dev, "cpu") >= 1) {
        p.device = dev;
    } else if (device_index(dev, "cuda") >= 0) {
        std::string why;
        const std::vector<CudaDevice> gpus = cuda_devices(&why);
        const int index = device_index(dev, "cuda");
        if (index >= (int)gpus.size())
            throw ArgumentError(gpus.empty() ? format("device '%s': %s; use device='cpu'", dev.c_str(), why.c_str())
                                             : format("device '%s': this machine has %zu CUDA device(s)", dev.c_str(),
                                                      gpus.size()));
        p.device = format("cuda:%d", index);
        // Without a budget: the memory free now, less a tenth for the CUDA context and other programs.
        if (o.vram < 0) p.budget = (int64_t)(gpus[index].free_memory / 10 * 9);
    } else {
        throw ArgumentError(format("unknown device '%s': use 'auto', 'cpu', 'cpu:N' (a CPU test device) or 'cuda[:N]'",
                                   dev.c_str()));
    }
}

// What the device takes, layer by layer, out of `avail` bytes: p.layers and p.device_bytes.
struct Placer {
    const Model& m;
    const HParams& hp;
    Plan& p;
    size_t kv;      // one layer's KV cache on the device
    int64_t avail;  // bytes of the budget not yet placed
    int32_t cpu_moe_layers = 0;  // a mixture of experts in layers [0, this) stays on the host (n_cpu_moe)

    // The FFN neurons of a layer placed whole: all of them, none for experts kept on the host.
    int32_t whole_ffn(int il) const { return m.layers[il].moe.present() && il < cpu_moe_layers ? 0 : hp.n_ff; }

    void whole_layer(int il) {
        p.layers[il] = LayerPlan{true, whole_ffn(il), {}};
        p.device_bytes.attn_weights += attn_layer_bytes(m, il);
        p.device_bytes.kv += kv;
        p.device_bytes.ffn_weights += ffn_share_bytes(m, il, whole_ffn(il), true);
    }

    // n_gpu_layers: the last n layers whole, or an error when they do not fit. More than the model has means
    // all of them, as llama.cpp's -ngl 99 does.
    void last_layers(int n, int64_t budget) {
        n = std::min(n, hp.n_layer);
        for (int il = hp.n_layer - n; il < hp.n_layer; il++) whole_layer(il);
        const PlanBytes& b = p.device_bytes;
        if ((int64_t)(b.total() - b.scratch) > avail)
            throw ArgumentError(format("n_gpu_layers=%d needs %s on %s; the budget is %s", n, mib(b.total()).c_str(),
                                       p.device.c_str(), mib((size_t)budget).c_str()));
        p.reason = format("n_gpu_layers=%d", n);
    }

    // No placement: whole layers from the last one down, as llama.cpp's layer split does.
    void whole_layers_from_the_end() {
        for (int il = hp.n_layer - 1; il >= 0; il--) {
            const size_t a = attn_layer_bytes(m, il) + kv + ffn_share_bytes(m, il, whole_ffn(il), true);
            if ((int64_t)a > avail) break;
            avail -= (int64_t)a;
            whole_layer(il);
        }
    }

    bool attention(int il) {
        const size_t a = attn_layer_bytes(m, il) + kv;
        if ((int64_t)a > avail) return false;
        avail -= (int64_t)a;
        p.device_bytes.attn_weights += attn_layer_bytes(m, il);
        p.device_bytes.kv += kv;
        p.layers[il].attn_on_device = true;
        return true;
    }

    // Mixtures of experts by expert: attention as placement() places it, then per layer as many of its
    // listed experts (hottest first) as the budget holds, with the router and shared expert where the
    // layer's attention is on the device too. A layer whose experts all fit with those goes whole. The
    // first layer that splits also takes the split layers' scratch.
    void experts(const std::vector<std::vector<int32_t>>& want, const std::vector<int32_t>* chosen) {
        if (chosen)
            for (int il = 0; il < hp.n_layer; il++)
                if ((*chosen)[il]) attention(il);
        const int64_t split_scratch = (int64_t)moe_split_scratch_bytes(hp, p.n_batch);
        for (int il = 0; il < hp.n_layer; il++) {
            if (!chosen && !attention(il)) break;
            const std::vector<int32_t>& ids = want[il];
            if (ids.empty() || il < cpu_moe_layers) continue;  // (n_cpu_moe: these layers' experts on the host)
            const size_t whole = ffn_share_bytes(m, il, hp.n_ff, true);
            if ((int32_t)ids.size() == hp.n_expert && (int64_t)whole <= avail) {
                p.layers[il].ffn_on_device = hp.n_ff;
                p.device_bytes.ffn_weights += whole;
                avail -= (int64_t)whole;
                continue;
            }
            const int64_t scratch = p.splits_experts() ? 0 : split_scratch;
            const int64_t fixed = (p.layers[il].attn_on_device ? (int64_t)moe_home_bytes(m, il) : 0) + scratch;
            const int64_t per = (int64_t)expert_bytes(m, il);
            if (avail < fixed + per) continue;
            const int64_t k = std::min<int64_t>((int64_t)ids.size(), (avail - fixed) / per);
            p.layers[il].device_experts.assign(ids.begin(), ids.begin() + k);
            p.device_bytes.ffn_weights += (size_t)(fixed - scratch + k * per);
            p.device_bytes.scratch += (size_t)scratch;
            avail -= fixed + k * per;
        }
    }

    // Attention and KV first: the layers the placement chose (`chosen`, as far as the budget holds), or,
    // in a file without that choice, layer by layer until one does not fit. Then as many hot neurons per
    // layer as the placement asks (want) and the budget holds.
    void placement(const std::vector<int32_t>& want, const std::vector<int32_t>* chosen) {
        const bool contiguous = p.neuron_order.empty();
        // The solver's choice of layers first (it reserved their attention before any neuron).
        if (chosen)
            for (int il = 0; il < hp.n_layer; il++)
                if ((*chosen)[il]) attention(il);
        for (int il = 0; il < hp.n_layer; il++) {
            if (!chosen && !attention(il)) break;
            int32_t k = std::min(want[il], hp.n_ff);
            const int32_t align = ffn_share_align(m, il);
            if (k < hp.n_ff) k -= k % align;
            while (k > 0 && (int64_t)ffn_share_bytes(m, il, k, contiguous) > avail)
                k = (k == hp.n_ff ? hp.n_ff - hp.n_ff % align : k) - align;
            k = std::max(k, 0);
            p.layers[il].ffn_on_device = k;
            const size_t fb = ffn_share_bytes(m, il, k, contiguous);
            p.device_bytes.ffn_weights += fb;
            avail -= (int64_t)fb;
        }
    }
};

// Mixtures of experts placed by expert: the lists of o.gpu_experts, else the file's (optiml solve).
void place_experts(const PlanOptions& o, Placer& at, int64_t budget) {
    const Model& m = at.m;
    Plan& p = at.p;
    const bool given = !o.gpu_experts.empty();  // (checked by make_plan)
    p.reason = given ? "gpu_experts given" : "the file's expert placement";
    at.experts(given ? o.gpu_experts : m.placement_gpu_experts,
               !given && !m.placement_gpu_attention.empty() ? &m.placement_gpu_attention : nullptr);
    {  // Said when the budget held fewer experts than listed (a placement solved for fewer tokens a step, whose
       // scratch is smaller, or for a larger budget): the plan runs the hottest ones that fit.
        const std::vector<std::vector<int32_t>>& lists = given ? o.gpu_experts : m.placement_gpu_experts;
        size_t listed = 0, placed = 0;
        for (int il = std::max(at.cpu_moe_layers, 0); il < (int)lists.size() && il < at.hp.n_layer; il++) {
            listed += lists[il].size();
            placed += p.layers[il].ffn_on_device == at.hp.n_ff ? lists[il].size() : p.layers[il].device_experts.size();
        }
        if (placed < listed && (placed > 0 || p.layers_on_device() > 0))  // (else: the note below, nothing fits)
            p.reason += format("; %s of the %zu experts it lists fit in the budget at n_batch %d (the device's "
                               "scratch grows with n_batch: optiml solve --batch sets the one it counts)",
                               placed ? std::to_string(placed).c_str() : "none", listed, p.n_batch);
    }
    if (p.layers_on_device() == 0 && p.neurons_on_device() == 0 && !p.splits_experts()) {
        // Nothing placed: the budget, or n_cpu_moe keeping every expert the placement lists on the host
        // of a placement that puts no attention on the device.
        const std::vector<std::vector<int32_t>>& lists = given ? o.gpu_experts : m.placement_gpu_experts;
        bool asked = given || at.cpu_moe_layers == 0 || m.placement_gpu_attention.empty();  // (empty: attention
                                                                               // goes as the budget holds)
        for (int32_t a : m.placement_gpu_attention) asked |= a != 0;
        for (int il = at.cpu_moe_layers; il < (int)lists.size() && !asked; il++) asked = !lists[il].empty();
        p.reason += asked ? format("; nothing fits in the budget of %s beside the scratch", mib((size_t)budget).c_str())
                          : std::string("; n_cpu_moe keeps every expert it lists on the CPU and it puts no attention on "
                                        "the device, so nothing is left for the device");
        p.device_bytes = PlanBytes{};
        p.device.clear();
    }
}

// Without n_gpu_layers: the neurons of o.gpu_neurons, else of the file's placement, else whole layers.
void place_neurons(const PlanOptions& o, Placer& at, int64_t budget) {
    const Model& m = at.m;
    const HParams& hp = at.hp;
    Plan& p = at.p;
    const std::vector<int32_t>& want = o.gpu_neurons.empty() ? m.placement_gpu_neurons : o.gpu_neurons;
    if (!o.gpu_neurons.empty()) {
        if (o.gpu_neurons.size() != (size_t)hp.n_layer)
            throw ArgumentError(format("gpu_neurons: %zu values for %d layers", o.gpu_neurons.size(), hp.n_layer));
        for (int32_t k : o.gpu_neurons)
            if (k < 0 || k > hp.n_ff) throw ArgumentError(format("gpu_neurons: %d is outside [0, %d]", k, hp.n_ff));
    }
    const bool placed = !want.empty();
    p.reason = !o.gpu_neurons.empty() ? "gpu_neurons given" : placed ? "the file's placement" : "whole layers";
    if (placed)
        at.placement(want, o.gpu_neurons.empty() && !m.placement_gpu_attention.empty() ? &m.placement_gpu_attention
                                                                                       : nullptr);
    else
        at.whole_layers_from_the_end();
    if (p.layers_on_device() == 0 && p.neurons_on_device() == 0) {
        p.reason += format("; nothing fits in the budget of %s beside the scratch", mib((size_t)budget).c_str());
        p.device_bytes = PlanBytes{};
        p.device.clear();
    }
}

// How many layers, from the first, keep their experts on the host: n_cpu_moe as llama.cpp means it
// (cpu_moe: all).
int32_t cpu_moe_layers(const Model& m, const PlanOptions& o) {
    const HParams& hp = m.hp;
    if (!hp.is_moe()) {
        if (o.n_cpu_moe > 0)
            throw ArgumentError("n_cpu_moe keeps the experts of mixture-of-experts layers on the CPU, and this "
                                "model has no experts: leave it out");
        return 0;
    }
    return std::clamp(o.n_cpu_moe, 0, hp.n_layer);  // (past the layers: all of them, as llama.cpp takes it)
}

// The device's share of the model within the budget (p.device set): its scratch, layers and neurons,
// and the logits where the residual stream ends when the output matrix fits beside the rest.
void place_on_device(const Model& m, const PlanOptions& o, Plan& p, size_t kv) {
    const HParams& hp = m.hp;
    const int64_t budget = p.budget < 0 ? INT64_MAX : p.budget;
    PlanBytes& b = p.device_bytes;
    b.scratch = scratch_bytes(hp, p.n_batch);
    Placer at{m, hp, p, kv, budget - (int64_t)b.scratch, cpu_moe_layers(m, o)};
    if (at.avail < 0) {
        p.reason = format("the budget does not hold the device's scratch (%s)", mib(b.scratch).c_str());
        b = PlanBytes{};
        p.device.clear();
    } else if (o.n_gpu_layers >= 0) {
        at.last_layers(o.n_gpu_layers, budget);
    } else if (hp.is_moe() && (!o.gpu_experts.empty() || !m.placement_gpu_experts.empty())) {
        // (with n_cpu_moe, the file's expert placement for the layers after the first n_cpu_moe)
        place_experts(o, at, budget);
    } else {
        place_neurons(o, at, budget);
    }
    if (p.uses_device() && at.cpu_moe_layers > 0)
        p.reason += at.cpu_moe_layers == hp.n_layer ? "; every layer's experts on the CPU"
                    : at.cpu_moe_layers == 1 ? "; the experts of layer 0 on the CPU"
                                             : format("; the experts of layers 0-%d on the CPU", at.cpu_moe_layers - 1);
    if (p.uses_device() && p.layers[hp.n_layer - 1].attn_on_device) {
        const int32_t rows = std::min(p.n_batch, 64);
        const size_t ob = output_bytes(m, rows);
        if ((int64_t)(b.total() + ob) <= budget) {
            p.output_on_device = true;
            p.logits_rows = rows;
            b.output = ob;
        }
    }
}

}  // namespace

Plan make_plan(const Model& m, const PlanOptions& o) {
    const HParams& hp = m.hp;
    Plan p;
    p.n_ctx = o.n_ctx;
    p.n_seq = o.n_seq;
    p.n_batch = std::min(o.n_batch, o.n_ctx * o.n_seq);
    p.kv_type = o.kv_type;
    p.kv_type_v = o.kv_type_v < 0 ? o.kv_type : o.kv_type_v;
    check_kv_types(hp, p.kv_type, p.kv_type_v);
    p.device_threads = o.device_threads;
    p.budget = o.vram;
    p.layers.assign(hp.n_layer, LayerPlan{});
    if (o.n_ctx <= 0) throw ArgumentError(format("n_ctx must be positive, got %d", o.n_ctx));
    if (o.n_seq <= 0) throw ArgumentError(format("n_seq must be positive, got %d", o.n_seq));
    if (o.n_batch <= 0) throw ArgumentError(format("n_batch must be positive, got %d", o.n_batch));
    choose_device(o, p);
    if (hp.is_moe() && !o.gpu_neurons.empty() && p.uses_device())
        // Neurons inside experts on a device are not built: experts go whole (gpu_experts), or whole layers.
        throw ArgumentError("gpu_neurons: this model's layers are mixtures of experts, which go to a device by "
                            "expert (gpu_experts) or by layer (n_gpu_layers, a budget, n_cpu_moe): leave gpu_neurons out");
    if (!o.gpu_experts.empty() && p.uses_device()) {
        const std::string why = expert_lists_error(hp, o.gpu_experts);
        if (!why.empty()) throw ArgumentError("gpu_experts: " + why);
        if (o.n_gpu_layers >= 0 || o.n_cpu_moe >= 0)
            throw ArgumentError(format("gpu_experts says which experts go to the device, and %s says it too: give one",
                                       o.n_gpu_layers >= 0 ? "n_gpu_layers" : "n_cpu_moe"));
    }
    if (o.vram < -1) throw ArgumentError("vram must be >= 0 bytes");

    if (m.placement_order.size() == (size_t)hp.n_layer * hp.n_ff) p.neuron_order = m.placement_order;
    // The device's KV slots: every sequence's, or as many as kv_vram holds (the rest offloaded).
    p.n_seq_device = o.n_seq;
    if (o.kv_vram >= 0) {
        if (!p.uses_device())
            throw ArgumentError("kv_vram limits the device's KV cache, and there is no device: give device='cuda' "
                                "(or 'cpu:1'), or leave kv_vram out");
        const size_t per_seq = (size_t)hp.n_layer * kv_layer_bytes(hp, o.n_ctx, 1, p.kv_type, p.kv_type_v);
        p.n_seq_device = (int32_t)std::min<int64_t>(o.n_seq, o.kv_vram / (int64_t)per_seq);
    } else if (o.kv_vram < -1) {
        throw ArgumentError("kv_vram must be >= 0 bytes");
    }
    const size_t kv = kv_layer_bytes(hp, o.n_ctx, p.n_seq_device, p.kv_type, p.kv_type_v);
    p.host_scratch_bytes = scratch_bytes(hp, p.n_batch);
    if (p.uses_device()) place_on_device(m, o, p, kv);

    if (p.uses_device() && p.layers_on_device() > 0 && m.rope_freqs_for(o.n_ctx).present())
        p.device_bytes.attn_weights += weight_bytes(m.rope_freqs_for(o.n_ctx));  // one copy on the device
    for (const LayerPlan& l : p.layers)
        if (!l.attn_on_device) p.host_kv_bytes += kv;
    if (p.n_seq_device < p.n_seq) {
        if (p.layers_on_device() < hp.n_layer)
            throw ArgumentError(format("kv_vram holds the KV cache of %d of %d sequences on the device, and the rest "
                                       "need CPU attention offload, which needs every layer's attention on the "
                                       "device: this budget puts %d of %d layers there",
                                       p.n_seq_device, p.n_seq, p.layers_on_device(), hp.n_layer));
        // The host holds a slot for every sequence (indexed by sequence id), so any can move there.
        p.host_kv_bytes += (size_t)hp.n_layer * kv_layer_bytes(hp, o.n_ctx, o.n_seq, p.kv_type, p.kv_type_v);
    }
    return p;
}

}  // namespace optiml
