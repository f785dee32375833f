// The forward pass of a llama-family model (llama, mistral, qwen2, qwen3, gemma2, gemma3, smollm3, phi3) for one
// batch, top to bottom: embed -> per layer (attention, FFN) -> final norm -> logits. Every op goes to the
// backend the plan names; the residual stream follows the layer's attention, and a layer's FFN may run on two devices
// at once, each over its share of the neurons, the parts summed where the residual lives.
#include <algorithm>
#include <cstring>
#include <functional>

#include "layer_exec.h"
#include "optiml/model.h"
#include "optiml/predictor.h"

namespace optiml {

const StepScratch& Session::scratch(const Backend* be) const { return be == host_.get() ? host_s_ : device_s_; }

// The scratch of `be` from token row r0 on: a sub-batch's rows of every buffer.
StepScratch Session::scratch_rows(const Backend* be, int32_t r0) const {
    const HParams& hp = model_->hp;
    StepScratch s = scratch(be);
    const size_t r = (size_t)r0;
    for (float** p : {&s.x, &s.xn, &s.y, &s.y2}) *p += r * hp.n_embd;
    for (float** p : {&s.q, &s.attn}) *p += r * hp.n_embd_q();
    for (float** p : {&s.k, &s.v}) *p += r * hp.n_embd_kv();
    for (float** p : {&s.gate, &s.up}) *p += r * hp.n_ff;
    return s;
}

void Session::trace_layer(int layer) {
    host_->trace_layer(layer);
    if (device_) device_->trace_layer(layer);
}

void Session::timeline_start() {
    host_->trace_start();
    if (device_) device_->trace_start();
}

std::vector<Session::TimedSpan> Session::timeline_stop() {
    std::vector<TimedSpan> out;
    for (const Span& s : host_->trace_stop()) out.push_back({0, s});
    if (device_)
        for (const Span& s : device_->trace_stop()) out.push_back({1, s});
    std::stable_sort(out.begin(), out.end(), [](const TimedSpan& a, const TimedSpan& b) { return a.span.t0 < b.span.t0; });
    return out;
}

// Moves n floats between backends in stream order: the receiver can use them in its next op.
void Session::move(Backend* from, const float* src, Backend* to, float* dst, size_t n) {
    if (from == to) return;
    if (from->synchronous()) {  // the host's data is ready now
        to->copy_from_host(dst, src, n * sizeof(float));
    } else {
        from->copy_to_host(dst, src, n * sizeof(float));
        to->wait(from->record());
    }
}

void Session::forward(const int32_t* tokens, const BatchView& b, const int32_t* out_rows, int32_t n_out,
                      float* logits) {
    const Model& M = *model_;
    const HParams& hp = M.hp;
    const int32_t n = b.n;
    const size_t x_floats = (size_t)n * hp.n_embd;

    // The attention reads each sequence's KV cache at its device slot.
    slot_buf_.resize(n);
    for (int32_t t = 0; t < n; t++) slot_buf_[t] = kv_->device_slot(b.seq[t]);
    const BatchView kb{n, slot_buf_.data(), b.pos};

    Backend* home = host_.get();  // where the residual stream is
    trace_layer(-1);
    home->embed(M.tok_embd, tokens, n, hp.embd_scale, host_s_.x);
    if (forward_recorded(kb, out_rows, n_out, logits)) return;

    // A short step of a model split between the devices: the device's work between two points where the
    // host meets it is recorded and replayed as a unit (device_segment); its attention reads the step's
    // positions from where upload_batch puts them.
    Backend* dev = device_.get();
    segments_ = dev && n <= kMaxRecordedTokens && !host_->tracing() && !recorder_;
    struct Reset {
        bool& on;
        ~Reset() { on = false; }
    } reset{segments_};  // (an exception leaves no later step of another kind recording)
    if (segments_ && plan_.layers_on_device() > 0) dev->upload_batch(kb);
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerExec& E = exec_[il];
        trace_layer(il);
        move(home, scratch(home).x, E.attn, scratch(E.attn).x, x_floats);
        home = E.attn;
        const Weight& rope_freqs = home == host_.get() ? rope_freqs_ : device_rope_freqs_;
        auto attention = [&] {
            home->attention(hp, il, *E.attn_w, rope_freqs, kv_->layer(il), kb, scratch(home).x, scratch(home));
        };
        if (segments_ && home == dev && !M.layers[il].moe.present()) {
            // The FFN too when the whole of it runs on the device: the layer is one unit then.
            const bool whole = E.device_share.w && !E.host_share.w;
            const int64_t rows = whole ? (int64_t)n * E.device_share.w->gate.rows : 0;
            device_segment({-1 - il, n, 0, whole ? kSegmentLayer : kSegmentAttention}, il, rows, [&] {
                attention();
                if (whole) ffn_layer(il, n, home);
            });
            if (!whole) ffn_layer(il, n, home);
        } else {
            attention();
            ffn_layer(il, n, home);
        }
        ffn_seen_[il] += (int64_t)n * hp.n_ff;
    }

