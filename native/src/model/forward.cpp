// The forward pass of a llama-family model for a batch of tokens, top to bottom:
// embed -> per layer (attention, FFN) -> final norm -> logits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ffn.h"
#include "optiml/model.h"
#include "optiml/ops.h"
#include "optiml/quant.h"

namespace optiml {

void Session::forward_batch(const int32_t* tokens, int32_t n, bool all_logits, float* logits) {
    const Model& M = *model_;
    const HParams& hp = M.hp;
    ThreadPool& pool = *pool_;
    const int64_t n_embd = hp.n_embd;
    float* x = x_.data();

    // Embeddings: quantized rows are dequantized on lookup.
    for (int32_t t = 0; t < n; t++) {
        float* xt = x + t * n_embd;
        dequantize_row(M.tok_embd.type, M.tok_embd.row(tokens[t]), xt, n_embd);
        if (hp.embd_scale != 1.0f)
            for (int64_t i = 0; i < n_embd; i++) xt[i] *= hp.embd_scale;
    }

    for (int il = 0; il < hp.n_layer; il++) {
        attention_layer(M.layers[il], il, n);
        ffn_layer(il, n);
    }
    n_past_ += n;

    if (!logits) return;
    // Only the rows whose logits are wanted go through the output matrix.
    const int32_t first = all_logits ? 0 : n - 1;
    const int32_t rows = n - first;
    rms_norm_rows(pool, x + first * n_embd, M.output_norm, xn_.data(), rows, n_embd, hp.rms_eps);
    const Weight* out_w[1] = {&M.output};
    matmul_shared_input(pool, kt_, out_w, &logits, 1, xn_.data(), rows);
    if (hp.final_softcap > 0) {
        const float cap = hp.final_softcap;
        for (int64_t i = 0; i < (int64_t)rows * hp.n_vocab; i++) logits[i] = std::tanh(logits[i] / cap) * cap;
    }
}

void Session::ffn_layer(int il, int32_t n) {
    const HParams& hp = model_->hp;
    const FFNWeights& w = model_->layers[il].ffn;
    const FFNScratch s{xn_.data(), ffn_gate_.data(), ffn_up_.data()};
    if (recorder_) {  // profiling: dense, every activation shown to the recorder
        ffn_act_.resize((size_t)n_batch_ * hp.n_ff);
        ActivationRecorder& rec = *recorder_;
        const FFNObserver observe = [&](const float* xn, const float* a, const float* u, const float* h) {
            rec.record(*pool_, il, xn, a, u, h, n);
        };
        ffn_dense(*pool_, kt_, hp, w, x_.data(), n, s, &observe, ffn_act_.data());
        return;
    }
    if (!sparsity_.enabled) {
        ffn_dense(*pool_, kt_, hp, w, x_.data(), n, s);
        return;
    }
    const SparseScratch sp{active_idx_.data(), active_val_.data(), active_count_.data(), active_uni_.data(),
                           active_seen_.data()};
    const NeuronMajor& down_nm = model_->down_neuron_major(*pool_)[il];
    const float* scale = sparsity_.neuron_scale.empty() ? nullptr : sparsity_.neuron_scale.data() + (size_t)il * hp.n_ff;
    ffn_active_[il] += ffn_sparse(*pool_, kt_, hp, w, down_nm, sparsity_.threshold[il], sparsity_.on_product, scale,
                                  x_.data(), n, s, sp);
    ffn_seen_[il] += (int64_t)n * hp.n_ff;
}

void Session::attention_layer(const LayerWeights& L, int il, int32_t n) {
    const HParams& hp = model_->hp;
    ThreadPool& pool = *pool_;
    const int64_t n_embd = hp.n_embd, n_q = hp.n_embd_q(), n_kv = hp.n_embd_kv(), hd = hp.head_dim;
    float* x = x_.data();
    float* xn = xn_.data();
    float* q = q_.data();
    float* k = k_.data();
    float* v = v_.data();
    float* attn = attn_.data();
    const int32_t pos0 = n_past_;

    rms_norm_rows(pool, x, L.attn_norm, xn, n, n_embd, hp.rms_eps);
    const Weight* qkv[3] = {&L.wq, &L.wk, &L.wv};
    float* outs[3] = {q, k, v};
    matmul_shared_input(pool, kt_, qkv, outs, 3, xn, n);

    // Biases, rotary position embedding, and the new keys and values into the cache. Keys are stored
    // by position ([pos][n_embd_kv]); values transposed ([n_embd_kv][pos]), so the weighted sum of
    // values is one dot product per output element, as in llama.cpp.
    uint8_t* k_layer = k_cache_.data() + (size_t)il * kv_layer_bytes_;
    uint8_t* v_layer = v_cache_.data() + (size_t)il * kv_layer_bytes_;
    const size_t kv_elem = type_traits(kv_type_).type_size;
    const from_float_fn to_kv = kt_.from_float[kv_type_];
    const float* freq_factors = model_->rope_freqs.present() ? (const float*)model_->rope_freqs.data : nullptr;
    const bool neox = hp.rope_type == ROPE_NEOX;
    const bool swa = hp.is_swa(il);
    const float rope_base = swa ? hp.rope_freq_base_swa : hp.rope_freq_base;
    const float rope_scale = swa ? hp.rope_freq_scale_swa : hp.rope_freq_scale;
    const float* q_norm = L.q_norm.present() ? (const float*)L.q_norm.data : nullptr;
    const float* k_norm = L.k_norm.present() ? (const float*)L.k_norm.data : nullptr;
    auto prepare = [&](int64_t t) {
        float* qt = q + t * n_q;
        float* kt = k + t * n_kv;
        float* vt = v + t * n_kv;
        add_bias_rows(L.bq, qt, 1);
        add_bias_rows(L.bk, kt, 1);
        add_bias_rows(L.bv, vt, 1);
        float cs[2 * 512];
        float* cos = cs;
        float* sin = cs + hp.n_rot / 2;
        // Gemma 3 normalizes every head of q and k before rotating them.
        if (q_norm)
            for (int h = 0; h < hp.n_head; h++) rms_norm(qt + h * hd, q_norm, qt + h * hd, hd, hp.rms_eps);
        if (k_norm)
            for (int h = 0; h < hp.n_head_kv; h++) rms_norm(kt + h * hd, k_norm, kt + h * hd, hd, hp.rms_eps);
        rope_cos_sin(pos0 + t, hp.n_rot, rope_base, rope_scale, freq_factors, cos, sin);
        for (int h = 0; h < hp.n_head; h++) rope(qt + h * hd, hp.n_rot, cos, sin, neox);
        for (int h = 0; h < hp.n_head_kv; h++) rope(kt + h * hd, hp.n_rot, cos, sin, neox);
        if (hp.attn_q_scale != 1.0f)
            for (int64_t i = 0; i < n_q; i++) qt[i] *= hp.attn_q_scale;
        to_kv(kt, k_layer + (size_t)(pos0 + t) * kv_row_bytes_, n_kv);
        uint8_t vconv[512 * 4 * 8];  // one row in the cache type; n_embd_kv <= 4096 floats
        to_kv(vt, vconv, n_kv);
        for (int64_t j = 0; j < n_kv; j++)
            std::memcpy(v_layer + ((size_t)j * n_ctx_ + pos0 + t) * kv_elem, vconv + j * kv_elem, kv_elem);
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

    // Causal attention: token t (at position pos0 + t) sees positions 0..pos0+t. One task per
    // (token, head); a KV head serves n_head / n_head_kv query heads (grouped-query attention).
    // Like llama.cpp, scores cover a window of the cache padded to a multiple of 32 (masked positions
    // are -inf, weight 0), softmax runs over that window, and the weights are converted to the cache
    // type before the dot products with V: the sums then group exactly as llama.cpp's do.
    const int group = hp.n_head / hp.n_head_kv;
    const float scale = hp.attn_kq_scale;
    // A sliding-window layer: position p sees only p - n_swa < s <= p (masked like the future).
    const int64_t n_swa = swa ? hp.n_swa : 0;
    const int32_t xtype = type_traits(kv_type_).vec_dot_type;  // F16 or F32
    const from_float_fn to_dot = kt_.from_float[xtype];
    const vec_dot_fn dot = kt_.attn_dot[kv_type_];
    const size_t head_bytes = row_size(kv_type_, hd);
    const int64_t n_window = std::min<int64_t>(n_ctx_, (pos0 + n + 31) / 32 * 32);
    const int64_t n_tasks = (int64_t)n * hp.n_head;
    auto attend = [&](int64_t task, float* scores, uint8_t* conv) {
        const int64_t t = task / hp.n_head, h = task % hp.n_head;
        const int64_t kvh = h / group;
        const int64_t n_seen = pos0 + t + 1;
        to_dot(q + t * n_q + h * hd, conv, hd);
        const int64_t first = n_swa ? std::max<int64_t>(0, n_seen - n_swa) : 0;
        for (int64_t s = 0; s < first; s++) scores[s] = -INFINITY;
        for (int64_t s = first; s < n_seen; s++) {
            dot(hd, &scores[s], k_layer + (size_t)s * kv_row_bytes_ + kvh * head_bytes, conv);
            scores[s] *= scale;
        }
        for (int64_t s = n_seen; s < n_window; s++) scores[s] = -INFINITY;
        float max = -INFINITY;
        for (int64_t s = first; s < n_seen; s++) max = scores[s] > max ? scores[s] : max;
        const double sum = kt_.softmax_exp(n_window, scores, scores, max);
        const float inv = (float)(1.0 / sum);
        for (int64_t s = 0; s < n_window; s++) scores[s] *= inv;
        to_dot(scores, conv, n_window);
        float* out = attn + t * n_q + h * hd;
        for (int64_t d = 0; d < hd; d++)
            dot(n_window, &out[d], v_layer + ((size_t)(kvh * hd + d) * n_ctx_) * kv_elem, conv);
    };
    pool.run([&](int ith, int nth) {
        float* scores = scores_.data() + (size_t)ith * attn_row_;
        uint8_t* conv = attn_conv_.data() + (size_t)ith * attn_row_ * sizeof(float);
        // Strided, not contiguous: later tokens see more positions, so this balances the work.
        for (int64_t task = ith; task < n_tasks; task += nth) attend(task, scores, conv);
    });

    // Output projection, added into the residual stream (Gemma 3 normalizes it first).
    add_to_residual(pool, kt_, hp, L.wo, L.bo, L.attn_post_norm, attn, n, x, xn);
}

}  // namespace optiml
