// Session: binds a model to its devices by the plan (weights uploaded, KV cache and scratch allocated),
// and the entry points that feed tokens in batches.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "layer_exec.h"
#include "optiml/common.h"
#include "optiml/cuda.h"
#include "optiml/kv_cache.h"
#include "optiml/model.h"
#include "optiml/predictor.h"
#include "optiml/quant.h"

namespace optiml {

Session::Session(std::shared_ptr<Model> model, int32_t n_ctx, std::shared_ptr<ThreadPool> pool, int32_t kv_type,
                 int32_t n_batch, int32_t n_seq, const PlanOptions* plan_options, int32_t kv_type_v)
    : model_(std::move(model)), pool_(std::move(pool)), n_ctx_(n_ctx), n_batch_(n_batch) {
    if (n_ctx <= 0) throw ArgumentError(format("n_ctx must be positive, got %d", n_ctx));
    if (n_batch <= 0) throw ArgumentError(format("n_batch must be positive, got %d", n_batch));
    if (n_seq <= 0) throw ArgumentError(format("n_seq must be positive, got %d", n_seq));
    check_kv_types(model_->hp, kv_type, kv_type_v < 0 ? kv_type : kv_type_v);
    rope_freqs_ = model_->rope_freqs_for(n_ctx);
    model_->attach_session();
    try {
        PlanOptions o = plan_options ? *plan_options : PlanOptions{};
        if (!plan_options) o.device = "cpu";
        o.n_ctx = n_ctx;
        o.n_seq = n_seq;
        o.n_batch = n_batch;
        o.kv_type = kv_type;
        o.kv_type_v = kv_type_v;
        plan_ = make_plan(*model_, o);
        n_batch_ = plan_.n_batch;
        // Rows now for a device's uploads, and for every session once a second one shares the model
        // (the first may have repacked it).
        if (plan_.uses_device() || model_->attached_sessions() > 1) place_weights();
        bind_devices();
        reset_sparsity_counts();
    } catch (...) {
        model_->detach_session();
        throw;
    }
}

Session::~Session() {
    try {
        if (device_) device_->synchronize();
    } catch (...) {  // a failed op was already reported, or nobody is left to report it to
    }
    exec_.clear();
    kv_.reset();
    device_.reset();
    host_.reset();
    model_->detach_session();
}

// Neuron-major down rows of `rows` (file neurons) only, in list order: a whole layer is repacked, then
// only the listed rows are kept, so the full copy lives for one layer at a time. compact: grouped
// where the type allows (the host's share may be; the device's kernels take 8-bit rows).
static NeuronMajor neuron_major_rows(ThreadPool& pool, const Weight& down, const int32_t* rows, int64_t n_rows,
                                     bool compact) {
    const NeuronMajor full = compact ? neuron_major_copy(pool, down.matrix())
                                     : repack_neuron_major(pool, down.matrix(), TYPE_Q8_0);
    return gather_neuron_major(full, rows, n_rows);
}

// A mixture of experts in device memory, counted as the plan counts it (ffn_share_bytes, Placer::experts):
// the router and shared expert where `home` (the whole layer, or a split layer's attention on the device),
// and the experts `ids` in that order (nullptr: every expert, one block per 3-D tensor).
static MoEWeights upload_moe(Backend& dev, const MoEWeights& w, const std::vector<int32_t>* ids, bool home) {
    MoEWeights d;
    if (home) {
        d.gate_inp = dev.upload(w.gate_inp, "ffn weights");
        d.gate_inp_shexp = dev.upload(w.gate_inp_shexp, "ffn weights");
        d.shared = w.shared;
        for (auto [src, dst] : {std::pair{&w.shared.gate, &d.shared.gate}, {&w.shared.up, &d.shared.up},
                                {&w.shared.down, &d.shared.down}})
            *dst = dev.upload(*src, "ffn weights");
    }
    if (home) d.gate_inp_b = dev.upload(w.gate_inp_b, "ffn weights");
    // The experts' biases (gpt-oss): a row per expert, gathered like the experts.
    for (auto [src, dst] : {std::pair{&w.gate_b, &d.gate_b}, {&w.up_b, &d.up_b}, {&w.down_b, &d.down_b}})
        if (src->present())
            *dst = ids ? dev.upload_rows(*src, ids->data(), (int64_t)ids->size(), "ffn weights")
                       : dev.upload(*src, "ffn weights");
    for (auto [src, dst] : {std::pair{&w.gate, &d.gate}, {&w.up, &d.up}, {&w.down, &d.down}}) {
        *dst = *src;
        if (ids) dst->n_expert = (int64_t)ids->size();
        uint8_t* p = (uint8_t*)dev.alloc(src->expert_bytes * (size_t)dst->n_expert, "ffn weights");
        if (!ids) dev.copy_from_host(p, src->data, src->expert_bytes * (size_t)src->n_expert);
        for (size_t i = 0; ids && i < ids->size(); i++)
            dev.copy_from_host(p + i * src->expert_bytes, src->data + (size_t)(*ids)[i] * src->expert_bytes,
                               src->expert_bytes);
        dst->data = p;
    }
    return d;
}

// The order of a split layer's experts in a step's rows: the host's (by id), then the device's (in the
// plan's order); *n_host: how many are the host's.
static std::vector<int32_t> host_then_device(int32_t n_expert, const std::vector<int32_t>& device, int32_t* n_host) {
    std::vector<uint8_t> on_device(n_expert);
    for (int32_t e : device) on_device[e] = 1;
    std::vector<int32_t> order;
    for (int32_t e = 0; e < n_expert; e++)
        if (!on_device[e]) order.push_back(e);
    *n_host = (int32_t)order.size();
    order.insert(order.end(), device.begin(), device.end());
    return order;
}

static StepScratch carve_scratch(Backend& be, const HParams& hp, int32_t n_batch) {
    float* p = (float*)be.alloc(scratch_bytes(hp, n_batch), "scratch");
    StepScratch s;
    const size_t nb = (size_t)n_batch;
    auto take = [&](size_t per_token) {
        float* q = p;
        p += per_token * nb;
        return q;
    };
    s.x = take(hp.n_embd);
    s.xn = take(hp.n_embd);
    s.y = take(hp.n_embd);
    s.y2 = take(hp.n_embd);
    s.q = take(hp.n_embd_q());
    s.attn = take(hp.n_embd_q());
    s.k = take(hp.n_embd_kv());
    s.v = take(hp.n_embd_kv());
    s.gate = take(hp.n_ff);
    s.up = take(hp.n_ff);
    return s;
}

// What the CUDA backend cannot run yet is refused before anything is uploaded, naming it.
static void check_cuda_types(const Model& M, const Plan& plan) {
    const HParams& hp = M.hp;
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerPlan& lp = plan.layers[il];
        const LayerWeights& L = M.layers[il];
        std::vector<std::pair<const char*, int32_t>> ws;  // (name, type)
        if (lp.attn_on_device)
            for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo}) ws.emplace_back(w->name, w->type);
        if (lp.ffn_on_device > 0 && !L.moe.present())
            for (const Weight* w : {&L.ffn.gate, &L.ffn.up, &L.ffn.down}) ws.emplace_back(w->name, w->type);
        const bool moe_on_device = L.moe.present() && (lp.ffn_on_device > 0 || !lp.device_experts.empty());
        if (moe_on_device) {
            for (const ExpertWeights* x : {&L.moe.gate, &L.moe.up, &L.moe.down}) ws.emplace_back(x->name, x->type);
            for (const Weight* w : {&L.moe.gate_inp, &L.moe.gate_inp_shexp, &L.moe.shared.gate, &L.moe.shared.up,
                                    &L.moe.shared.down})
                if (w->present()) ws.emplace_back(w->name, w->type);
        }
        for (auto [name, type] : ws)
            if (!cuda_reads_type(type))
                throw UnsupportedModelError(format("%s is %s, which the CUDA backend does not read yet; run it on the "
                                                   "CPU (device='cpu')", name, type_traits(type).name));
    }
    if (plan.output_on_device && !cuda_reads_type(M.output.type))
        throw UnsupportedModelError(format("%s is %s, which the CUDA backend does not read yet; run it on the CPU "
                                           "(device='cpu')", M.output.name, type_traits(M.output.type).name));
}