    output(home, n, out_rows, n_out, logits);
}

// A step with every layer and the logits on the device, of few tokens (decode): the device records its
// ops once per shape and launches them again as one unit (Backend::replay), since launching each of a
// step's hundreds of small ops from the host costs more than the GPU takes to run them. The same ops
// as the plain path, in the same order. False when the step does not qualify (the caller runs it).
bool Session::forward_recorded(const BatchView& kb, const int32_t* out_rows, int32_t n_out, float* logits) {
    const HParams& hp = model_->hp;
    Backend* dev = device_.get();
    const int32_t n = kb.n;
    // (while tracing every op is timed on its own, in its layer: no recorded steps)
    if (!whole_on_device_ || host_->tracing() || recorder_ || n > kMaxRecordedTokens || n_out > plan_.logits_rows)
        return false;
    // (a longer mixture-of-experts step routes on the host, which a recording cannot hold)
    if (hp.is_moe() && (int64_t)n * hp.n_expert_used > Backend::kMoEPairsOnDevice) return false;
    const size_t x_floats = (size_t)n * hp.n_embd;
    move(host_.get(), host_s_.x, dev, device_s_.x, x_floats);
    dev->upload_batch(kb);
    step_key_.assign({n, n_out});
    step_key_.insert(step_key_.end(), out_rows, out_rows + n_out);

    auto enqueue = [&] {
        for (int il = 0; il < hp.n_layer; il++) {
            trace_layer(il);  // (where the device counts the launches: Backend::launch_counts)
            dev->attention(hp, il, *exec_[il].attn_w, device_rope_freqs_, kv_->layer(il), kb, device_s_.x, device_s_);
            ffn_layer(il, n, dev);
        }
        trace_layer(-1);
        if (n_out > 0)
            dev->logits(hp, device_output_norm_, device_output_, device_s_.x, out_rows, n_out, device_logits_,
                        device_s_.xn);
    };
    if (dev->replay(step_key_)) {
        for (int il = 0; il < hp.n_layer; il++)  // what the recorded ffn ops counted when they were enqueued
            if (exec_[il].device_share.w) device_active_[il] += (int64_t)n * exec_[il].device_share.w->gate.rows;
    } else {
        const bool recording = dev->capture_begin(step_key_);
        const std::vector<int64_t> counted = device_active_;
        bool ran = true;
        try {
            enqueue();
        } catch (...) {
            if (!recording) throw;
            // An op that cannot be recorded (one that waits on the host, such as a mixture's routing on the
            // host) fails the capture: the key is not recorded again, and the ops run plain, as
            // device_segment does. A real error then fails them plain too.
            dev->capture_end(false);
            ran = false;
        }
        if (recording && (!ran || !dev->capture_end(true))) {  // not recorded: the ops did not run
            device_active_ = counted;
            enqueue();
        }
    }
    for (int il = 0; il < hp.n_layer; il++) ffn_seen_[il] += (int64_t)n * hp.n_ff;

    if (n_out > 0) dev->copy_to_host(logits, device_logits_, sizeof(float) * n_out * hp.n_vocab);
    move(dev, device_s_.x, host_.get(), host_s_.x, x_floats);
    return true;
}

