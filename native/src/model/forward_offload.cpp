// CPU attention offload (NEO, MLSys 2025): the forward pass of a batch some of whose sequences keep their
// KV cache in host memory. The plan holds every layer's attention weights on the device; the device
// keeps the KV cache of the other sequences. The batch is split into two sub-batches of whole sequences,
// each ordered device sequences first, then host sequences. Per layer the device projects q/k/v of both
// sub-batches, sends the host sequences' rows over and computes its own sequences' attention; the host
// computes the attention of its sequences in one sub-batch while the device goes on with the other
// sub-batch's work (the output projection and FFN of sub-batch 0 run on the device while the host
// attends for sub-batch 1, and the device's q/k/v and attention of sub-batch 1 while the host attends for
// sub-batch 0). The arithmetic of every token is the one of the plain forward pass: only where it runs
// changes.
//
// Which sequences live where is the caller's choice (KVCache::place; the server's scheduler decides it).
#include <algorithm>

#include "layer_exec.h"
#include "optiml/common.h"
#include "optiml/kv_cache.h"
#include "optiml/model.h"

namespace optiml {

void Session::forward_offload(const int32_t* tokens, const BatchView& b, const int32_t* out_rows, int32_t n_out,
                              float* logits) {
    const Model& M = *model_;
    const HParams& hp = M.hp;
    Backend* host = host_.get();
    Backend* dev = device_.get();
    for (int il = 0; il < hp.n_layer; il++)
        if (exec_[il].attn != dev)
            throw ArgumentError("CPU attention offload needs every layer's attention on the device");
    const int32_t n = b.n;

    // Sequences in order of first appearance, dealt to the two sub-batches so that their token counts
    // come out close; then each sub-batch's tokens, device sequences first, in batch order.
    std::vector<int32_t> seqs, count(kv_->n_seq(), 0);
    for (int32_t t = 0; t < n; t++)
        if (count[b.seq[t]]++ == 0) seqs.push_back(b.seq[t]);
    std::vector<int8_t> group(kv_->n_seq(), -1);
    int32_t load[2] = {0, 0};
    for (int32_t s : seqs) {
        const int g = load[1] < load[0] ? 1 : 0;
        group[s] = (int8_t)g;
        load[g] += count[s];
    }
    std::vector<int32_t> order, inv(n);
    int32_t bounds[2][3];  // sub-batch g: [bounds[g][0], bounds[g][1]) device tokens, then host to bounds[g][2]
    for (int g = 0; g < 2; g++) {
        bounds[g][0] = (int32_t)order.size();
        for (int host_part = 0; host_part < 2; host_part++) {
            for (int32_t t = 0; t < n; t++)
                if (group[b.seq[t]] == g && (int)kv_->on_host(b.seq[t]) == host_part) order.push_back(t);
            bounds[g][1 + host_part] = (int32_t)order.size();
        }
    }
    off_tok_.resize(n);
    off_seq_.resize(n);
    off_pos_.resize(n);
    off_slot_.resize(n);
    for (int32_t i = 0; i < n; i++) {
        off_tok_[i] = tokens[order[i]];
        off_seq_[i] = b.seq[order[i]];
        off_slot_[i] = kv_->device_slot(b.seq[order[i]]);
        off_pos_[i] = b.pos[order[i]];
        inv[order[i]] = i;
    }
    // The logits come out for the same tokens in the same order: only their rows move.
    off_rows_.resize(n_out);
    for (int32_t i = 0; i < n_out; i++) off_rows_[i] = inv[out_rows[i]];

    const size_t x_floats = (size_t)n * hp.n_embd;
    trace_layer(-1);
    host->embed(M.tok_embd, off_tok_.data(), n, hp.embd_scale, host_s_.x);
    move(host, host_s_.x, dev, device_s_.x, x_floats);

    const size_t q_row = sizeof(float) * hp.n_embd_q(), kv_row = sizeof(float) * hp.n_embd_kv();
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerExec& E = exec_[il];
        const LayerWeights& DW = *E.attn_w;       // the layer's weights on the device
        const LayerWeights& HW = M.layers[il];    // and in host memory (q/k norms)
        trace_layer(il);
        Event sent[2];
        // The device's part of both sub-batches first: q/k/v, the host rows sent, its own attention.
        for (int g = 0; g < 2; g++) {
            const int32_t g0 = bounds[g][0], gd = bounds[g][1], g1 = bounds[g][2];
            if (g1 == g0) continue;
            const StepScratch ds = scratch_rows(dev, g0);
            dev->attention_qkv(hp, DW, ds.x, g1 - g0, ds);
            if (g1 > gd) {
                const StepScratch dh = scratch_rows(dev, gd), hh = scratch_rows(host, gd);
                dev->copy_to_host(hh.q, dh.q, q_row * (g1 - gd));
                dev->copy_to_host(hh.k, dh.k, kv_row * (g1 - gd));
                dev->copy_to_host(hh.v, dh.v, kv_row * (g1 - gd));
                sent[g] = dev->record();
            }
            if (gd > g0)
                dev->attention_core(hp, il, DW, device_rope_freqs_, kv_->layer(il),
                                    BatchView{gd - g0, off_slot_.data() + g0, off_pos_.data() + g0}, ds);
        }
        // Then, per sub-batch, the host's attention (overlapping the device's queued work), its result
        // sent back, and the sub-batch's output projection and FFN queued on the device.
        for (int g = 0; g < 2; g++) {
            const int32_t g0 = bounds[g][0], gd = bounds[g][1], g1 = bounds[g][2];
            if (g1 == g0) continue;
            if (g1 > gd) {
                const StepScratch dh = scratch_rows(dev, gd), hh = scratch_rows(host, gd);
                host->wait(sent[g]);
                host->attention_core(hp, il, HW, rope_freqs_, kv_->host_layer(il),
                                     BatchView{g1 - gd, off_seq_.data() + gd, off_pos_.data() + gd}, hh);
                dev->copy_from_host(dh.attn, hh.attn, q_row * (g1 - gd));
            }
            const StepScratch ds = scratch_rows(dev, g0);
            dev->attention_out(hp, DW, g1 - g0, ds.x, ds);
            ffn_layer(il, g1 - g0, dev, g0);
        }
        ffn_seen_[il] += (int64_t)n * hp.n_ff;
    }
    output(dev, n, off_rows_.data(), n_out, logits);
}

}  // namespace optiml
