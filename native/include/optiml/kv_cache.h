// The KV cache as a unit of its own: per layer, keys and values of n_seq sequences of up to n_ctx
// positions each, on the backend that computes that layer's attention. Sequences are slots: a batch
// may hold tokens of several, each attending to its own slot only.
//
// CPU attention offload (NEO): the layers' backend may hold fewer slots than there are sequences. A
// sequence then lives either in a device slot or in host memory (a host slot per sequence id), where
// the host computes its attention (forward_offload.cpp); place() moves it between the two.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optiml/backend.h"

namespace optiml {

struct HParams;

// The KV cache's element types: F16, F32, and the block formats Q8_0 and Q4_0 (32 values a block, along
// a head's dimensions: the head dimension must be a multiple of 32).
inline bool kv_type_quantized(int32_t type) { return type == TYPE_Q8_0 || type == TYPE_Q4_0; }
// ArgumentError naming the types this cache stores when `type_k` or `type_v` is not one of them, or when
// a quantized one does not fit the model's heads.
void check_kv_types(const HParams& hp, int32_t type_k, int32_t type_v);
// A cache type by llama.cpp's name ("f16", "q8_0"; --cache-type-k/-v).
std::string kv_type_name(int32_t type);

class KVCache {
public:
    // layer_backend[il]: where layer il's cache lives (its memory is counted there as "kv"), with
    // n_seq_device slots (< 0: n_seq). Sequences [0, n_seq_device) start in those slots, the others on
    // the host. host: the host backend, for offloaded sequences; may be null when n_seq_device = n_seq
    // and nothing is ever offloaded.
    // type: the keys' element type; type_v the values' (< 0: the same as the keys').
    KVCache(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t type, const std::vector<Backend*>& layer_backend,
            Backend* host = nullptr, int32_t n_seq_device = -1, int32_t type_v = -1);

    int32_t n_ctx() const { return n_ctx_; }
    int32_t n_seq() const { return n_seq_; }
    int32_t n_seq_device() const { return n_slots_; }
    int32_t type() const { return type_; }
    int32_t type_v() const { return type_v_; }
    // Layer il's cache on its backend, indexed by device slot (device_slot()), and on the host, indexed
    // by sequence id (allocated on the first offload).
    const KVLayerView& layer(int il) const { return layers_[il]; }
    const KVLayerView& host_layer(int il) const { return host_layers_[il]; }

    // Positions held by sequence s.
    int32_t seq_len(int32_t s) const;
    void set_seq_len(int32_t s, int32_t n) { len_[s] = n; }
    // Forgets sequence s (all sequences when s < 0).
    void clear(int32_t s);
    // Keeps the first n positions of sequence s.
    void truncate(int32_t s, int32_t n);
    // Sequence dst becomes the first n positions of src (n < 0: all of them); for prefix reuse. dst stays
    // where it lives (device or host): the positions are copied across when src lives elsewhere.
    void copy(int32_t src, int32_t dst, int32_t n);

    void check_seq(int32_t s) const;

    // Where sequence s lives: its device slot, or -1 in host memory.
    int32_t device_slot(int32_t s) const { return slot_[s]; }
    bool on_host(int32_t s) const { return slot_[s] < 0; }
    // Moves sequence s to host memory or into a free device slot, and waits for the copies.
    // ArgumentError when some layer's cache is on the host itself (nothing to offload from), or when
    // every device slot is taken.
    void place(int32_t s, bool on_host);

private:
    std::vector<KVLayerView> alloc_layers(const std::vector<Backend*>& where, int32_t n_slots) const;
    void check_offload() const;
    void alloc_host_layers();

    int32_t n_ctx_, n_seq_, n_slots_, type_, type_v_;
    int64_t n_embd_kv_;
    std::vector<KVLayerView> layers_;
    std::vector<Backend*> backend_;
    std::vector<int32_t> len_;
    Backend* host_;
    std::vector<KVLayerView> host_layers_;  // empty until a sequence lives on the host
    std::vector<int32_t> slot_;             // sequence -> device slot, -1: host
    std::vector<uint8_t> slot_used_;
};

}  // namespace optiml
