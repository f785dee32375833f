// A KV cache in host memory in fixed blocks of positions, and decode attention over it on the CPU: the
// CPU side of NEO-style attention offload (issue #19). A sequence's keys and values live in whatever
// blocks its table lists, so sequences grow and are freed block by block, and a sequence can later move
// between the GPU's cache and this one without copying the others. Not yet used by the engine or the
// server: the two-sub-batch pipeline and its scheduler are still to be built on it.
#pragma once

#include <cstdint>
#include <vector>

#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace optiml {

class PagedKV {
public:
    static constexpr int32_t kBlock = 32;  // positions per block

    // n_blocks blocks for every layer, F16 keys and values (zeroed).
    PagedKV(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n_blocks);

    int32_t n_layer() const { return n_layer_; }
    int32_t n_head_kv() const { return n_head_kv_; }
    int32_t head_dim() const { return head_dim_; }
    int32_t blocks_free() const { return (int32_t)free_.size(); }
    size_t bytes() const { return pool_.size() * sizeof(uint16_t); }

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
    // Block b of layer l: keys [kBlock][n_head_kv * head_dim], then values transposed
    // [n_head_kv * head_dim][kBlock] (a head dimension's values over the block's positions are contiguous).
    uint16_t* block(int32_t layer, int32_t b) { return pool_.data() + ((size_t)layer * n_blocks_ + b) * block_elems_; }
    const uint16_t* block(int32_t layer, int32_t b) const {
        return pool_.data() + ((size_t)layer * n_blocks_ + b) * block_elems_;
    }

    int32_t n_layer_, n_head_kv_, head_dim_, n_blocks_;
    size_t block_elems_;
    std::vector<uint16_t> pool_;
    std::vector<int32_t> free_;                  // free block ids (a stack)
    std::vector<std::vector<int32_t>> tables_;   // per sequence: its blocks in position order
    std::vector<int32_t> lengths_;               // per sequence: positions stored in layer 0
};

}  // namespace optiml
