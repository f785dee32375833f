// The attention block on the CPU for a batch of tokens from any number of sequences: norm, q/k/v,
// RoPE, the KV cache, causal attention per (token, head), output projection into the residual stream.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention.h"
#include "cpu/kernels/ops.h"
#include "ffn.h"
#include "optiml/quant.h"

namespace optiml {

namespace {

// Per-thread buffers that grow to the largest request (no fixed-size stack arrays: any head dimension,
// any number of KV heads, any context).
template <typename T>
T* thread_buffer(size_t n, int which) {
    static thread_local std::vector<T> bufs[3];
    std::vector<T>& b = bufs[which];
    if (b.size() < n) b.resize(n);
    return b.data();
}

}  // namespace

void attention_cpu_qkv(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const LayerWeights& L,
                       const float* x, int32_t n, const StepScratch& sc) {
    rms_norm_rows(pool, x, L.attn_norm, sc.xn, n, hp.n_embd, hp.rms_eps);
    const Weight* qkv[3] = {&L.wq, &L.wk, &L.wv};
    float* outs[3] = {sc.q, sc.k, sc.v};
    matmul_shared_input(pool, kt, qkv, outs, 3, sc.xn, n);
    add_bias_rows(L.bq, sc.q, n);
    add_bias_rows(L.bk, sc.k, n);
    add_bias_rows(L.bv, sc.v, n);
}

namespace {

// Rotary position embedding of the batch's q and k, and the new keys and values into the cache.
void rope_and_store_kv(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                       const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, const StepScratch& sc) {
    const int64_t n_q = hp.n_embd_q(), n_kv = hp.n_embd_kv(), hd = hp.head_dim;
    const int32_t n = b.n;
    float* q = sc.q;
    float* k = sc.k;
    float* v = sc.v;
    // Quantized values (Q8_0, Q4_0) are rows like the keys (KVLayerView); F16/F32 ones transposed.
    const bool v_rows = kv.v_row != 0;
    const size_t kv_elem = type_traits(kv.v_type).type_size;  // a transposed value's
    const from_float_fn to_kv = kv_from_float(kt, kv.type);
    const from_float_fn to_v = kv_from_float(kt, kv.v_type);
    const int64_t rot_k = kv_rotation_block(kv.type, hd, false), rot_v = kv_rotation_block(kv.v_type, hd, true);
    const float* freq_factors = rope_freqs.present() ? (const float*)rope_freqs.data : nullptr;
    const bool neox = hp.rope_type == ROPE_NEOX;
    const float rope_base = hp.rope_base(il), rope_scale = hp.rope_scale(il);
    const RopeYarnRange yarn = hp.rope_yarn(il);  // (once per layer, not per token)
    const float* q_norm = L.q_norm.present() ? (const float*)L.q_norm.data : nullptr;
    const float* k_norm = L.k_norm.present() ? (const float*)L.k_norm.data : nullptr;
    auto prepare = [&](int64_t t) {
        float* qt = q + t * n_q;
        float* kt_ = k + t * n_kv;
        float* vt = v + t * n_kv;
        const int32_t seq = b.seq[t], pos = b.pos[t];
        const int32_t n_rot = hp.rot(il);  // (0 on a layer without RoPE: nothing turns)
        float* cos = thread_buffer<float>((size_t)n_rot, 0);
        float* sin = cos + n_rot / 2;
        // Gemma 3 normalizes every head of q and k before rotating them.
        if (q_norm)
            for (int h = 0; h < hp.n_head; h++) rms_norm(qt + h * hd, q_norm, qt + h * hd, hd, hp.rms_eps);
        if (k_norm)
            for (int h = 0; h < hp.n_head_kv; h++) rms_norm(kt_ + h * hd, k_norm, kt_ + h * hd, hd, hp.rms_eps);
        rope_cos_sin(pos, n_rot, rope_base, rope_scale, freq_factors, cos, sin, yarn);
        for (int h = 0; h < hp.n_head; h++) rope(qt + h * hd, n_rot, cos, sin, neox);
        for (int h = 0; h < hp.n_head_kv; h++) rope(kt_ + h * hd, n_rot, cos, sin, neox);
        if (hp.attn_q_scale != 1.0f)
            for (int64_t i = 0; i < n_q; i++) qt[i] *= hp.attn_q_scale;
        if (rot_k) {
            kv_rotate(qt, n_q, rot_k);
            kv_rotate(kt_, n_kv, rot_k);
        }
        if (rot_v) kv_rotate(vt, n_kv, rot_v);
        to_kv(kt_, kv.k + (size_t)seq * kv.k_seq + (size_t)pos * kv.k_row, n_kv);
        if (v_rows) {
            to_v(vt, kv.v + (size_t)seq * kv.v_seq + (size_t)pos * kv.v_row, n_kv);
            return;
        }
        uint8_t* vconv = thread_buffer<uint8_t>((size_t)n_kv * kv_elem, 1);
        to_v(vt, vconv, n_kv);
        uint8_t* v_seq = kv.v + (size_t)seq * kv.v_seq;
        // V is stored transposed (a row per dimension), so each value goes to its own row: a copy of
        // a size known here is one move, where a size known only at run time was a call per value.
        auto scatter = [&](auto elem) {
            constexpr size_t size = sizeof(elem);
            for (int64_t j = 0; j < n_kv; j++)
                std::memcpy(v_seq + ((size_t)j * kv.n_ctx + pos) * size, vconv + j * size, size);
        };
        if (kv_elem == 2) scatter(uint16_t());  // F16
        else scatter(uint32_t());               // F32, the cache's only other type
    };
    if (n == 1) {
        prepare(0);
    } else {
        pool.run([&](int ith, int nth) {
            int64_t t0, t1;
            split_range(n, ith, nth, &t0, &t1);
            for (int64_t t = t0; t < t1; t++) prepare(t);
        });
    }

}

// Causal attention: token t (sequence seq, position pos) sees positions 0..pos of its sequence; a KV
// head serves n_head / n_head_kv query heads (grouped-query attention). Like llama.cpp, scores cover a
// window of the cache padded to a multiple of 32 (masked positions are -inf, weight 0), softmax runs over
// that window, and the weights are converted to the cache type before the dot products with V: the sums
// then group exactly as llama.cpp's do. The window depends on the token's own position only, so a
// sequence gets the same bits alone or in a batch.
struct CausalAttention {
    const KernelTable& kt;
    const HParams& hp;
    const KVLayerView& kv;
    const BatchView& b;
    const float* q;
    float* attn;
    int64_t n_q, hd;
    bool v_rows;  // quantized values: rows like the keys; F16/F32 transposed
    size_t kv_elem;
    int64_t rot_v;
    int group;
    float scale;
    float softcap;  // > 0: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2)
    int64_t n_swa;  // a sliding-window layer: position p sees only p - n_swa < s <= p
    const float* sinks;  // [n_head] or null: each head's softmax also counts exp(sink) with a zero value
    // The query in the keys' vec_dot type (F16, F32; Q8_0 for quantized keys, as llama.cpp's flash
    // attention converts it), the weights in the values' (F16, F32; quantized values take float weights).
    bool k_quant;
    from_float_fn to_dot, to_dot_v;
    size_t head_bytes, head_bytes_v;

