#include "optiml/kv_cache.h"

#include <set>

#include "optiml/common.h"
#include "optiml/model.h"
#include "optiml/quant.h"

namespace optiml {

KVCache::KVCache(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t type,
                 const std::vector<Backend*>& layer_backend)
    : n_ctx_(n_ctx), n_seq_(n_seq), type_(type), n_embd_kv_(hp.n_embd_kv()), backend_(layer_backend),
      len_(n_seq, 0) {
    if (type != TYPE_F16 && type != TYPE_F32) throw ArgumentError("the KV cache type must be f16 or f32");
    if (n_ctx <= 0 || n_seq <= 0) throw ArgumentError("the KV cache needs n_ctx > 0 and n_seq > 0");
    layers_.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) {
        KVLayerView& v = layers_[il];
        v.type = type;
        v.n_ctx = n_ctx;
        v.k_row = row_size(type, n_embd_kv_);
        v.k_seq = v.k_row * (size_t)n_ctx;
        v.v_seq = v.k_seq;
        // Zeroed: the padded attention window multiplies values past a sequence's end by weight 0.
        v.k = (uint8_t*)backend_[il]->alloc(v.k_seq * n_seq, "kv");
        v.v = (uint8_t*)backend_[il]->alloc(v.v_seq * n_seq, "kv");
    }
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
    const size_t elem = type_traits(type_).type_size;
    std::set<Backend*> used;
    for (size_t il = 0; il < layers_.size(); il++) {
        const KVLayerView& v = layers_[il];
        Backend* be = backend_[il];
        used.insert(be);
        if (n == 0) continue;
        be->copy(v.k + (size_t)dst * v.k_seq, v.k + (size_t)src * v.k_seq, (size_t)n * v.k_row);
        for (int64_t j = 0; j < n_embd_kv_; j++)
            be->copy(v.v + (size_t)dst * v.v_seq + (size_t)j * n_ctx_ * elem,
                     v.v + (size_t)src * v.v_seq + (size_t)j * n_ctx_ * elem, (size_t)n * elem);
    }
    for (Backend* be : used) be->synchronize();
    len_[dst] = n;
}

}  // namespace optiml