// A split layer's device work between two points where the host meets the device (ffn_layer): replayed
// in one launch from its recording when the device holds one for `key`, else enqueued op by op, and
// recorded on the way where the device can (Backend::capture_begin), as forward_recorded does for whole
// steps. A split layer otherwise costs the host a launch per op, on the thread that then computes the
// host's share. Only in steps as short as forward_recorded's (segments_): beyond, launches are a small
// share of a step. Keys: {-1 - layer, tokens, first row, kind}, apart from forward_recorded's.
// `active`: what the unit's FFN share adds to device_active_[il] when enqueued (a replay adds it too).
void Session::device_segment(const std::vector<int32_t>& key, int il, int64_t active,
                             const std::function<void()>& enqueue) {
    Backend* dev = device_.get();
    if (!segments_ || in_segment_) {  // (a unit inside another is part of it)
        enqueue();
        return;
    }
    struct Inside {
        bool& on;
        explicit Inside(bool& b) : on(b) { on = true; }
        ~Inside() { on = false; }
    } inside{in_segment_};
    if (dev->replay(key)) {
        device_active_[il] += active;
        return;
    }
    const int64_t counted = device_active_[il];
    if (dev->capture_begin(key)) {
        bool launched = false;
        try {
            enqueue();
            launched = dev->capture_end(true);
        } catch (...) {
            dev->capture_end(false);  // (the key is not recorded again: its ops run plain from now on)
        }
        if (launched) return;
        device_active_[il] = counted;  // the ops did not run: they are enqueued plain below
    }
    enqueue();
}

// After the last layer: the final norm and the logits of the rows asked for, and the residual stream
// back on the host.
void Session::output(Backend* home, int32_t n, const int32_t* out_rows, int32_t n_out, float* logits) {
    const Model& M = *model_;
    const HParams& hp = M.hp;
    const size_t x_floats = (size_t)n * hp.n_embd;
    trace_layer(-1);
    if (plan_.output_on_device && n_out > 0) {  // home is the device: the last layer's attention runs there
        Backend* dev = device_.get();
        for (int32_t i = 0; i < n_out; i += plan_.logits_rows) {
            const int32_t c = std::min(plan_.logits_rows, n_out - i);
            dev->logits(hp, device_output_norm_, device_output_, device_s_.x, out_rows + i, c, device_logits_,
                        device_s_.xn);
            dev->copy_to_host(logits + (size_t)i * hp.n_vocab, device_logits_, sizeof(float) * c * hp.n_vocab);
        }
    }
    move(home, scratch(home).x, host_.get(), host_s_.x, x_floats);
    if (n_out > 0 && !plan_.output_on_device)
        host_->logits(hp, M.output_norm, M.output, host_s_.x, out_rows, n_out, logits, host_s_.xn);
}