    CausalAttention(const KernelTable& kt_, const HParams& hp_, int il, const LayerWeights& L, const KVLayerView& kv_,
                    const BatchView& b_, const StepScratch& sc)
        : kt(kt_), hp(hp_), kv(kv_), b(b_), q(sc.q), attn(sc.attn), n_q(hp.n_embd_q()), hd(hp.head_dim),
          v_rows(kv.v_row != 0), kv_elem(type_traits(kv.v_type).type_size),
          rot_v(kv_rotation_block(kv.v_type, hd, true)), group(hp.n_head / hp.n_head_kv), scale(hp.attn_kq_scale),
          softcap(hp.attn_softcap), n_swa(hp.is_swa(il) ? hp.n_swa : 0),
          sinks(L.attn_sinks.present() ? (const float*)L.attn_sinks.data : nullptr),
          k_quant(kv.type == TYPE_Q8_0 || kv.type == TYPE_Q4_0),
          to_dot(kt.from_float[type_traits(kv.type).vec_dot_type]),
          to_dot_v(kt.from_float[type_traits(kv.v_type).vec_dot_type]), head_bytes(row_size(kv.type, hd)),
          head_bytes_v(row_size(kv.v_type, hd)) {}

    int64_t n_window(int64_t t) const { return std::min<int64_t>(kv.n_ctx, ((int64_t)b.pos[t] + 1 + 31) / 32 * 32); }
    int64_t first(int64_t t) const { return n_swa ? std::max<int64_t>(0, (int64_t)b.pos[t] + 1 - n_swa) : 0; }
    const uint8_t* v_head(int64_t t, int64_t kvh) const {
        return kv.v + (size_t)b.seq[t] * kv.v_seq + (size_t)kvh * hd * kv.n_ctx * kv_elem;
    }

