// A mixture of experts whose experts are split between the devices (LayerPlan::device_experts): the hot
// experts on the device, the others on the host, both computing at once.
//
//   1. the norm and the router where the residual lives (home); the logits go to the host;
//   2. the host picks each token's experts (moe_route) and groups the step's choices by expert, the
//      host's experts' rows first, then the device's;
//   3. the device runs its experts over their rows while the host runs its own; the shared expert runs
//      at home, after the device's experts there;
//   4. the sum of each token's experts, best first, as moe_ffn makes it, where the residual lives: on the
//      device (home there) the host's rows go to it beside the device's own, and the host does not wait
//      for it; on the host the device's rows (and a shared expert's output) come back to be summed.
// Each expert's rows stay on one device, in the same order as the unsplit run's, so every product meets
// the same tokens, and a split gives the unsplit run's bits where the two devices' products and sums agree
// bit for bit (a CPU device). The host waits for the device once a layer (the logits) with the residual
// there, twice with it on the host: in CPU attention offload (forward_offload.cpp) that also waits for the
// other sub-batch's queued work, so such layers overlap less there.
// Not yet: the router's top k on the device, which would spare the logits' trip to the host.
#include "../cpu/backend/moe_ffn.h"  // moe_combine: the host sums every token's experts
#include "optiml/moe_route.h"
#include "layer_exec.h"
#include "optiml/model.h"

namespace optiml {

void Session::moe_split(int il, int32_t n, Backend* home, int32_t r0) {
    const HParams& hp = model_->hp;
    const LayerExec& E = exec_[il];
    MoESplit& m = *moe_split_;
    Backend* host = host_.get();
    Backend* dev = device_.get();
    const MoEWeights& host_w = model_->layers[il].moe;  // every expert, the router and the shared expert
    const MoEWeights& dev_w = device_layers_[il].moe;   // the device's experts (and the rest when home)
    const StepScratch hs = scratch_rows(home, r0), ks = scratch_rows(host, r0), ds = scratch_rows(dev, r0);
    const int32_t X = hp.n_expert, k = hp.n_expert_used;
    const int64_t nk = (int64_t)n * k;
    const size_t x_floats = (size_t)n * hp.n_embd;
    const bool shared = model_->layers[il].moe.shared.gate.present();

    // 1. The norm and the router at home; the logits (and the input, for the host's experts) to the host.
    home->rms_norm(hs.x, E.attn_w->ffn.norm, hs.xn, n, hp.n_embd, hp.rms_eps);
    if (home == host) {
        host->moe_router(hp, il, host_w, ks.xn, n, m.logits);
    } else {
        dev->moe_router(hp, il, dev_w, ds.xn, n, m.dev_logits);
        dev->copy_to_host(ks.xn, ds.xn, x_floats * sizeof(float));
        dev->copy_to_host(m.logits, m.dev_logits, sizeof(float) * n * X);
        host->wait(dev->record());
    }

    // 2. Each token's experts, and the step's choices grouped by expert: the host's rows, then the device's.
    // The host buffers written here (routing, rows) may still be read by the device's copies of the last
    // split layer with the residual there: the wait above, or the one in move() that brought the residual
    // to the host since, orders this after them.
    m.chosen.resize(nk);
    moe_route(hp, m.logits, n, m.chosen.data(), m.weight);
    moe_group(m.chosen.data(), nk, k, X, E.expert_order.data(), m.count, m.first, m.token, m.slot);
    int64_t host_rows = 0;
    m.host_count = m.count;
    for (int32_t j = 0; j < X; j++) {
        const int32_t e = E.expert_order[j];
        if (j < E.n_host_experts)
            host_rows += m.count[e];
        else
            m.host_count[e] = 0;
    }
    const int32_t n_dev = X - E.n_host_experts;
    m.dev_first.resize(n_dev);
    m.dev_count.resize(n_dev);
    for (int32_t i = 0; i < n_dev; i++) {
        const int32_t e = E.expert_order[E.n_host_experts + i];
        m.dev_first[i] = (int32_t)(m.first[e] - host_rows);
        m.dev_count[i] = m.count[e];
    }
    const MoEGroups host_g{n, m.token.data(), host_rows, m.first.data(), m.host_count.data(), X};
    const MoEGroups dev_g{n, m.token.data() + host_rows, nk - host_rows, m.dev_first.data(), m.dev_count.data(), n_dev};

    // 3. The device's experts (and, at home there, the shared expert) queued, then the host's experts. With
    // the sum on the device, its rows follow where the host's will be copied.
    if (home == host) dev->copy_from_host(ds.xn, ks.xn, x_floats * sizeof(float));
    float* dev_rows = home == dev ? m.dev_d + host_rows * hp.n_embd : m.dev_d;
    dev->moe_experts(hp, il, dev_w, ds.xn, dev_g, dev_rows);
    if (shared && home == dev) dev->moe_shared(hp, il, dev_w, ds.xn, n, m.dev_sy, m.dev_sgate);
    host->moe_experts(hp, il, host_w, ks.xn, host_g, m.d);
    if (shared && home == host) host->moe_shared(hp, il, host_w, ks.xn, n, m.sy, m.sgate);

    // 4. At home on the device: the host's rows and the step's routing go to it, and it sums and joins.
    if (home == dev) {
        if (host_rows) dev->copy_from_host(m.dev_d, m.d, sizeof(float) * (size_t)host_rows * hp.n_embd);
        dev->copy_from_host(m.dev_weight, m.weight, sizeof(float) * nk);
        dev->copy_from_host(m.dev_slot, m.slot, sizeof(int32_t) * nk);
        dev->moe_combine(hp, n, m.dev_weight, m.dev_slot, m.dev_d, shared ? m.dev_sy : nullptr,
                         shared ? m.dev_sgate : nullptr, hs.y);
        dev->ffn_join(hp, E.attn_w->ffn, hs.y, nullptr, n, hs.x);
        return;
    }

    // At home on the host: the device's rows come back (queued after the host's share: a copy the device
    // cannot start yet would hold this thread), and the host sums and joins.
    dev->copy_to_host(m.d2, m.dev_d, sizeof(float) * (size_t)(nk - host_rows) * hp.n_embd);
    host->wait(dev->record());
    moe_combine(*pool_, hp, n, m.weight, m.slot, m.d, host_rows, m.d2,
                shared ? m.sy : nullptr, shared ? m.sgate : nullptr, ks.y);
    host->ffn_join(hp, E.attn_w->ffn, ks.y, nullptr, n, ks.x);
}

}  // namespace optiml