// One layer's FFN: the norm where the residual lives (`home`), then each device's share of the neurons,
// the device's queued first so both run at once, and the sum joined into the residual stream.
void Session::ffn_layer(int il, int32_t n, Backend* home, int32_t r0) {
    const HParams& hp = model_->hp;
    const LayerExec& E = exec_[il];
    const LayerWeights& L = model_->layers[il];
    const StepScratch hs = scratch_rows(home, r0);
    const size_t xn_floats = (size_t)n * hp.n_embd;
    if (L.moe.present() && !E.expert_order.empty()) {  // its experts split between the devices
        moe_split(il, n, home, r0);
        return;
    }
    if (L.moe.present()) {  // a mixture of experts, whole on one device (k > 0: the device)
        Backend* be = E.k > 0 ? device_.get() : host_.get();
        home->rms_norm(hs.x, E.attn_w->ffn.norm, hs.xn, n, hp.n_embd, hp.rms_eps);
        const StepScratch s = scratch_rows(be, r0);
        move(home, hs.xn, be, s.xn, xn_floats);
        be->moe_ffn(hp, il, *E.moe_w, s.xn, n, s.y, be == host_.get() ? recorder_.get() : nullptr);
        move(be, s.y, home, hs.y, xn_floats);
        home->ffn_join(hp, E.attn_w->ffn, hs.y, nullptr, n, hs.x);
        return;
    }
    ActivationRecorder* rec = recorder_.get();
    FFNSparsity sp;
    if (sparsity_.enabled) {
        sp.enabled = true;
        sp.on_product = sparsity_.on_product;
        sp.threshold = sparsity_.threshold[il];
        sp.neuron_scale = sparsity_.neuron_scale.empty() ? nullptr : sparsity_.neuron_scale.data() + (size_t)il * hp.n_ff;
    }
    if (predictors_ && !rec) {
        if (!sp.enabled) {  // no criterion: every predicted neuron with a non-zero activation counts
            sp.enabled = true;
            sp.on_product = true;
            sp.threshold = 0.0f;
        }
        sp.predictor = &predictors_->layers[il];
        sp.group = predictor_group_;
    }

    // The device's share runs dense: which of its neurons fire is for its predictor to say (the hybrid
    // executor); the host skips inactive neurons of its own share.
    const FFNSparsity dense;
    Backend* host = host_.get();
    Backend* dev = device_.get();
    const bool on_host = E.host_share.w != nullptr, on_dev = E.device_share.w != nullptr;
    // The device's whole FFN where the residual stream is: norm, FFN and join as the device fuses them.
    if (on_dev && !on_host && home == dev &&
        dev->ffn_block(hp, il, E.device_share, E.attn_w->ffn, hs.x, n, hs, &device_active_[il]))
        return;
    const size_t xn_bytes = xn_floats * sizeof(float);
    const bool split = on_dev && on_host;
    const StepScratch ds = split ? scratch_rows(dev, r0) : StepScratch{};
    const StepScratch ks = split ? scratch_rows(host, r0) : StepScratch{};
    if (split && home == dev && segments_ && staging_pinned_) {
        ffn_split_units(il, n, r0, sp, ds, ks);
        return;
    }
    home->rms_norm(hs.x, E.attn_w->ffn.norm, hs.xn, n, hp.n_embd, hp.rms_eps);

    if (on_host != on_dev) {  // one device computes the whole FFN
        Backend* be = on_host ? host : dev;
        const FFNShare& share = on_host ? E.host_ffn(sp) : E.device_share;
        const StepScratch s = scratch_rows(be, r0);
        move(home, hs.xn, be, s.xn, xn_floats);
        int64_t* active = on_host ? &host_active_[il] : &device_active_[il];
        be->ffn(hp, il, share, on_host ? sp : dense, s.xn, n, s.y, s, active, on_host ? rec : nullptr);
        move(be, s.y, home, hs.y, xn_floats);
        home->ffn_join(hp, E.attn_w->ffn, hs.y, nullptr, n, hs.x);
        return;
    }

    // Split: the device's share is queued first, then the host computes its share while it runs.
    if (!sp.enabled && !rec) {
        ffn_split_exact(il, n, r0, home, ds, ks);
        return;
    }
    // A sparse host share: each device sums its own neurons' down rows and the two partial sums are
    // added (a reassociation of the unsplit sum; the sparse share differs from the dense run anyway).
    if (home == host) {
        auto share = [&] {
            dev->copy_from_host(ds.xn, ks.xn, xn_bytes);
            dev->ffn(hp, il, E.device_share, dense, ds.xn, n, ds.y, ds, &device_active_[il], nullptr);
        };
        Event done{};
        if (segments_ && staging_pinned_) {
            // The whole device part, its result's copy back included, queued (or replayed) before the host's
            // share: a copy into page-locked memory returns at once.
            device_segment({-1 - il, n, r0, kSegmentShareFromHost}, il, (int64_t)n * E.device_share.w->gate.rows, [&] {
                share();
                dev->copy_to_host(ks.y2, ds.y, xn_bytes);
            });
            done = dev->record();
            host->ffn(hp, il, E.host_ffn(sp), sp, ks.xn, n, ks.y, ks, &host_active_[il], nullptr);
        } else {
            share();
            host->ffn(hp, il, E.host_ffn(sp), sp, ks.xn, n, ks.y, ks, &host_active_[il], nullptr);
            // Queued after the host's share: a copy into pageable host memory blocks the calling thread
            // until the device gets there, which would otherwise serialize the two shares.
            dev->copy_to_host(ks.y2, ds.y, xn_bytes);
            done = dev->record();
        }
        host->wait(done);
        host->ffn_join(hp, L.ffn, ks.y, ks.y2, n, ks.x);
    } else {
        dev->copy_to_host(ks.xn, ds.xn, xn_bytes);
        const Event xn_ready = dev->record();
        dev->ffn(hp, il, E.device_share, dense, ds.xn, n, ds.y, ds, &device_active_[il], nullptr);
        host->wait(xn_ready);
        host->ffn(hp, il, E.host_ffn(sp), sp, ks.xn, n, ks.y, ks, &host_active_[il], nullptr);
        dev->copy_from_host(ds.y2, ks.y, xn_bytes);
        dev->ffn_join(hp, E.attn_w->ffn, ds.y, ds.y2, n, ds.x);
        // The host's y is read by the device's copy: the next host write to it comes after a wait on the
        // device (the next layer's xn_ready, or the residual's move back to the host).
    }
}