void Session::bind_devices() {
    const Model& M = *model_;
    const HParams& hp = M.hp;
    host_ = make_cpu_backend(pool_);
    if (plan_.uses_device()) {
        device_ = make_device_backend(plan_.device, plan_.device_threads);
        if (device_index(plan_.device, "cuda") >= 0) check_cuda_types(M, plan_);
    }
    Backend* dev = device_.get();
    std::vector<Backend*> kv_home(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) kv_home[il] = plan_.layers[il].attn_on_device ? dev : host_.get();
    kv_ = std::make_unique<KVCache>(hp, n_ctx_, plan_.n_seq, plan_.kv_type, kv_home, host_.get(), plan_.n_seq_device,
                                    plan_.kv_type_v);
    host_s_ = carve_scratch(*host_, hp, n_batch_);
    if (dev) {
        dev->pin_host(host_s_.x, scratch_bytes(hp, n_batch_));  // carve_scratch's block starts at x
        device_s_ = carve_scratch(*dev, hp, n_batch_);
        if (rope_freqs_.present() && plan_.layers_on_device() > 0)
            device_rope_freqs_ = dev->upload(rope_freqs_, "attention weights");
    }

    const bool ordered = !plan_.neuron_order.empty();
    std::vector<std::vector<float>> staged;  // host copies that uploads read until the device syncs
    device_layers_.resize(hp.n_layer);
    exec_.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerWeights& L = M.layers[il];
        LayerExec& E = exec_[il];
        const LayerPlan& lp = plan_.layers[il];
        E.attn = lp.attn_on_device ? dev : host_.get();
        E.attn_w = &L;
        if (lp.attn_on_device) {
            LayerWeights& D = device_layers_[il];
            for (auto [src, dst] : {std::pair{&L.attn_norm, &D.attn_norm}, {&L.wq, &D.wq}, {&L.wk, &D.wk},
                                    {&L.wv, &D.wv}, {&L.wo, &D.wo}, {&L.bq, &D.bq}, {&L.bk, &D.bk}, {&L.bv, &D.bv},
                                    {&L.bo, &D.bo}, {&L.q_norm, &D.q_norm}, {&L.k_norm, &D.k_norm}, {&L.attn_sinks,
                                    &D.attn_sinks}, {&L.attn_post_norm, &D.attn_post_norm}, {&L.ffn.norm, &D.ffn.norm},
                                    {&L.ffn.post_norm, &D.ffn.post_norm}, {&L.ffn.down_b, &D.ffn.down_b}})
                *dst = dev->upload(*src, "attention weights");
            E.attn_w = &D;
        }
        // The FFN: placed neurons [0, k) on the device, [k, n_ff) on the host; a mixture of experts whole.
        E.k = lp.ffn_on_device;
        if (L.moe.present()) {  // whole on the device (k > 0) or the host, or split (device_experts)
            if (E.k > 0) device_layers_[il].moe = upload_moe(*dev, L.moe, nullptr, true);
            E.moe_w = E.k > 0 ? &device_layers_[il].moe : &L.moe;
            if (lp.device_experts.empty()) continue;
            device_layers_[il].moe = upload_moe(*dev, L.moe, &lp.device_experts, lp.attn_on_device);
            E.expert_order = host_then_device(hp.n_expert, lp.device_experts, &E.n_host_experts);
            continue;
        }
        const int32_t* order = ordered ? plan_.neuron_order.data() + (size_t)il * hp.n_ff : nullptr;
        if (E.k > 0) {
            FFNWeights& F = E.device_ffn;
            F.norm = L.ffn.norm;  // (the norm runs where the residual lives; these stay unused here)
            if (E.k == hp.n_ff) {  // the whole FFN: the order does not matter
                for (auto [src, dst] : {std::pair{&L.ffn.gate, &F.gate}, {&L.ffn.up, &F.up}, {&L.ffn.down, &F.down},
                                        {&L.ffn.gate_b, &F.gate_b}, {&L.ffn.up_b, &F.up_b}})
                    *dst = dev->upload(*src, "ffn weights");
            } else {
                std::vector<int32_t>& rows = E.device_rows;
                rows.resize(E.k);
                for (int32_t i = 0; i < E.k; i++) rows[i] = order ? order[i] : i;
                F.gate = dev->upload_rows(L.ffn.gate, rows.data(), E.k, "ffn weights");
                F.up = dev->upload_rows(L.ffn.up, rows.data(), E.k, "ffn weights");
                for (auto [src, dst] : {std::pair{&L.ffn.gate_b, &F.gate_b}, {&L.ffn.up_b, &F.up_b}}) {
                    if (!src->present()) continue;
                    staged.emplace_back(E.k);
                    for (int32_t i = 0; i < E.k; i++) staged.back()[i] = ((const float*)src->data)[rows[i]];
                    Weight b = *src;
                    b.cols = E.k;
                    b.row_bytes = sizeof(float) * E.k;
                    b.data = (const uint8_t*)staged.back().data();
                    *dst = dev->upload(b, "ffn weights");
                }
                if (!order) {
                    F.down = dev->upload_cols(L.ffn.down, 0, E.k, "ffn weights");
                } else {
                    // Columns scattered through quantized blocks cannot be sliced exactly: the share's down
                    // is kept neuron-major (8-bit rows, as the sparse FFN's), its rows on the device; the
                    // per-dimension scales stay with the host side of the call.
                    NeuronMajor& nm = E.device_nm;
                    nm = neuron_major_rows(*pool_, L.ffn.down, rows.data(), E.k, /*compact=*/false);
                    uint8_t* p = (uint8_t*)dev->alloc(nm.data.size(), "ffn weights");
                    dev->copy_from_host(p, nm.data.data(), nm.data.size());
                    float* ds = (float*)dev->alloc(sizeof(float) * nm.dim_scale.size(), "ffn weights");
                    dev->copy_from_host(ds, nm.dim_scale.data(), sizeof(float) * nm.dim_scale.size());
                    dev->synchronize();
                    nm.external_dim_scale = ds;
                    nm.data = {};
                    nm.external = p;
                    E.device_share.down_nm = &nm;
                }
            }
            E.device_share.w = &E.device_ffn;
        }
        if (E.k < hp.n_ff) {
            E.host_share.w = &L.ffn;
            if (E.k > 0) {  // the host's share of a split layer: its rows in place (k = 0: the whole FFN)
                for (int32_t i = E.k; i < hp.n_ff; i++) E.host_rows.push_back(order ? order[i] : i);
                E.host_share.rows = E.host_rows.data();
                E.host_share.n_rows = (int64_t)E.host_rows.size();
            }
        }
    }
    alloc_split_scratch();
    alloc_moe_split();
    if (plan_.output_on_device) {
        device_output_norm_ = dev->upload(M.output_norm, "output");
        device_output_ = dev->upload(M.output, "output");
        device_logits_ = (float*)dev->alloc(sizeof(float) * (size_t)plan_.logits_rows * hp.n_vocab, "output");
    }
    whole_on_device_ = dev && plan_.output_on_device &&
                       std::all_of(exec_.begin(), exec_.end(), [&](const LayerExec& E) { return E.attn == dev && E.k == hp.n_ff; });
    if (dev) dev->synchronize();
    // The plan's count is the allocation's: a mismatch is a bug in one of them.
    if (dev && dev->allocated_bytes() != plan_.device_bytes.total())
        throw Error(format("internal: the plan counted %zu device bytes, the engine allocated %zu",
                           plan_.device_bytes.total(), dev->allocated_bytes()));
}

