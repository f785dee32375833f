// Session: KV cache and scratch buffers, and the entry point that feeds tokens in batches.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "optiml/common.h"
#include "optiml/model.h"

namespace optiml {

Session::Session(std::shared_ptr<Model> model, int32_t n_ctx, std::shared_ptr<ThreadPool> pool, int32_t kv_type,
                 int32_t n_batch)
    : model_(std::move(model)), pool_(std::move(pool)), kt_(kernel_table()), n_ctx_(n_ctx), n_batch_(n_batch),
      kv_type_(kv_type) {
    const HParams& hp = model_->hp;
    if (n_ctx <= 0) throw ArgumentError(format("n_ctx must be positive, got %d", n_ctx));
    if (n_batch <= 0) throw ArgumentError(format("n_batch must be positive, got %d", n_batch));
    if (kv_type != TYPE_F16 && kv_type != TYPE_F32)
        throw ArgumentError("the KV cache type must be f16 or f32");
    if (hp.n_embd_kv() > 4096)
        throw UnsupportedModelError(format("K/V rows of %d values are more than the 4096 this build supports",
                                           hp.n_embd_kv()));
    n_batch_ = std::min(n_batch_, n_ctx_);

    kv_row_bytes_ = row_size(kv_type, hp.n_embd_kv());
    kv_layer_bytes_ = kv_row_bytes_ * (size_t)n_ctx;
    k_cache_.assign(kv_layer_bytes_ * hp.n_layer, 0);
    v_cache_.assign(kv_layer_bytes_ * hp.n_layer, 0);

    const size_t nb = (size_t)n_batch_;
    x_.resize(nb * hp.n_embd);
    xn_.resize(nb * hp.n_embd);
    q_.resize(nb * hp.n_embd_q());
    k_.resize(nb * hp.n_embd_kv());
    v_.resize(nb * hp.n_embd_kv());
    attn_.resize(nb * hp.n_embd_q());
    ffn_gate_.resize(nb * hp.n_ff);
    ffn_up_.resize(nb * hp.n_ff);
    // Per thread: a row of scores over the context, and room for either q (head_dim values) or the
    // attention weights (n_ctx values) in the cache's dot-product type (at most 4 bytes each).
    attn_row_ = std::max<size_t>((size_t)n_ctx, (size_t)hp.head_dim);
    scores_.resize((size_t)pool_->size() * attn_row_);
    attn_conv_.resize((size_t)pool_->size() * attn_row_ * sizeof(float));
    reset_sparsity_counts();
}

void Session::set_sparsity(const SparsitySettings& st) {
    const HParams& hp = model_->hp;
    if (st.enabled) {
        if ((int64_t)st.threshold.size() != hp.n_layer)
            throw ArgumentError(format("%zu sparsity thresholds given for a model of %d layers", st.threshold.size(),
                                       hp.n_layer));
        for (float t : st.threshold)
            if (!(t >= 0) || !std::isfinite(t))
                throw ArgumentError(format("sparsity thresholds must be finite and >= 0, got %g", t));
        if (!st.neuron_scale.empty() && (int64_t)st.neuron_scale.size() != (int64_t)hp.n_layer * hp.n_ff)
            throw ArgumentError(format("neuron_scale holds %zu values, expected n_layer * n_ff = %lld",
                                       st.neuron_scale.size(), (long long)hp.n_layer * hp.n_ff));
        const size_t nb = (size_t)n_batch_, nf = (size_t)hp.n_ff;
        active_idx_.resize(nb * nf);
        active_val_.resize(nb * nf);
        active_count_.resize(nb);
        active_uni_.resize(nf);
        active_seen_.resize(nf);
        model_->down_neuron_major(*pool_);  // the repack happens now, not inside the first token
    }
    sparsity_ = st;
    reset_sparsity_counts();
}

void Session::reset_sparsity_counts() {
    ffn_active_.assign(model_->hp.n_layer, 0);
    ffn_seen_.assign(model_->hp.n_layer, 0);
}

void Session::truncate(int32_t n) {
    if (n < 0 || n > n_past_)
        throw ArgumentError(format("cannot truncate a context of %d tokens to %d", n_past_, n));
    n_past_ = n;
}

void Session::eval(const int32_t* tokens, int32_t n, bool all_logits, float* logits) {
    const HParams& hp = model_->hp;
    if (n <= 0) throw ArgumentError("eval needs at least one token");
    if ((int64_t)n_past_ + n > n_ctx_)
        throw ContextOverflowError(format("%d tokens do not fit: the context holds %d and %d are used (n_ctx=%d)", n,
                                          n_ctx_, n_past_, n_ctx_));
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp.n_vocab)
            throw ArgumentError(format("token id %d is out of range [0, %d)", tokens[i], hp.n_vocab));
    for (int32_t done = 0; done < n;) {
        const int32_t m = std::min(n_batch_, n - done);
        const bool last = done + m == n;
        float* out = all_logits ? logits + (size_t)done * hp.n_vocab : (last ? logits : nullptr);
        forward_batch(tokens + done, m, all_logits, out);
        done += m;
    }
}

}  // namespace optiml
