// Session::LayerExec, private to native/src/model (session.cpp builds it, forward.cpp reads it).
#pragma once

#include <memory>
#include <vector>

#include "optiml/huge_pages.h"
#include "optiml/model.h"
#include "optiml/sparse.h"

namespace optiml {

// What the forward pass needs of one layer, resolved from the plan once.
struct Session::LayerExec {
    Backend* attn = nullptr;              // attention, KV cache and the residual stream
    const LayerWeights* attn_w = nullptr;  // the layer's weights as that backend holds them
    int32_t k = 0;                         // placed neurons on the device
    FFNShare host_share, device_share;
    std::vector<int32_t> host_rows;        // file neurons the host computes (empty: all, or none)
    std::vector<int32_t> device_rows;      // file neurons of the device's share, in its packed order
    const MoEWeights* moe_w = nullptr;     // a mixture of experts: its weights where it runs (k > 0: the device)
    FFNWeights device_ffn;                 // the device's packed share
    NeuronMajor device_nm;                 // its down rows when they are not a column slice
    std::unique_ptr<NeuronMajor> host_nm;  // neuron-major down rows of the host's neurons (sparse FFN)
    bool host_nm_compact = false;  // host_nm was made for SparsitySettings::compact_down
    std::vector<int32_t> host_slot;        // file neuron -> row of host_nm
    // With a predictor, in a file whose placement kept the stored order and records a co-activation order
    // (optiml.placement.neuron_order and .order): the host's neurons (placed [k, n_ff)) as a copy of their
    // gate/up rows and biases in the placed order, so that neurons that fire together are read as runs,
    // with down's neuron-major rows in the same order (FFNShare::stored; Session::prepare_placed).
    FFNShare host_placed;
    FFNWeights placed_ffn;
    HugePageVector<uint8_t> placed_rows;  // gate rows, then up rows
    std::vector<float> placed_bias;       // gate's, then up's (when present)
    std::unique_ptr<NeuronMajor> placed_nm;
    bool placed_nm_compact = false;

    // The host's share as a step reads it: with a predictor, from the placed copy where there is one.
    const FFNShare& host_ffn(const FFNSparsity& sp) const {
        return sp.predictor && host_placed.w ? host_placed : host_share;
    }
    // A mixture of experts split between the devices (LayerPlan::device_experts; the device's weights in
    // device_layers_[il].moe, its experts numbered in the plan's order): the order of the experts' rows
    // in a step, the host's experts (by id) and then the device's, and how many are the host's.
    std::vector<int32_t> expert_order;
    int32_t n_host_experts = 0;
};

// The buffers of the layers whose experts are split (Session::moe_split), for n_batch tokens: on the
// device (moe_split_scratch_bytes) and on the host, and the step's routing, made on the host.
struct Session::MoESplit {
    float *dev_logits = nullptr, *dev_d = nullptr, *dev_sy = nullptr, *dev_sgate = nullptr, *dev_weight = nullptr;
    int32_t* dev_slot = nullptr;
    // On the host, in one pinned block: d holds the host experts' rows, d2 the device's copied back.
    float *logits = nullptr, *d = nullptr, *d2 = nullptr, *sy = nullptr, *sgate = nullptr, *weight = nullptr;
    int32_t* slot = nullptr;
    std::vector<int32_t> chosen, count, first, token;
    std::vector<int32_t> host_count, dev_first, dev_count;
};

}  // namespace optiml