size_t Session::kv_bytes() const {
    // Device slots, and the host's slots once a sequence has been offloaded.
    const HParams& hp = model_->hp;
    const size_t per_seq = (size_t)hp.n_layer * kv_layer_bytes(hp, n_ctx_, 1, kv_->type(), kv_->type_v());
    bool host = false;
    for (int32_t s = 0; s < kv_->n_seq() && !host; s++) host = kv_->on_host(s);
    return per_seq * (kv_->n_seq_device() + (host || kv_->n_seq_device() < kv_->n_seq() ? kv_->n_seq() : 0));
}

std::vector<std::pair<std::string, size_t>> Session::device_allocations() const {
    return device_ ? device_->allocation_summary() : std::vector<std::pair<std::string, size_t>>{};
}

// rows16 (optiml/rows16.h) for matrices only this CPU's dense product reads, where its kernels have a
// product for the type: every Q4_0/Q4_1 matrix of a CPU-only plan while this is the model's only
// session (another may need rows at any time), but the FFN's while they run sparsely or are recorded
// (the row-sparse product, the neuron-major copies and the recorder take rows) -- except the gate (and,
// with the product criterion, up) of a sparse FFN without predictors: the criterion computes them for
// every neuron, densely, and the rows16 kernels do that faster. Q8_0 keeps rows: mostly the output
// matrix, whose one-token product ran 3-8% slower in rows16 (262144x640 and 49152x576, 2 threads) and 8
// tokens' no faster. A device plan keeps rows everywhere (uploads read rows).
void Session::place_weights() {
    const KernelTable& kt = kernel_table();
    const bool repack = !plan_.uses_device() && model_->attached_sessions() == 1;
    const bool ffn_dense = !sparsity_.enabled && !predictors_ && !recorder_;
    const bool criterion_dense = sparsity_.enabled && !predictors_ && !recorder_;
    model_->set_rows16(*pool_, [&](const Weight& w, int layer, bool ffn) {
        if (!repack || w.type == TYPE_Q8_0 || kt.gemm_rows16[w.type] == nullptr) return false;
        if (!ffn || ffn_dense) return true;
        const FFNWeights& f = model_->layers[layer].ffn;
        return criterion_dense && (&w == &f.gate || (sparsity_.on_product && &w == &f.up));
    });
    weights_placed_ = true;
}