    // This head's V rows are read last; fetching them now lets the K pass and the softmax hide their
    // latency (they are n_ctx values apart, a pattern the hardware prefetcher misses).
    void prefetch_v(int64_t t, int64_t kvh) const {
        if (v_rows) return;
        const uint8_t* v = v_head(t, kvh);
        const int64_t bytes = n_window(t) * (int64_t)kv_elem;
        for (int64_t d = 0; d < hd; d++)
            for (int64_t off = 0; off < bytes; off += 64)
                __builtin_prefetch(v + (size_t)d * kv.n_ctx * kv_elem + off, 0, 2);
    }

    // Raw scores in, softmax weights out (scaled, soft-capped, masked outside first..pos, over the whole
    // window); a head's sink joins the max and the sum as ggml's soft_max counts it.
    void softmax(int64_t t, int64_t h, float* scores) const {
        const int64_t n_seen = (int64_t)b.pos[t] + 1, nw = n_window(t), f = first(t);
        for (int64_t s = 0; s < f; s++) scores[s] = -INFINITY;
        for (int64_t s = f; s < n_seen; s++) scores[s] *= scale;
        if (softcap > 0)
            for (int64_t s = f; s < n_seen; s++) scores[s] = softcap * std::tanh(scores[s] / softcap);
        for (int64_t s = n_seen; s < nw; s++) scores[s] = -INFINITY;
        float max = -INFINITY;
        for (int64_t s = f; s < n_seen; s++) max = scores[s] > max ? scores[s] : max;
        if (sinks) max = std::max(max, sinks[h]);
        double sum = kt.softmax_exp(nw, scores, scores, max);
        if (sinks) sum += (double)std::exp(sinks[h] - max);
        const float inv = (float)(1.0 / sum);
        for (int64_t s = 0; s < nw; s++) scores[s] *= inv;
    }

    // One query head of token t.
    void head(int64_t t, int64_t h) const {
        const int64_t kvh = h / group, n_seen = (int64_t)b.pos[t] + 1, nw = n_window(t), f = first(t);
        const uint8_t* k_seq = kv.k + (size_t)b.seq[t] * kv.k_seq;
        float* scores = thread_buffer<float>((size_t)nw, 0);
        uint8_t* conv = thread_buffer<uint8_t>((size_t)std::max<int64_t>(nw, hd) * sizeof(float), 2);
        to_dot(q + t * n_q + h * hd, conv, hd);
        const uint8_t* k0 = k_seq + (size_t)f * kv.k_row + kvh * head_bytes;
        if (k_quant)
            kv_quant_dots(kt, kv.type, hd, scores + f, k0, kv.k_row, conv, n_seen - f,
                          thread_buffer<const void*>((size_t)(n_seen - f + kRowsAhead), 0));
        else
            attn_dots(kt, kv.type, hd, scores + f, k0, kv.k_row, conv, n_seen - f);
        softmax(t, h, scores);
        float* out = attn + t * n_q + h * hd;
        if (v_rows) {  // the weighted sum of the seen positions' dequantized rows, in float
            const uint8_t* v_seq = kv.v + (size_t)b.seq[t] * kv.v_seq;
            kt.attn_mad[kv.v_type](hd, out, v_seq + (size_t)f * kv.v_row + kvh * head_bytes_v, kv.v_row, scores + f,
                                   n_seen - f);
            if (rot_v) kv_rotate(out, hd, rot_v);
            return;
        }
        to_dot_v(scores, conv, nw);
        attn_dots(kt, kv.v_type, nw, out, v_head(t, kvh), kv.n_ctx * kv_elem, conv, hd);
    }

    // Whether heads() can run: F16 keys and values, stored as rows and transposed.
    bool heads_at_once() const {
        return kv.type == TYPE_F16 && kv.v_type == TYPE_F16 && !v_rows && kt.attn_dot_heads[TYPE_F16];
    }

