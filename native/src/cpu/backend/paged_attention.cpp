#include <algorithm>
#include <cmath>

#include "optiml/common.h"
#include "optiml/ggml_types.h"
#include "optiml/paged_kv.h"
#include "optiml/quant.h"

namespace optiml {

PagedKV::PagedKV(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n_blocks)
    : n_layer_(n_layer), n_head_kv_(n_head_kv), head_dim_(head_dim), n_blocks_(n_blocks) {
    if (n_layer < 1 || n_head_kv < 1 || head_dim < 1 || n_blocks < 1)
        throw ArgumentError("PagedKV: n_layer, n_head_kv, head_dim and n_blocks must be >= 1");
    if (head_dim % 2)
        throw ArgumentError(format("PagedKV: head_dim %d is odd; the F16 dot products need an even length", head_dim));
    block_elems_ = 2 * (size_t)kBlock * n_head_kv * head_dim;
    const double total = (double)block_elems_ * n_layer * n_blocks * sizeof(uint16_t);
    if (total > 64.0 * (1ull << 30))
        throw ArgumentError(format("PagedKV: %.1f GiB is more than this cache is meant to hold", total / (1ull << 30)));
    pool_.assign(block_elems_ * n_layer * n_blocks, 0);
    free_.reserve(n_blocks);
    for (int32_t b = n_blocks - 1; b >= 0; b--) free_.push_back(b);
}

int32_t PagedKV::length(int32_t seq) const {
    if (seq < 0) throw ArgumentError(format("PagedKV: sequence %d is negative", seq));
    return seq < (int32_t)lengths_.size() ? lengths_[seq] : 0;
}

void PagedKV::store(int32_t layer, int32_t seq, int32_t pos, const float* k, const float* v) {
    if (layer < 0 || layer >= n_layer_) throw ArgumentError(format("PagedKV: layer %d of %d", layer, n_layer_));
    if (seq < 0 || seq > (1 << 20)) throw ArgumentError(format("PagedKV: sequence id %d is out of range", seq));
    if (seq >= (int32_t)lengths_.size()) {
        lengths_.resize(seq + 1, 0);
        tables_.resize(seq + 1);
    }
    int32_t& len = lengths_[seq];
    if (layer == 0) {
        if (pos != len)
            throw ArgumentError(format("PagedKV: sequence %d holds %d positions; the next to store is %d, not %d", seq,
                                       len, len, pos));
        if (pos % kBlock == 0) {
            if (free_.empty())
                throw ArgumentError(format("PagedKV: all %d blocks are in use; free a sequence or make the cache larger",
                                           n_blocks_));
            tables_[seq].push_back(free_.back());
            free_.pop_back();
        }
        len++;
    } else if (pos != len - 1) {
        throw ArgumentError(format("PagedKV: layer %d stores position %d of sequence %d, but layer 0 last stored %d",
                                   layer, pos, seq, len - 1));
    }
    const int64_t width = (int64_t)n_head_kv_ * head_dim_;
    uint16_t* blk = block(layer, tables_[seq][pos / kBlock]);
    const int32_t p = pos % kBlock;
    uint16_t* krow = blk + (size_t)p * width;
    for (int64_t d = 0; d < width; d++) krow[d] = fp32_to_fp16(k[d]);
    uint16_t* vt = blk + (size_t)kBlock * width;
    for (int64_t d = 0; d < width; d++) vt[d * kBlock + p] = fp32_to_fp16(v[d]);
}

void PagedKV::free_seq(int32_t seq) {
    if (seq < 0 || seq >= (int32_t)lengths_.size()) return;
    for (int32_t b : tables_[seq]) free_.push_back(b);
    tables_[seq].clear();
    lengths_[seq] = 0;
}

void PagedKV::attend(ThreadPool& pool, const KernelTable& kt, int32_t layer, int32_t n_head, const float* q,
                     const int32_t* seq, const int32_t* pos, int32_t n, float scale, float* out) const {
    if (layer < 0 || layer >= n_layer_) throw ArgumentError(format("PagedKV: layer %d of %d", layer, n_layer_));
    if (n_head < n_head_kv_ || n_head % n_head_kv_)
        throw ArgumentError(format("PagedKV: %d query heads do not share %d KV heads evenly", n_head, n_head_kv_));
    for (int32_t t = 0; t < n; t++)
        if (pos[t] < 0 || pos[t] >= length(seq[t]))
            throw ArgumentError(format("PagedKV: token %d asks for position %d of sequence %d, which holds %d", t,
                                       pos[t], seq[t], length(seq[t])));
    const int64_t hd = head_dim_, width = (int64_t)n_head_kv_ * hd, n_q = (int64_t)n_head * hd;
    const int32_t group = n_head / n_head_kv_;
    const from_float_fn to_f16 = kt.from_float[TYPE_F16];
    const int64_t n_tasks = (int64_t)n * n_head;
    pool.run([&](int ith, int nth) {
        std::vector<float> scores, parts;
        std::vector<uint16_t> qh(hd), wh;
        for (int64_t task = ith; task < n_tasks; task += nth) {
            const int64_t t = task / n_head, h = task % n_head, kvh = h / group;
            const int64_t n_seen = (int64_t)pos[t] + 1;
            const int64_t n_blk = (n_seen + kBlock - 1) / kBlock;
            const std::vector<int32_t>& table = tables_[seq[t]];
            scores.assign((size_t)n_blk * kBlock, -INFINITY);
            to_f16(q + t * n_q + h * hd, qh.data(), hd);
            for (int64_t b = 0; b < n_blk; b++) {  // a block's keys are `width` values apart
                const uint16_t* k0 = block(layer, table[b]) + kvh * hd;
                const int64_t n_in = std::min<int64_t>(kBlock, n_seen - b * kBlock);
                attn_dots(kt, TYPE_F16, hd, &scores[b * kBlock], k0, (size_t)width * 2, qh.data(), n_in);
            }
            for (int64_t s = 0; s < n_seen; s++) scores[s] *= scale;
            float max = -INFINITY;
            for (int64_t s = 0; s < n_seen; s++) max = std::max(max, scores[s]);
            const double sum = kt.softmax_exp((int64_t)scores.size(), scores.data(), scores.data(), max);
            const float inv = (float)(1.0 / sum);
            for (float& w : scores) w *= inv;  // positions past n_seen: exp(-inf) = 0
            wh.resize(scores.size());
            to_f16(scores.data(), wh.data(), (int64_t)scores.size());
            float* o = out + t * n_q + h * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
            parts.resize(hd);
            for (int64_t b = 0; b < n_blk; b++) {
                const uint16_t* vt = block(layer, table[b]) + (size_t)kBlock * width + (size_t)(kvh * hd) * kBlock;
                attn_dots(kt, TYPE_F16, kBlock, parts.data(), vt, kBlock * 2, wh.data() + b * kBlock, hd);
                for (int64_t d = 0; d < hd; d++) o[d] += parts[d];
            }
        }
    });
}

}  // namespace optiml