void Session::set_sparsity(const SparsitySettings& st) {
    const HParams& hp = model_->hp;
    if (st.enabled && hp.is_moe())
        throw ArgumentError("sparsity: this model's FFNs are mixtures of experts, which run dense (the sparse FFN, "
                            "predictors and the activation profiler do not handle experts yet)");
    if (st.enabled) {
        if ((int64_t)st.threshold.size() != hp.n_layer)
            throw ArgumentError(format("%zu sparsity thresholds given for a model of %d layers", st.threshold.size(),
                                       hp.n_layer));
        for (float t : st.threshold)
            if (!(t >= 0) || !std::isfinite(t))
                throw ArgumentError(format("sparsity thresholds must be finite and >= 0, got %g", t));
        if (!st.neuron_scale.empty() && (int64_t)st.neuron_scale.size() != (int64_t)hp.n_layer * hp.n_ff)
            throw ArgumentError(format("neuron_scale holds %zu values, expected n_layer * n_ff = %lld",
                                       st.neuron_scale.size(), (long long)hp.n_layer * hp.n_ff));
    }
    sparsity_ = st;
    if (st.enabled || predictors_) {
        place_weights();  // the FFN back into rows
        prepare_sparse();  // the repack happens now, not inside the first token
    } else {
        weights_placed_ = false;  // dense again: the FFN may go into rows16 before the next step
    }
    reset_sparsity_counts();
}

