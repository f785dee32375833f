// The KV cache as a unit of its own: per layer, keys and values of n_seq sequences of up to n_ctx
// positions each, on the backend that computes that layer's attention. Sequences are slots: a batch
// may hold tokens of several, each attending to its own slot only.
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/backend.h"

namespace optiml {

struct HParams;

class KVCache {
public:
    // layer_backend[il]: where layer il's cache lives (its memory is counted there as "kv").
    KVCache(const HParams& hp, int32_t n_ctx, int32_t n_seq, int32_t type, const std::vector<Backend*>& layer_backend);

    int32_t n_ctx() const { return n_ctx_; }
    int32_t n_seq() const { return n_seq_; }
    int32_t type() const { return type_; }
    const KVLayerView& layer(int il) const { return layers_[il]; }

    // Positions held by sequence s.
    int32_t seq_len(int32_t s) const;
    void set_seq_len(int32_t s, int32_t n) { len_[s] = n; }
    // Forgets sequence s (all sequences when s < 0).
    void clear(int32_t s);
    // Keeps the first n positions of sequence s.
    void truncate(int32_t s, int32_t n);
    // Sequence dst becomes the first n positions of src (n < 0: all of them); for prefix reuse.
    void copy(int32_t src, int32_t dst, int32_t n);

    void check_seq(int32_t s) const;

private:
    int32_t n_ctx_, n_seq_, type_;
    int64_t n_embd_kv_;
    std::vector<KVLayerView> layers_;
    std::vector<Backend*> backend_;
    std::vector<int32_t> len_;
};

}  // namespace optiml
