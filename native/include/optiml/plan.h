// The execution plan: which device holds each part of each layer. Data, computed once from the file's
// placement metadata (`optiml solve`), a device memory budget and the user's overrides; the forward pass
// reads it and never branches on devices itself.
//
// Per layer: the backend of the attention (its weights, the layer's KV cache, and the residual stream
// while the layer runs), and the FFN neurons on the device, placed neurons [0, k); the host computes
// [k, n_ff). Placed neuron i is file neuron neuron_order[l][i] when the file stores an order (a placed
// file whose quantized down matrix could not be permuted), else neuron i itself. Byte counts are computed
// by the same functions the engine allocates with, and the engine checks that they agree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optiml/ggml_types.h"

namespace optiml {

class Model;
struct HParams;

struct PlanOptions {
    std::string device = "auto";        // "auto", "cpu", "cpu:N" (N >= 1, a CPU device for tests), "cuda[:N]"
    int64_t vram = -1;                  // device memory budget in bytes; -1: the device's own limit
    int32_t n_gpu_layers = -1;          // -1: from the placement and budget; N: the last N layers whole on the device
    std::vector<int32_t> gpu_neurons;   // overrides the file's per-layer placement ([n_layer]); empty: the file's
    int32_t n_ctx = 0, n_seq = 1, n_batch = 512;
    int32_t kv_type = TYPE_F16;         // the keys' (F16, F32, Q8_0, Q4_0)
    int32_t kv_type_v = -1;             // the values'; -1: kv_type
    int32_t device_threads = 1;         // threads of a cpu:N device
    // CPU attention offload: device bytes for the KV cache (-1: a slot for every sequence). The device
    // then holds the KV cache of as many sequences as fit; the others live in host memory, where the
    // host computes their attention (forward_offload.cpp). Needs every layer's attention on the device.
    int64_t kv_vram = -1;
    // Mixtures of experts: the experts (router, experts, shared expert) of layers [0, n_cpu_moe) stay on the
    // CPU while the rest of those layers may go to the device (llama.cpp's --n-cpu-moe; n_layer: --cpu-moe).
    // -1: where whole layers go. The other layers' experts go with their attention, or as the file's expert
    // placement says.
    int32_t n_cpu_moe = -1;
    // Mixtures of experts: per layer, the experts meant for the device, hottest first ([n_layer] lists of
    // expert ids), overriding the file's placement (`optiml solve`); empty: the file's. As many of each
    // list as the budget holds go to the device; the layer's other experts stay on the host and both run
    // at once (Session::moe_split). A layer whose every expert fits goes whole.
    std::vector<std::vector<int32_t>> gpu_experts;
};

struct LayerPlan {
    bool attn_on_device = false;  // attention weights, KV cache and the residual stream
    int32_t ffn_on_device = 0;    // placed neurons [0, k) on the device
    // A mixture of experts split between the devices: the experts on the device (all of them only where
    // the layer's attention, router and shared expert stay on the host; a layer whose every part goes has
    // ffn_on_device = n_ff instead). Its router and shared expert run where the layer's attention does.
    std::vector<int32_t> device_experts;
};

// Device bytes by use, as the engine allocates them.
struct PlanBytes {
    size_t attn_weights = 0, ffn_weights = 0, kv = 0, scratch = 0;
    size_t output = 0;  // the final norm, the output matrix and a buffer of logits_rows rows of logits
    size_t total() const { return attn_weights + ffn_weights + kv + scratch + output; }
};

struct Plan {
    std::string device;          // "" when the host runs everything
    std::string reason;          // how the plan was decided
    int64_t budget = -1;         // bytes; -1: none given
    std::vector<LayerPlan> layers;
    std::vector<int32_t> neuron_order;  // [n_layer * n_ff] placed -> file neuron; empty: identity
    PlanBytes device_bytes;
    // The logits on the device too (when the last layer's attention is there and the budget holds the output
    // matrix), logits_rows rows at a time.
    bool output_on_device = false;
    int32_t logits_rows = 0;
    size_t host_kv_bytes = 0, host_scratch_bytes = 0;
    int32_t n_ctx = 0, n_seq = 1, n_batch = 512, kv_type = TYPE_F16, device_threads = 1;
    int32_t kv_type_v = TYPE_F16;  // the values' type (kv_type: the keys')
    int32_t n_seq_device = 1;  // sequences whose KV cache the device (or, without one, the host) holds

    bool uses_device() const { return !device.empty(); }
    int32_t layers_on_device() const;   // attention on the device
    int64_t neurons_on_device() const;
    bool splits_experts() const;  // some layer's experts split between the devices (device_experts)
    // A readable table: per layer, where the attention and how many FFN neurons go to the device; bytes.
    std::string summary(const Model& m) const;
};

// Decides the plan; ArgumentError for an unknown device, a device this build or machine lacks, or
// overrides that do not fit the model or the budget.
Plan make_plan(const Model& m, const PlanOptions& o);

// Byte counts shared by the plan and the engine.
// Keys of kv_type and values of kv_type_v (< 0: kv_type).
size_t kv_layer_bytes(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t kv_type, int32_t kv_type_v = -1);
size_t scratch_bytes(const HParams& hp, int32_t n_batch);
// The device buffers of layers whose experts are split (Session::moe_split): the router's logits, the
// device experts' output rows (every row of a step, at most) and the shared expert's output and gate.
size_t moe_split_scratch_bytes(const HParams& hp, int32_t n_batch);
// One expert's gate, up and down; the router and shared expert (what a split layer's home holds).
size_t expert_bytes(const Model& m, int il);
size_t moe_home_bytes(const Model& m, int il);
// What is wrong with per-layer expert lists (gpu_experts): "" when there is one list per layer, each of
// distinct experts of the model.
std::string expert_lists_error(const HParams& hp, const std::vector<std::vector<int32_t>>& lists);
// Attention weights of layer il plus the FFN's norms and down bias (computed where the residual lives).
size_t attn_layer_bytes(const Model& m, int il);
// The device's share of layer il's FFN, k placed neurons (contiguous: down as a column slice; else
// neuron-major Q8_0 rows).
size_t ffn_share_bytes(const Model& m, int il, int32_t k, bool contiguous);
// The final norm, the output matrix and logits_rows rows of logits.
size_t output_bytes(const Model& m, int32_t logits_rows);
// The block size k must be a multiple of for a contiguous share (the down matrix's block size).
int32_t ffn_share_align(const Model& m, int il);

}  // namespace optiml