// Where split layers' device shares send their gate and up products (ffn_split_exact): room for the
// largest share, in host memory the device copies into at full speed.
void Session::alloc_split_scratch() {
    int32_t split_k = 0;
    for (const LayerExec& E : exec_)
        if (E.k < model_->hp.n_ff) split_k = std::max(split_k, E.k);
    if (split_k == 0) return;
    const size_t floats = (size_t)n_batch_ * split_k;
    split_gate_ = (float*)host_->alloc(2 * floats * sizeof(float), "split scratch");
    split_up_ = split_gate_ + floats;
    device_->pin_host(split_gate_, 2 * floats * sizeof(float));
    // Split layers' copies are recorded with the device's other work (device_segment) only where all the
    // host memory they touch is page-locked.
    staging_pinned_ = device_->pinned(host_s_.x, scratch_bytes(model_->hp, n_batch_)) &&
                      device_->pinned(split_gate_, 2 * floats * sizeof(float));
}

void Session::alloc_moe_split() {
    if (!plan_.splits_experts()) return;
    const HParams& hp = model_->hp;
    const size_t nb = (size_t)n_batch_, rows = nb * hp.n_expert_used;
    moe_split_ = std::make_unique<MoESplit>();
    MoESplit& m = *moe_split_;
    float* p = (float*)device_->alloc(moe_split_scratch_bytes(hp, n_batch_), "scratch");
    m.dev_logits = p;
    m.dev_d = m.dev_logits + nb * hp.n_expert;
    m.dev_sy = m.dev_d + rows * hp.n_embd;
    m.dev_sgate = m.dev_sy + nb * hp.n_embd;
    m.dev_weight = m.dev_sgate + nb;
    m.dev_slot = (int32_t*)(m.dev_weight + rows);
    // What the device copies to and from host memory, in one block pinned once, so the copies queue without
    // blocking this thread.
    const size_t floats = nb * hp.n_expert + 2 * rows * hp.n_embd + nb * hp.n_embd + nb + 2 * rows;
    float* h = (float*)host_->alloc(floats * sizeof(float), "moe split scratch");
    m.logits = h;
    m.d = m.logits + nb * hp.n_expert;
    m.d2 = m.d + rows * hp.n_embd;
    m.sy = m.d2 + rows * hp.n_embd;
    m.sgate = m.sy + nb * hp.n_embd;
    m.weight = m.sgate + nb;
    m.slot = (int32_t*)(m.weight + rows);
    device_->pin_host(h, floats * sizeof(float));
}

void Session::set_compact_down(bool compact) {
    sparsity_.compact_down = compact;
    if (sparsity_.enabled || predictors_) prepare_sparse();
}

