#include <algorithm>
#include <cmath>

#include "optiml/common.h"
#include "optiml/kernels.h"
#include "optiml/ggml_types.h"
#include "optiml/paged_kv.h"
#include "optiml/quant.h"

namespace optiml {

static bool paged_quantized(int32_t t) { return t == TYPE_Q8_0 || t == TYPE_Q4_0; }

PagedKV::PagedKV(int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n_blocks, int32_t type_k,
                 int32_t type_v)
    : n_layer_(n_layer), n_head_kv_(n_head_kv), head_dim_(head_dim), n_blocks_(n_blocks), type_k_(type_k),
      type_v_(type_v < 0 ? type_k : type_v) {
    if (n_layer < 1 || n_head_kv < 1 || head_dim < 1 || n_blocks < 1)
        throw ArgumentError("PagedKV: n_layer, n_head_kv, head_dim and n_blocks must be >= 1");
    for (int32_t t : {type_k_, type_v_})
        if (t != TYPE_F16 && !paged_quantized(t))
            throw ArgumentError(format("PagedKV: keys and values are f16, q8_0 or q4_0, not type %d", t));
    if (head_dim % 2)
        throw ArgumentError(format("PagedKV: head_dim %d is odd; the F16 dot products need an even length", head_dim));
    if ((paged_quantized(type_k_) || paged_quantized(type_v_)) && head_dim % 32)
        throw ArgumentError(format("PagedKV: a q8_0/q4_0 cache quantizes heads in blocks of 32, and head_dim is %d",
                                   head_dim));
    const int64_t width = (int64_t)n_head_kv * head_dim;
    k_row_ = row_size(type_k_, width);
    v_row_ = paged_quantized(type_v_) ? row_size(type_v_, width) : 0;
    block_bytes_ = (size_t)kBlock * (k_row_ + row_size(type_v_, width));
    const double total = (double)block_bytes_ * n_layer * n_blocks;
    if (total > 64.0 * (1ull << 30))
        throw ArgumentError(format("PagedKV: %.1f GiB is more than this cache is meant to hold", total / (1ull << 30)));
    pool_.assign(block_bytes_ * n_layer * n_blocks, 0);
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
    uint8_t* blk = block(layer, tables_[seq][pos / kBlock]);
    const int32_t p = pos % kBlock;
    // A quantized side is rotated first and written as the contiguous cache writes it (attention.cpp).
    std::vector<float> rot;
    auto quantized_row = [&](int32_t type, const float* x, uint8_t* dst, bool values) {
        rot.assign(x, x + width);
        if (const int64_t rb = kv_rotation_block(type, head_dim_, values)) kv_rotate(rot.data(), width, rb);
        kv_from_float(kernel_table(), type)(rot.data(), dst, width);
    };
    if (paged_quantized(type_k_)) {
        quantized_row(type_k_, k, blk + (size_t)p * k_row_, false);
    } else {
        uint16_t* krow = (uint16_t*)(blk + (size_t)p * k_row_);
        for (int64_t d = 0; d < width; d++) krow[d] = fp32_to_fp16(k[d]);
    }
    uint8_t* v0 = blk + (size_t)kBlock * k_row_;
    if (v_row_) {
        quantized_row(type_v_, v, v0 + (size_t)p * v_row_, true);
    } else {
        uint16_t* vt = (uint16_t*)v0;
        for (int64_t d = 0; d < width; d++) vt[d * kBlock + p] = fp32_to_fp16(v[d]);
    }
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
    const int64_t hd = head_dim_, n_q = (int64_t)n_head * hd;
    const int32_t group = n_head / n_head_kv_;
    const from_float_fn to_f16 = kt.from_float[TYPE_F16];
    const bool k_quant = paged_quantized(type_k_);
    const int64_t rot_k = kv_rotation_block(type_k_, hd, false), rot_v = kv_rotation_block(type_v_, hd, true);
    const size_t head_k = row_size(type_k_, hd), head_v = row_size(type_v_, hd);
    const int64_t n_tasks = (int64_t)n * n_head;
    pool.run([&](int ith, int nth) {
        std::vector<float> scores, parts, qr;
        std::vector<uint16_t> qh(hd), wh;
        std::vector<uint8_t> q8;
        std::vector<const void*> ptrs(kBlock + kRowsAhead);
        for (int64_t task = ith; task < n_tasks; task += nth) {
            const int64_t t = task / n_head, h = task % n_head, kvh = h / group;
            const int64_t n_seen = (int64_t)pos[t] + 1;
            const int64_t n_blk = (n_seen + kBlock - 1) / kBlock;
            const std::vector<int32_t>& table = tables_[seq[t]];
            scores.assign((size_t)n_blk * kBlock, -INFINITY);
            if (k_quant) {  // the query rotated like the keys, in Q8_0 (attention.cpp)
                qr.assign(q + t * n_q + h * hd, q + t * n_q + (h + 1) * hd);
                if (rot_k) kv_rotate(qr.data(), hd, rot_k);
                q8.resize(row_size(TYPE_Q8_0, hd));
                kt.from_float[TYPE_Q8_0](qr.data(), q8.data(), hd);
            } else {
                to_f16(q + t * n_q + h * hd, qh.data(), hd);
            }
            for (int64_t b = 0; b < n_blk; b++) {  // a block's keys are a row (k_row_ bytes) apart
                const uint8_t* k0 = block(layer, table[b]) + kvh * head_k;
                const int64_t n_in = std::min<int64_t>(kBlock, n_seen - b * kBlock);
                if (k_quant)
                    kv_quant_dots(kt, type_k_, hd, &scores[b * kBlock], k0, k_row_, q8.data(), n_in, ptrs.data());
                else
                    attn_dots(kt, TYPE_F16, hd, &scores[b * kBlock], k0, k_row_, qh.data(), n_in);
            }
            for (int64_t s = 0; s < n_seen; s++) scores[s] *= scale;
            float max = -INFINITY;
            for (int64_t s = 0; s < n_seen; s++) max = std::max(max, scores[s]);
            const double sum = kt.softmax_exp((int64_t)scores.size(), scores.data(), scores.data(), max);
            const float inv = (float)(1.0 / sum);
            for (float& w : scores) w *= inv;  // positions past n_seen: exp(-inf) = 0
            float* o = out + t * n_q + h * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
            parts.resize(hd);
            if (v_row_) {  // each block's rows weighed in float, then the output rotated back
                for (int64_t b = 0; b < n_blk; b++) {
                    const uint8_t* v0 = block(layer, table[b]) + (size_t)kBlock * k_row_ + kvh * head_v;
                    const int64_t n_in = std::min<int64_t>(kBlock, n_seen - b * kBlock);
                    kt.attn_mad[type_v_](hd, parts.data(), v0, v_row_, &scores[b * kBlock], n_in);
                    for (int64_t d = 0; d < hd; d++) o[d] += parts[d];
                }
                if (rot_v) kv_rotate(o, hd, rot_v);
                continue;
            }
            wh.resize(scores.size());
            to_f16(scores.data(), wh.data(), (int64_t)scores.size());
            for (int64_t b = 0; b < n_blk; b++) {
                const uint16_t* vt =
                    (const uint16_t*)(block(layer, table[b]) + (size_t)kBlock * k_row_) + (size_t)(kvh * hd) * kBlock;
                attn_dots(kt, TYPE_F16, kBlock, parts.data(), vt, kBlock * 2, wh.data() + b * kBlock, hd);
                for (int64_t d = 0; d < hd; d++) o[d] += parts[d];
            }
        }
    });
}

}  // namespace optiml