// A split layer whose residual stream is on the device, in recorded units (ffn_layer, device_segment; a
// step the profiler records is not recorded, so the sparse share here is the FFN's sparsity).
void Session::ffn_split_units(int il, int32_t n, int32_t r0, const FFNSparsity& sp, const StepScratch& ds,
                              const StepScratch& ks) {
    const HParams& hp = model_->hp;
    const LayerExec& E = exec_[il];
    Backend* host = host_.get();
    Backend* dev = device_.get();
    const FFNSparsity dense;
    const bool sparse_split = sp.enabled;
    const size_t xn_bytes = (size_t)n * hp.n_embd * sizeof(float);
    // Three units: the norm with its copy to the host (which the host waits for), the device's share with
    // its products' copies (which run meanwhile), and the host's part back with the join. The same ops as
    // ffn_layer's and ffn_split_exact's, in the same order on each device.
    device_segment({-1 - il, n, r0, kSegmentNorm}, il, 0, [&] {
        dev->rms_norm(ds.x, E.attn_w->ffn.norm, ds.xn, n, hp.n_embd, hp.rms_eps);
        dev->copy_to_host(ks.xn, ds.xn, xn_bytes);
    });
    const Event xn_ready = dev->record();
    const int64_t active = (int64_t)n * E.device_share.w->gate.rows;
    if (sparse_split) {
        device_segment({-1 - il, n, r0, kSegmentShare}, il, active, [&] {
            dev->ffn(hp, il, E.device_share, dense, ds.xn, n, ds.y, ds, &device_active_[il], nullptr);
        });
        host->wait(xn_ready);
        host->ffn(hp, il, E.host_ffn(sp), sp, ks.xn, n, ks.y, ks, &host_active_[il], nullptr);
    } else {  // ffn_split_exact's order
        const size_t share_bytes = (size_t)n * E.k * sizeof(float);
        device_segment({-1 - il, n, r0, kSegmentGateUp}, il, active, [&] {
            dev->ffn_gate_up(hp, il, E.device_share, ds.xn, n, ds.gate, ds.up, ds, &device_active_[il]);
            dev->copy_to_host(split_gate_, ds.gate, share_bytes);
            dev->copy_to_host(split_up_, ds.up, share_bytes);
        });
        const Event products = dev->record();
        host->wait(xn_ready);
        host->ffn_gate_up(hp, il, E.host_share, ks.xn, n, ks.gate, ks.up, ks, &host_active_[il]);
        host->wait(products);
        host->ffn_finish(hp, E.host_share, split_gate_, split_up_, E.device_rows.data(), E.k, n, ks.y, ks);
    }
    // (the host's y is read by the device's copy: the next host write to it comes after a wait on the
    // device, the next layer's xn_ready or the residual's move back to the host)
    device_segment({-1 - il, n, r0, sparse_split ? kSegmentJoinSum : kSegmentJoin}, il, 0, [&] {
        float* y = sparse_split ? ds.y2 : ds.y;
        dev->copy_from_host(y, ks.y, xn_bytes);
        dev->ffn_join(hp, E.attn_w->ffn, ds.y, sparse_split ? ds.y2 : nullptr, n, ds.x);
    });
}