// Neuron-major down rows for the neurons the host computes sparsely: all of a layer the host computes
// whole (shared through the Model), only the host's share of a split layer, none of a device layer.
void Session::prepare_sparse() {
    const HParams& hp = model_->hp;
    for (int il = 0; il < hp.n_layer; il++) {
        LayerExec& E = exec_[il];
        if (!E.host_share.w) continue;
        if (reads_placed_copies()) {  // the host's neurons from a copy in placed order
            prepare_placed(il);
            continue;
        }
        if (!E.host_share.rows) {
            E.host_share.down_nm = &model_->down_neuron_major(*pool_, il, sparsity_.compact_down);
            continue;
        }
        if (!refresh_rows(E.host_nm, E.host_nm_compact, model_->layers[il].ffn.down, E.host_rows.data(),
                          (int64_t)E.host_rows.size()))
            continue;
        E.host_slot.assign(hp.n_ff, -1);
        for (size_t i = 0; i < E.host_rows.size(); i++) E.host_slot[E.host_rows[i]] = (int32_t)i;
        E.host_share.down_nm = E.host_nm.get();
        E.host_share.nm_slot = E.host_slot.data();
    }
}

// nm: neuron-major down rows of rows[0..n) in list order, made again unless it was made for the session's
// compact_down (made_compact). Returns whether it was made now.
bool Session::refresh_rows(std::unique_ptr<NeuronMajor>& nm, bool& made_compact, const Weight& down,
                           const int32_t* rows, int64_t n) {
    if (nm && made_compact == sparsity_.compact_down) return false;
    nm.reset();  // the old copy goes first: never both at once
    nm = std::make_unique<NeuronMajor>(neuron_major_rows(*pool_, down, rows, n, sparsity_.compact_down));
    made_compact = sparsity_.compact_down;
    return true;
}

// The placed copy of the host's neurons of a layer (LayerExec::host_placed): placed neurons [k, n_ff)
// (k: the device's share, 0 for a layer the host computes whole), their gate/up rows gathered in the
// placed order once, and down's neuron-major rows in that order (again when compact_down changes).
void Session::prepare_placed(int il) {
    const HParams& hp = model_->hp;
    LayerExec& E = exec_[il];
    const FFNWeights& L = model_->layers[il].ffn;
    const int32_t* order = plan_.neuron_order.data() + (size_t)il * hp.n_ff + E.k;
    const int64_t m = hp.n_ff - E.k;
    if (!E.host_placed.w) {
        const size_t gate_bytes = L.gate.row_bytes * (size_t)m, up_bytes = L.up.row_bytes * (size_t)m;
        E.placed_rows.resize(gate_bytes + up_bytes);
        uint8_t* gate = E.placed_rows.data();
        uint8_t* up = gate + gate_bytes;
        pool_->run([&](int ith, int nth) {
            int64_t j0, j1;
            split_range(m, ith, nth, &j0, &j1);
            for (int64_t j = j0; j < j1; j++) {
                std::memcpy(gate + j * L.gate.row_bytes, L.gate.row(order[j]), L.gate.row_bytes);
                std::memcpy(up + j * L.up.row_bytes, L.up.row(order[j]), L.up.row_bytes);
            }
        });
        FFNWeights& F = E.placed_ffn;
        F = L;
        F.gate.data = gate;
        F.up.data = up;
        F.gate.rows = F.up.rows = m;
        const int n_bias = (int)L.gate_b.present() + (int)L.up_b.present();
        E.placed_bias.resize((size_t)n_bias * m);
        float* b = E.placed_bias.data();
        for (auto [src, dst] : {std::pair{&L.gate_b, &F.gate_b}, {&L.up_b, &F.up_b}}) {
            if (!src->present()) continue;
            for (int64_t j = 0; j < m; j++) b[j] = ((const float*)src->data)[order[j]];
            dst->data = (const uint8_t*)b;
            dst->cols = m;
            dst->row_bytes = sizeof(float) * m;
            b += m;
        }
        E.host_placed.w = &F;
        E.host_placed.stored = order;
    }
    if (refresh_rows(E.placed_nm, E.placed_nm_compact, L.down, order, m)) E.host_placed.down_nm = E.placed_nm.get();
}

// With predictors, where the file kept its weights' order and recorded an order other than hot-first
// (a hot-first order reads no longer runs than the file's; a copy would only cost memory).
bool Session::reads_placed_copies() const {
    const std::string& name = model_->placement_order_name;
    return predictors_ && placed_copies_ && !plan_.neuron_order.empty() && !name.empty() && name != "hot-first";
}

void Session::free_placed() {
    for (LayerExec& E : exec_) {
        E.host_placed = FFNShare{};
        E.placed_ffn = FFNWeights{};
        E.placed_rows = {};
        E.placed_bias = {};
        E.placed_nm.reset();
    }
}