    // The nh query heads h0.. of token t that share a KV head, each key and value row converted once
    // for all of them (or short rows head by head, as the kernel decides); the same bits as head() for each.
    void dots(int64_t n, float* s, int64_t s_stride, const uint8_t* rows, size_t stride, const uint8_t* ys,
              size_t y_stride, int64_t n_rows, int nh) const {
        kt.attn_dot_heads[TYPE_F16](n, s, s_stride, rows, stride, ys, y_stride, n_rows, nh);
    }
    void heads(int64_t t, int64_t h0, int nh) const {
        const int64_t kvh = h0 / group, n_seen = (int64_t)b.pos[t] + 1, nw = n_window(t), f = first(t);
        const size_t q_row = (size_t)hd * sizeof(fp16_t), w_row = (size_t)nw * sizeof(fp16_t);
        float* scores = thread_buffer<float>((size_t)nh * nw, 0);
        uint8_t* qc = thread_buffer<uint8_t>((size_t)nh * q_row, 2);
        uint8_t* wc = thread_buffer<uint8_t>((size_t)nh * w_row, 1);
        for (int i = 0; i < nh; i++) to_dot(q + t * n_q + (h0 + i) * hd, qc + i * q_row, hd);
        const uint8_t* k0 = kv.k + (size_t)b.seq[t] * kv.k_seq + (size_t)f * kv.k_row + kvh * head_bytes;
        dots(hd, scores + f, nw, k0, kv.k_row, qc, q_row, n_seen - f, nh);
        for (int i = 0; i < nh; i++) {
            softmax(t, h0 + i, scores + i * nw);
            to_dot_v(scores + i * nw, wc + i * w_row, nw);
        }
        dots(nw, attn + t * n_q + h0 * hd, hd, v_head(t, kvh), kv.n_ctx * kv_elem, wc, w_row, hd, nh);
    }
};

// Positions (keys) and dimensions (value rows) a task of attend_split takes.
constexpr int64_t kSplitPositions = 256, kSplitDims = 16;

// Tasks of one pass over the (token, KV head) pairs, each cut in pieces(t) parts, from a shared counter:
// fn(t, kv head, part).
template <class Pieces, class Fn>
void run_pieces(ThreadPool& pool, int32_t n, int64_t n_kv, Pieces pieces, Fn fn) {
    int64_t total = 0;
    for (int32_t t = 0; t < n; t++) total += n_kv * pieces(t);
    std::atomic<int64_t> next{0};
    pool.run([&](int, int) {
        for (int64_t c = next.fetch_add(1); c < total; c = next.fetch_add(1)) {
            int64_t i = c;
            int32_t t = 0;
            while (i >= n_kv * pieces(t)) i -= n_kv * pieces(t++);
            fn(t, i / pieces(t), i % pieces(t));
        }
    });
}

// Decoding over a long context: too few (token, KV head) pairs to share out, each with many positions.
// A task per KV head leaves threads idle (SmolLM2: 3 KV heads on 2 threads) and a task per query head
// reads every key and value once per query head. Three passes instead, each shared by all threads: the
// scores of a KV head's query heads over chunks of positions (each key read once for all of them), each
// head's softmax, and the values' dots over chunks of dimensions. Every (row, head) is computed as
// heads() computes it: the same bits. At 2040 positions, 2 threads, three alternated runs: Gemma 3 270M
// (one KV head, so 4 query-head tasks each reading every key and value) 11.5-11.9 -> 9.1-10.7 ms a token;
// SmolLM2 (3 KV heads) unchanged within the noise (8.9-10.8 against 9.3-9.8).
void attend_split(ThreadPool& pool, const CausalAttention& a) {
    const BatchView& b = a.b;
    const KVLayerView& kv = a.kv;
    const int32_t n = b.n;
    const int64_t n_head = a.hp.n_head, n_kv = a.hp.n_head_kv, nh = a.group, hd = a.hd;
    int64_t nw_max = 0;
    for (int32_t t = 0; t < n; t++) nw_max = std::max(nw_max, a.n_window(t));
    const size_t q_row = (size_t)hd * sizeof(fp16_t), w_row = (size_t)nw_max * sizeof(fp16_t);
    // Shared by the threads of this call: the calling thread's buffers.
    static thread_local std::vector<float> scores_buf;
    static thread_local std::vector<uint8_t> qc_buf, wc_buf;
    scores_buf.resize((size_t)n * n_head * nw_max);
    qc_buf.resize((size_t)n * n_head * q_row);
    wc_buf.resize((size_t)n * n_head * w_row);
    // (the pointers, not the names: in a worker thread the names are that thread's own buffers)
    float* const sb = scores_buf.data();
    uint8_t* const qb = qc_buf.data();
    uint8_t* const wb = wc_buf.data();
    auto scores = [=](int32_t t, int64_t h) { return sb + ((size_t)t * n_head + h) * nw_max; };
    auto qc = [=](int32_t t, int64_t h) { return qb + ((size_t)t * n_head + h) * q_row; };
    auto wc = [=](int32_t t, int64_t h) { return wb + ((size_t)t * n_head + h) * w_row; };
    for (int32_t t = 0; t < n; t++)
        for (int64_t h = 0; h < n_head; h++) a.to_dot(a.q + t * a.n_q + h * hd, qc(t, h), hd);

    auto seen = [&](int32_t t) { return (int64_t)b.pos[t] + 1 - a.first(t); };
    run_pieces(pool, n, n_kv, [&](int32_t t) { return (seen(t) + kSplitPositions - 1) / kSplitPositions; },
               [&](int32_t t, int64_t kvh, int64_t c) {
                   const int64_t s0 = a.first(t) + c * kSplitPositions;
                   const int64_t len = std::min(kSplitPositions, (int64_t)b.pos[t] + 1 - s0);
                   const uint8_t* k0 = kv.k + (size_t)b.seq[t] * kv.k_seq + (size_t)s0 * kv.k_row + kvh * a.head_bytes;
                   a.dots(hd, scores(t, kvh * nh) + s0, nw_max, k0, kv.k_row, qc(t, kvh * nh), q_row, len, (int)nh);
               });
    run_pieces(pool, n, n_head, [](int32_t) { return (int64_t)1; }, [&](int32_t t, int64_t h, int64_t) {
        a.softmax(t, h, scores(t, h));
        a.to_dot_v(scores(t, h), wc(t, h), a.n_window(t));
    });
    run_pieces(pool, n, n_kv, [&](int32_t) { return (hd + kSplitDims - 1) / kSplitDims; },
               [&](int32_t t, int64_t kvh, int64_t c) {
                   const int64_t d0 = c * kSplitDims, nd = std::min(kSplitDims, hd - d0);
                   const size_t v_stride = kv.n_ctx * a.kv_elem;
                   a.dots(a.n_window(t), a.attn + t * a.n_q + kvh * nh * hd + d0, hd, a.v_head(t, kvh) + d0 * v_stride,
                          v_stride, wc(t, kvh * nh), w_row, nd, (int)nh);
               });
}

void attend(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
            const KVLayerView& kv, const BatchView& b, const StepScratch& sc) {
    const CausalAttention a(kt, hp, il, L, kv, b, sc);
    const int32_t n = b.n;
    if ((int64_t)n * hp.n_head_kv < 4 * pool.size() && a.heads_at_once() && pool.size() > 1) {
        int64_t most = 0;
        for (int32_t t = 0; t < n; t++) most = std::max(most, (int64_t)b.pos[t] + 1 - a.first(t));
        if (most >= 2 * kSplitPositions) return attend_split(pool, a);
    }
    // With enough of them to share out, one task per (token, KV head): the query heads that share a KV
    // head run together (F16) or one after the other, so its keys and values come from memory once
    // (8 sequences of SmolLM2 decoded 4% faster than with a task per query head). Few tokens keep a task
    // per query head, so that every thread has some (Gemma 3 has one KV head).
    const int heads_per_task = (int64_t)n * hp.n_head_kv >= 4 * pool.size() ? a.group : 1;
    const int64_t n_tasks = (int64_t)n * hp.n_head / heads_per_task;
    const bool together = heads_per_task > 1 && a.heads_at_once();
    // Tasks go to whichever thread is free, last first: later tokens see more positions, so the
    // long tasks are taken early and the short ones even out the end.
    std::atomic<int64_t> next{0};
    pool.run([&](int, int) {
        for (int64_t c = next.fetch_add(1); c < n_tasks; c = next.fetch_add(1)) {
            const int64_t task = n_tasks - 1 - c, per_token = hp.n_head / heads_per_task;
            const int64_t t = task / per_token, h0 = task % per_token * heads_per_task;
            a.prefetch_v(t, h0 / a.group);
            if (together) {
                a.heads(t, h0, heads_per_task);
                continue;
            }
            for (int64_t h = h0; h < h0 + heads_per_task; h++) a.head(t, h);
        }
    });
}

}  // namespace

void attention_cpu_core(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                        const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, const StepScratch& sc) {
    rope_and_store_kv(pool, kt, hp, il, L, rope_freqs, kv, b, sc);
    attend(pool, kt, hp, il, L, kv, b, sc);
}

void attention_cpu_out(ThreadPool& pool, const KernelTable& kt, const HParams& hp, const LayerWeights& L, int32_t n,
                       float* x, const StepScratch& sc) {
    // Output projection, added into the residual stream (Gemma 3 normalizes it first).
    add_to_residual(pool, kt, hp, L.wo, L.bo, L.attn_post_norm, sc.attn, n, x, sc.xn);
}

void attention_cpu(ThreadPool& pool, const KernelTable& kt, const HParams& hp, int il, const LayerWeights& L,
                   const Weight& rope_freqs, const KVLayerView& kv, const BatchView& b, float* x,
                   const StepScratch& sc) {
    attention_cpu_qkv(pool, kt, hp, L, x, b.n, sc);
    attention_cpu_core(pool, kt, hp, il, L, rope_freqs, kv, b, sc);
    attention_cpu_out(pool, kt, hp, L, b.n, x, sc);
}

}  // namespace optiml
