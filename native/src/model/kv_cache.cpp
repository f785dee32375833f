#include "optiml/kv_cache.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "optiml/common.h"
#include "optiml/model.h"
#include "optiml/quant.h"

namespace optiml {

std::string kv_type_name(int32_t type) {
    const char* name = type >= 0 && type < TYPE_COUNT ? type_traits(type).name : nullptr;
    std::string s = name ? name : "unknown";
    for (char& c : s) c = (char)std::tolower((unsigned char)c);
    return s;
}

void check_kv_types(const HParams& hp, int32_t type_k, int32_t type_v) {
    for (int32_t t : {type_k, type_v}) {
        if (t != TYPE_F16 && t != TYPE_F32 && !kv_type_quantized(t))
            throw ArgumentError(
                format("the KV cache stores f16, f32, q8_0 or q4_0, not %s (type %d)", kv_type_name(t).c_str(), t));
        // A quantized head is whole blocks: attention reads a head's slice of a row block by block.
        if (kv_type_quantized(t) && hp.head_dim % 32)
            throw ArgumentError(format("a %s KV cache quantizes each head in blocks of 32 values, and this model's "
                                       "heads have %d: use kv_type 'f16'",
                                       kv_type_name(t).c_str(), hp.head_dim));
    }
}

KVCache::KVCache(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t type,
                 const std::vector<Backend*>& layer_backend, Backend* host, int32_t n_seq_device, int32_t type_v)
    : n_ctx_(n_ctx), n_seq_(n_seq), n_slots_(n_seq_device < 0 ? n_seq : n_seq_device), type_(type),
      type_v_(type_v < 0 ? type : type_v), n_embd_kv_(hp.n_embd_kv()), backend_(layer_backend), len_(n_seq, 0),
      host_(host), slot_(n_seq, -1), slot_used_(n_slots_, 0) {
    check_kv_types(hp, type_, type_v_);
    if (n_ctx <= 0 || n_seq <= 0) throw ArgumentError("the KV cache needs n_ctx > 0 and n_seq > 0");
    if (n_slots_ > n_seq) throw ArgumentError("the KV cache has more device slots than sequences");
    if (n_slots_ < n_seq) check_offload();
    if (n_slots_ > 0) layers_ = alloc_layers(backend_, n_slots_);
    else layers_.resize(backend_.size());
    for (int32_t s = 0; s < n_slots_; s++) {
        slot_[s] = s;
        slot_used_[s] = 1;
    }
    if (n_slots_ < n_seq) alloc_host_layers();
}

// Not page-locked (that would make all of it resident at once): a step moves only the queries, keys,
// values and attention outputs of the host's tokens, through the host scratch, which is; a sequence's
// cache crosses the bus only when it moves.
void KVCache::alloc_host_layers() {
    host_layers_ = alloc_layers(std::vector<Backend*>(backend_.size(), host_), n_seq_);
}

std::vector<KVLayerView> KVCache::alloc_layers(const std::vector<Backend*>& where, int32_t n_slots) const {
    std::vector<KVLayerView> layers(where.size());
    for (size_t il = 0; il < where.size(); il++) {
        KVLayerView& v = layers[il];
        v.type = type_;
        v.v_type = type_v_;
        v.n_ctx = n_ctx_;
        v.k_row = row_size(type_, n_embd_kv_);
        v.k_seq = v.k_row * (size_t)n_ctx_;
        // Transposed F16/F32 values take as many bytes as rows of them would; quantized ones are rows.
        v.v_row = kv_type_quantized(type_v_) ? row_size(type_v_, n_embd_kv_) : 0;
        v.v_seq = row_size(type_v_, n_embd_kv_) * (size_t)n_ctx_;
        // Zeroed: the padded attention window multiplies values past a sequence's end by weight 0.
        v.k = (uint8_t*)where[il]->alloc(v.k_seq * n_slots, "kv");
        v.v = (uint8_t*)where[il]->alloc(v.v_seq * n_slots, "kv");
    }
    return layers;
}

void KVCache::check_offload() const {
    for (Backend* be : backend_)
        if (!host_ || be == host_)
            throw ArgumentError("CPU attention offload needs every layer's attention (and KV cache) on the device: "
                                "this plan keeps some on the host");
}

void KVCache::place(int32_t s, bool to_host) {
    check_seq(s);
    if (on_host(s) == to_host) return;
    check_offload();
    if (host_layers_.empty()) alloc_host_layers();
    int32_t slot = slot_[s];
    if (!to_host) {
        slot = (int32_t)(std::find(slot_used_.begin(), slot_used_.end(), 0) - slot_used_.begin());
        if (slot == n_slots_)
            throw ArgumentError(format("the device's KV cache holds %d sequence(s) and all are there: move one to the "
                                       "host first", n_slots_));
    }
    std::set<Backend*> used;
    for (size_t il = 0; il < layers_.size(); il++) {
        const KVLayerView& d = layers_[il];
        const KVLayerView& h = host_layers_[il];
        Backend* be = backend_[il];
        used.insert(be);
        const size_t dk = (size_t)slot * d.k_seq, dv = (size_t)slot * d.v_seq;
        const size_t hk = (size_t)s * h.k_seq, hv = (size_t)s * h.v_seq;
        if (to_host) {
            be->copy_to_host(h.k + hk, d.k + dk, d.k_seq);
            be->copy_to_host(h.v + hv, d.v + dv, d.v_seq);
        } else {
            be->copy_from_host(d.k + dk, h.k + hk, d.k_seq);
            be->copy_from_host(d.v + dv, h.v + hv, d.v_seq);
        }
    }
    for (Backend* be : used) be->synchronize();
    slot_used_[slot] = !to_host;
    slot_[s] = to_host ? -1 : slot;
}

void KVCache::check_seq(int32_t s) const {
    if (s < 0 || s >= n_seq_)
        throw ArgumentError(format("sequence id %d is outside [0, %d) (n_seq)", s, n_seq_));
}

int32_t KVCache::seq_len(int32_t s) const {
    check_seq(s);
    return len_[s];
}

void KVCache::clear(int32_t s) {
    if (s < 0) {
        std::fill(len_.begin(), len_.end(), 0);
        return;
    }
    check_seq(s);
    len_[s] = 0;
}

void KVCache::truncate(int32_t s, int32_t n) {
    check_seq(s);
    if (n < 0 || n > len_[s])
        throw ArgumentError(format("cannot truncate sequence %d of %d positions to %d", s, len_[s], n));
    len_[s] = n;
}

void KVCache::copy(int32_t src, int32_t dst, int32_t n) {
    check_seq(src);
    check_seq(dst);
    if (n < 0) n = len_[src];
    if (n > len_[src])
        throw ArgumentError(format("cannot copy %d positions of sequence %d, which holds %d", n, src, len_[src]));
    if (src == dst) {
        len_[dst] = n;
        return;
    }
    // Each side in its own place: a device slot on the layer's backend, or the host's slot of the sequence.
    // The keys' first n rows are one block; the values (transposed) n positions per dimension, or
    // (quantized, rows) their first n rows too.
    const size_t elem = type_traits(type_v_).type_size;
    const bool v_rows = kv_type_quantized(type_v_);
    std::set<Backend*> used;
    for (size_t il = 0; il < layers_.size(); il++) {
        Backend* be = backend_[il];
        const bool sh = on_host(src), dh = on_host(dst);
        const KVLayerView& sv = sh ? host_layers_[il] : layers_[il];
        const KVLayerView& dv = dh ? host_layers_[il] : layers_[il];
        const int32_t si = sh ? src : slot_[src], di = dh ? dst : slot_[dst];
        // Host to host moves on the host; anything touching the device goes on the device's stream.
        Backend* runs = sh && dh ? host_ : be;
        used.insert(runs);
        if (n == 0) continue;
        auto move = [&](uint8_t* to, const uint8_t* from, size_t bytes) {
            if (sh == dh) runs->copy(to, from, bytes);
            else if (dh) be->copy_to_host(to, from, bytes);
            else be->copy_from_host(to, from, bytes);
        };
        move(dv.k + (size_t)di * dv.k_seq, sv.k + (size_t)si * sv.k_seq, (size_t)n * sv.k_row);
        if (v_rows) {
            move(dv.v + (size_t)di * dv.v_seq, sv.v + (size_t)si * sv.v_seq, (size_t)n * sv.v_row);
            continue;
        }
        if (sh != dh) {
            // Across the bus, one transfer of the slot's whole value block instead of n_embd_kv short
            // ones (each a round trip through pageable memory): the positions past n come along, finite
            // values the attention window weighs 0, as a truncated sequence leaves them.
            move(dv.v + (size_t)di * dv.v_seq, sv.v + (size_t)si * sv.v_seq, sv.v_seq);
            continue;
        }
        for (int64_t j = 0; j < n_embd_kv_; j++)
            move(dv.v + (size_t)di * dv.v_seq + (size_t)j * n_ctx_ * elem,
                 sv.v + (size_t)si * sv.v_seq + (size_t)j * n_ctx_ * elem, (size_t)n * elem);
    }
    for (Backend* be : used) be->synchronize();
    len_[dst] = n;
}

}  // namespace optiml