void Session::set_placed_copies(bool on) {
    placed_copies_ = on;
    if (!on) free_placed();
    if (sparsity_.enabled || predictors_) prepare_sparse();
}

void Session::set_predictor_group(int32_t g) {
    if (g < 1 || g > model_->hp.n_ff)
        throw ArgumentError(format("predictor_group must be in 1..n_ff (%lld), not %d", (long long)model_->hp.n_ff, g));
    predictor_group_ = g;
}

std::vector<int32_t> Session::placed_copy_layers() const {
    std::vector<int32_t> out;
    for (size_t il = 0; il < exec_.size(); il++)
        if (exec_[il].host_placed.w) out.push_back((int32_t)il);
    return out;
}

size_t Session::placed_copy_bytes() const {
    size_t b = 0;
    for (const LayerExec& E : exec_)
        if (E.host_placed.w)
            b += E.placed_rows.size() + sizeof(float) * E.placed_bias.size() +
                 (E.placed_nm ? E.placed_nm->data.size() + sizeof(float) * E.placed_nm->dim_scale.size() +
                                    E.placed_nm->group_d.size() + E.placed_nm->group_m.size() : 0);
    return b;
}

void Session::set_predictors(std::shared_ptr<const Predictors> p) {
    const HParams& hp = model_->hp;
    if (p && hp.is_moe())
        throw ArgumentError("predictors: this model's FFNs are mixtures of experts, which run dense (the sparse FFN, "
                            "predictors and the activation profiler do not handle experts yet)");
    if (p) {
        if ((int64_t)p->layers.size() != hp.n_layer)
            throw ArgumentError(format("predictors for %zu layers; the model has %d", p->layers.size(), hp.n_layer));
        for (const LayerPredictor& L : p->layers)
            if (L.a.cols != hp.n_embd || L.b.rows != hp.n_ff || L.bias.cols != hp.n_ff)
                throw ArgumentError("the predictors do not fit this model's shapes");
    }
    predictors_ = std::move(p);
    if (predictors_) {
        place_weights();
        prepare_sparse();
    } else {
        free_placed();  // only predictors read them
        weights_placed_ = false;
        if (sparsity_.enabled) prepare_sparse();  // the criterion's down copies, in the file's order
    }
    reset_sparsity_counts();
}

void Session::reset_sparsity_counts() {
    host_active_.assign(model_->hp.n_layer, 0);
    device_active_.assign(model_->hp.n_layer, 0);
    ffn_seen_.assign(model_->hp.n_layer, 0);
}

std::vector<int64_t> Session::ffn_active() const {
    std::vector<int64_t> a(host_active_.size());
    for (size_t i = 0; i < a.size(); i++)  // (a mixture of experts computes every neuron of the chosen experts)
        a[i] = model_->layers[i].moe.present() ? ffn_seen_[i] : host_active_[i] + device_active_[i];
    return a;
}

void Session::truncate(int32_t n) {
    kv_->truncate(0, n);
    if (recorder_ && n == 0) recorder_->new_sequence();  // the next token follows none
}

void Session::set_recorder(std::shared_ptr<ActivationRecorder> rec) {
    if (rec && plan_.uses_device())
        throw ArgumentError("profiling runs the model on the CPU alone: make the Model with device='cpu'");
    recorder_ = std::move(rec);
    if (recorder_) place_weights();  // the recorder reads the FFN's rows
    else weights_placed_ = false;
}

void Session::eval(const int32_t* tokens, int32_t n, bool all_logits, float* logits) {
    if (n <= 0) throw ArgumentError("eval needs at least one token");
    const int32_t n_past = kv_->seq_len(0);
    if ((int64_t)n_past + n > n_ctx_)
        throw ContextOverflowError(format("%d tokens do not fit: the context holds %d and %d are used (n_ctx=%d)", n,
                                          n_ctx_, n_past, n_ctx_));
    std::vector<int32_t> seq(n, 0), pos(n);
    std::vector<uint8_t> want(n, all_logits ? 1 : 0);
    for (int32_t i = 0; i < n; i++) pos[i] = n_past + i;
    if (logits) want[n - 1] = 1;
    else std::fill(want.begin(), want.end(), 0);
    decode(tokens, seq.data(), pos.data(), want.data(), n, logits);
}

