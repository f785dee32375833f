// A KV cache in host memory in fixed blocks of positions, and decode attention over it on the CPU: the
// CPU side of NEO-style attention offload (issue #19). A sequence's keys and values live in whatever
// blocks its table lists, so sequences grow and are freed block by block, and a sequence can later move
// between the GPU's cache and this one without copying the others. Not yet used by the engine or the
// server: the two-sub-batch pipeline and its scheduler are still to be built on it.
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace optiml {

class PagedKV {
public:
    static constexpr int32_t kBlock = 32;  // positions per block

    // n_blocks blocks for every layer, keys of type_k and values of type_v (< 0: type_k), zeroed: F16, or
    // Q8_0 / Q4_0 (a quantized cache, as optiml/kv_cache.h's: rotated, values as rows; head_dim a
    // multiple of 32).
    PagedKV(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n_blocks, int32_t type_k = TYPE_F16,
            int32_t type_v = -1);

    int32_t n_layer() const { return n_layer_; }
    int32_t n_head_kv() const { return n_head_kv_; }
    int32_t head_dim() const { return head_dim_; }
    int32_t blocks_free() const { return (int32_t)free_.size(); }
    size_t bytes() const { return pool_.size(); }
    int32_t type_k() const { return type_k_; }
    int32_t type_v() const { return type_v_; }

    // Positions held by sequence seq (0 for one never stored or freed).
    int32_t length(int32_t seq) const;
    // Stores the keys and values (float [n_head_kv * head_dim] each) of position pos of sequence seq in
    // layer `layer`. pos must be the sequence's length (append) or, for a layer after the first, the
    // position the first layer just stored. ArgumentError when the blocks run out.
    void store(int32_t layer, int32_t seq, int32_t pos, const float* k, const float* v);
    // Forgets sequence seq; its blocks go back to the pool.
    void free_seq(int32_t seq);

    // Decode attention: for token t of sequence seq[t] at position pos[t] (stored in every layer up to
    // this one), out[t] = softmax(scale * q_t . K) V over positions [0, pos[t]], per head (a KV head
    // serves n_head / n_head_kv query heads). q and out: [n][n_head * head_dim]. One task per (token,
    // head) on the pool; q and the softmax weights are rounded to f16 as the contiguous cache's attention
    // rounds them (attention.cpp), and each block's weighted sum of values is one dot product.
    void attend(ThreadPool& pool, const KernelTable& kt, int32_t layer, int32_t n_head, const float* q,
                const int32_t* seq, const int32_t* pos, int32_t n, float scale, float* out) const;

private:
    // Block b of layer l: keys [kBlock][n_head_kv * head_dim] (rows of k_row_ bytes), then F16 values
    // transposed [n_head_kv * head_dim][kBlock] (a head dimension's values over the block's positions are
    // contiguous), or quantized values as rows [kBlock][n_head_kv * head_dim] of v_row_ bytes.
    uint8_t* block(int32_t layer, int32_t b) { return pool_.data() + ((size_t)layer * n_blocks_ + b) * block_bytes_; }
    const uint8_t* block(int32_t layer, int32_t b) const {
        return pool_.data() + ((size_t)layer * n_blocks_ + b) * block_bytes_;
    }

    int32_t n_layer_, n_head_kv_, head_dim_, n_blocks_, type_k_, type_v_;
    size_t k_row_, v_row_, block_bytes_;  // v_row_: 0 for transposed F16 values
    std::vector<uint8_t> pool_;
    std::vector<int32_t> free_;                  // free block ids (a stack)
    std::vector<std::vector<int32_t>> tables_;   // per sequence: its blocks in position order
    std::vector<int32_t> lengths_;               // per sequence: positions stored in layer 0
};

}  // namespace optiml