// A dense split as one device computes the whole FFN: the device's gate and up products come to the
// host, which puts them beside its own and computes act(gate) * up and the whole down product (the host
// reads all of down's columns either way: its share's activations are zero-padded to full width). Every
// sum runs in the order of the unsplit run, so a split gives its bits where the devices' gate and up
// products agree bit for bit (a CPU device; see Backend::ffn_gate_up).
void Session::ffn_split_exact(int il, int32_t n, int32_t r0, Backend* home, const StepScratch& ds,
                              const StepScratch& ks) {
    const HParams& hp = model_->hp;
    const LayerExec& E = exec_[il];
    Backend* host = host_.get();
    Backend* dev = device_.get();
    const size_t xn_bytes = (size_t)n * hp.n_embd * sizeof(float);
    const size_t share_bytes = (size_t)n * E.k * sizeof(float);
    Event xn_ready{}, done{};
    if (home == host && segments_ && staging_pinned_) {
        // The device part with its products' copies back, queued (or replayed) before the host's share.
        device_segment({-1 - il, n, r0, kSegmentGateUpFromHost}, il, (int64_t)n * E.device_share.w->gate.rows, [&] {
            dev->copy_from_host(ds.xn, ks.xn, xn_bytes);
            dev->ffn_gate_up(hp, il, E.device_share, ds.xn, n, ds.gate, ds.up, ds, &device_active_[il]);
            dev->copy_to_host(split_gate_, ds.gate, share_bytes);
            dev->copy_to_host(split_up_, ds.up, share_bytes);
        });
        done = dev->record();
        host->ffn_gate_up(hp, il, E.host_share, ks.xn, n, ks.gate, ks.up, ks, &host_active_[il]);
    } else {
        if (home == host) dev->copy_from_host(ds.xn, ks.xn, xn_bytes);
        else {
            dev->copy_to_host(ks.xn, ds.xn, xn_bytes);
            xn_ready = dev->record();
        }
        dev->ffn_gate_up(hp, il, E.device_share, ds.xn, n, ds.gate, ds.up, ds, &device_active_[il]);
        if (home != host) host->wait(xn_ready);
        host->ffn_gate_up(hp, il, E.host_share, ks.xn, n, ks.gate, ks.up, ks, &host_active_[il]);
        // Queued after the host's share: a copy into pageable host memory would block this thread until
        // the device gets there, serializing the two shares.
        dev->copy_to_host(split_gate_, ds.gate, share_bytes);
        dev->copy_to_host(split_up_, ds.up, share_bytes);
        done = dev->record();
    }
    host->wait(done);
    host->ffn_finish(hp, E.host_share, split_gate_, split_up_, E.device_rows.data(), E.k, n, ks.y, ks);
    if (home == host) {
        host->ffn_join(hp, model_->layers[il].ffn, ks.y, nullptr, n, ks.x);
        return;
    }
    // The host's y is read by the device's copy: the next host write to it comes after a wait on the
    // device (the next layer's xn_ready, or the residual's move back to the host).
    dev->copy_from_host(ds.y, ks.y, xn_bytes);
    dev->ffn_join(hp, E.attn_w->ffn, ds.y, nullptr, n, ds.x);
}

}  // namespace optiml