void Session::hidden_states(const int32_t* tokens, int32_t n, int32_t seq, float* hidden) {
    if (n <= 0) throw ArgumentError("hidden_states needs at least one token");
    kv_->check_seq(seq);
    const int32_t n_past = kv_->seq_len(seq);
    if ((int64_t)n_past + n > n_ctx_)
        throw ContextOverflowError(format("%d tokens do not fit: the context holds %d and %d are used (n_ctx=%d)", n,
                                          n_ctx_, n_past, n_ctx_));
    std::vector<int32_t> seqs(n, seq), pos(n);
    for (int32_t i = 0; i < n; i++) pos[i] = n_past + i;
    const std::vector<uint8_t> want(n, 0);
    struct Flag {
        Session& s;
        ~Flag() { s.hidden_out_ = nullptr; }
    } flag{*this};
    hidden_out_ = hidden;
    decode(tokens, seqs.data(), pos.data(), want.data(), n, nullptr);
}

// The batch's residual stream (on the host after output()) through the output norm, double sums as ggml's.
void Session::write_hidden(int32_t n, float* hidden) const {
    const HParams& hp = model_->hp;
    host_->synchronize();
    const float* w = (const float*)model_->output_norm.data;
    for (int32_t t = 0; t < n; t++) {
        const float* x = host_s_.x + (size_t)t * hp.n_embd;
        double sum = 0.0;
        for (int32_t i = 0; i < hp.n_embd; i++) sum += (double)(x[i] * x[i]);
        const float scale = 1.0f / std::sqrt((float)(sum / hp.n_embd) + hp.rms_eps);
        float* out = hidden + (size_t)t * hp.n_embd;
        for (int32_t i = 0; i < hp.n_embd; i++) out[i] = x[i] * scale * w[i];
    }
}

int32_t Session::decode(const int32_t* tokens, const int32_t* seq, const int32_t* pos, const uint8_t* want, int32_t n,
                        float* logits) {
    const HParams& hp = model_->hp;
    if (n <= 0) throw ArgumentError("decode needs at least one token");
    // Check the whole batch before running any of it.
    std::vector<int32_t> len(kv_->n_seq()), last(kv_->n_seq(), -1);
    for (int32_t s = 0; s < kv_->n_seq(); s++) len[s] = kv_->seq_len(s);
    int32_t n_out = 0;
    for (int32_t t = 0; t < n; t++) {
        if (tokens[t] < 0 || tokens[t] >= hp.n_vocab)
            throw ArgumentError(format("token id %d is out of range [0, %d)", tokens[t], hp.n_vocab));
        kv_->check_seq(seq[t]);
        const int32_t s = seq[t], p = pos[t];
        if (p < 0) throw ArgumentError(format("token %d: negative position %d", t, p));
        if (p >= n_ctx_)
            throw ContextOverflowError(format("token %d: position %d of sequence %d does not fit: each sequence holds "
                                              "%d positions (n_ctx)", t, p, s, n_ctx_));
        if (last[s] >= 0 ? p != last[s] + 1 : p > len[s])
            throw ArgumentError(format("token %d: position %d of sequence %d does not follow on (%s %d)", t, p, s,
                                       last[s] >= 0 ? "the batch's previous token of it is at" : "it holds",
                                       last[s] >= 0 ? last[s] : len[s]));
        last[s] = p;
        n_out += want[t] != 0;
    }
    if (n_out > 0 && !logits) throw ArgumentError("decode: tokens want logits but no output was given");
    if (!weights_placed_) place_weights();
    // The layout stays as it is until the step ends (another session's constructor may want rows).
    std::shared_lock<std::shared_mutex> layout(model_->layout_mutex());

    std::vector<int32_t> rows;
    for (int32_t done = 0; done < n;) {
        const int32_t m = std::min(n_batch_, n - done);
        rows.clear();
        for (int32_t t = 0; t < m; t++)
            if (want[done + t]) rows.push_back(t);
        const BatchView b{m, seq + done, pos + done};
        bool offload = false;
        for (int32_t t = 0; t < m && !offload; t++) offload = kv_->on_host(seq[done + t]);
        if (offload) forward_offload(tokens + done, b, rows.data(), (int32_t)rows.size(), logits);
        else forward(tokens + done, b, rows.data(), (int32_t)rows.size(), logits);
        if (hidden_out_) write_hidden(m, hidden_out_ + (size_t)done * hp.n_embd);
        for (int32_t t = 0; t < m; t++) kv_->set_seq_len(seq[done + t], pos[done + t] + 1);
        if (logits) logits += rows.size() * (size_t)hp.n_vocab;
        done += m;
        if (done < n && interrupt_check_) interrupt_check_();
    }
    return n_out;
}

}  // namespace optiml
