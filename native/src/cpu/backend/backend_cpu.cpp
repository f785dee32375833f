// The CPU behind the backend interface: today's kernels and thread pool. "cpu" runs every op on the
// calling thread; "cpu:N" queues them to its own worker thread (with its own pool), which gives the
// engine a second device with real asynchronous semantics on any machine.
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include "attention.h"
#include "cpu/kernels/ops.h"
#include "ffn.h"
#include "moe_ffn.h"
#include "optiml/backend.h"
#include "optiml/common.h"
#include "optiml/huge_pages.h"
#include "optiml/model.h"
#include "optiml/predictor.h"
#include "optiml/quant.h"
#include "optiml/recorder.h"

namespace optiml {

namespace {

class CpuBackend : public Backend {
public:
    CpuBackend(std::string name, std::shared_ptr<ThreadPool> pool, bool async)
        : Backend(std::move(name)), pool_(std::move(pool)), kt_(kernel_table()), async_(async) {
        if (async_) worker_ = std::thread([this] { worker_main(); });
    }

    ~CpuBackend() override {
        if (async_) {
            {
                std::lock_guard<std::mutex> lock(mutex_);
                stop_ = true;
            }
            cv_.notify_all();
            worker_.join();
        }
        free_all();
    }

    bool host_memory() const override { return true; }
    bool synchronous() const override { return !async_; }

    // ---- stream --------------------------------------------------------------------------------
    Event record() override {
        std::lock_guard<std::mutex> lock(mutex_);
        return Event{this, submitted_};
    }

    void wait(const Event& e) override {
        if (!e.backend || e.backend == this) return;  // stream order already
        if (!async_) {
            const bool timed = tracing();
            const double t0 = timed ? trace_clock() : 0.0;
            e.backend->host_wait(e);
            if (timed) add_span(current_trace_layer(), SpanKind::Wait, t0, trace_clock());
            return;
        }
        Backend* other = e.backend;
        const Event ev = e;
        submit(SpanKind::Wait, [other, ev] { other->host_wait(ev); });
    }

    void host_wait(const Event& e) override {
        if (!async_) return;
        std::unique_lock<std::mutex> lock(mutex_);
        done_cv_.wait(lock, [&] { return completed_ >= e.seq || error_; });
        rethrow_locked(lock);
    }

    void synchronize() override { host_wait(record()); }

    void copy_from_host(void* dst, const void* src, size_t bytes) override {
        submit(SpanKind::CopyIn, [=] { std::memcpy(dst, src, bytes); });
    }
    void copy_to_host(void* dst, const void* src, size_t bytes) override {
        submit(SpanKind::CopyOut, [=] { std::memcpy(dst, src, bytes); });
    }
    void copy(void* dst, const void* src, size_t bytes) override {
        submit(SpanKind::Copy, [=] { std::memmove(dst, src, bytes); });
    }

    // ---- ops -----------------------------------------------------------------------------------
    void embed(const Weight& table, const int32_t* tokens, int32_t n, float scale, float* x) override {
        const Weight w = table;
        submit(SpanKind::Embed, [=] {
            const int64_t dim = w.cols;
            for (int32_t t = 0; t < n; t++) {
                float* xt = x + t * dim;
                w.dequantize_row_to(tokens[t], xt);
                if (scale != 1.0f)
                    for (int64_t i = 0; i < dim; i++) xt[i] *= scale;
            }
        });
    }

    void rms_norm(const float* x, const Weight& w, float* out, int32_t n, int64_t dim, float eps) override {
        const Weight ww = w;
        submit(SpanKind::Norm, [=] { rms_norm_rows(*pool_, x, ww, out, n, dim, eps); });
    }

    void attention(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                   const KVLayerView& kv, const BatchView& b, float* x, const StepScratch& s) override {
        const HParams* php = &hp;
        const LayerWeights* pl = &L;
        const Weight rf = rope_freqs;
        submit(SpanKind::Attention, [=] { attention_cpu(*pool_, kt_, *php, layer, *pl, rf, kv, b, x, s); });
    }

    void attention_qkv(const HParams& hp, const LayerWeights& L, const float* x, int32_t n,
                       const StepScratch& s) override {
        const HParams* php = &hp;
        const LayerWeights* pl = &L;
        submit(SpanKind::Attention, [=] { attention_cpu_qkv(*pool_, kt_, *php, *pl, x, n, s); });
    }

    void attention_core(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                        const KVLayerView& kv, const BatchView& b, const StepScratch& s) override {
        const HParams* php = &hp;
        const LayerWeights* pl = &L;
        const Weight rf = rope_freqs;
        submit(SpanKind::Attention, [=] { attention_cpu_core(*pool_, kt_, *php, layer, *pl, rf, kv, b, s); });
    }

    void attention_out(const HParams& hp, const LayerWeights& L, int32_t n, float* x, const StepScratch& s) override {
        const HParams* php = &hp;
        const LayerWeights* pl = &L;
        submit(SpanKind::Attention, [=] { attention_cpu_out(*pool_, kt_, *php, *pl, n, x, s); });
    }

    void ffn(const HParams& hp, int layer, const FFNShare& share, const FFNSparsity& sp, const float* xn, int32_t n,
             float* y, const StepScratch& s, int64_t* active, ActivationRecorder* recorder) override {
        const HParams* php = &hp;
        submit(SpanKind::FFN, [=] {
            const HParams& h = *php;
            const FFNScratch fs{s.gate, s.up};
            const int64_t all = (int64_t)n * (share.rows ? share.n_rows : share.w->gate.rows);
            if (recorder) {
                act_buf_.resize((size_t)n * h.n_ff);
                ActivationRecorder& rec = *recorder;
                const FFNObserver observe = [&](const float* x_n, const float* a, const float* u, const float* hh) {
                    rec.record(*pool_, layer, x_n, a, u, hh, n);
                };
                ffn_dense(*pool_, kt_, h, share, xn, n, fs, y, &observe, act_buf_.data());
                if (active) *active += all;
                return;
            }
            if (!sp.enabled || !share.down_nm) {
                ffn_dense(*pool_, kt_, h, share, xn, n, fs, y);
                if (active) *active += all;
                return;
            }
            // (a placed share's predictor scores every file neuron: n_ff per token)
            const size_t width = (size_t)(share.stored ? h.n_ff : share.w->gate.rows);
            const size_t need = (size_t)n * width;
            if (sp_idx_.size() < need) {
                sp_idx_.resize(need);
                sp_val_.resize(need);
            }
            if (sp_uni_.size() < width) {
                sp_uni_.resize(width);
                sp_seen_.resize(width);
            }
            if ((int32_t)sp_count_.size() < n) sp_count_.resize(n);
            if (sp.predictor && sp_z_.size() < (size_t)n * sp.predictor->rank) sp_z_.resize((size_t)n * sp.predictor->rank);
            const SparseScratch ss{sp_idx_.data(), sp_val_.data(), sp_count_.data(), sp_uni_.data(), sp_seen_.data(),
                                   sp_z_.data()};
            const int64_t c = ffn_sparse(*pool_, kt_, h, share, sp, xn, n, fs, ss, y);
            if (active) *active += c;
        });
    }

    void ffn_gate_up(const HParams&, int, const FFNShare& share, const float* xn, int32_t n, float* gate, float* up,
                     const StepScratch&, int64_t* active) override {
        submit(SpanKind::FFN, [=] {
            optiml::ffn_gate_up(*pool_, kt_, share, xn, n, gate, up);
            if (active) *active += (int64_t)n * (share.rows ? share.n_rows : share.w->gate.rows);
        });
    }

    void ffn_finish(const HParams& hp, const FFNShare& share, const float* gate2, const float* up2,
                    const int32_t* rows2, int64_t k2, int32_t n, float* y, const StepScratch& s) override {
        const HParams* php = &hp;
        submit(SpanKind::FFN, [=] {
            ffn_finish_split(*pool_, kt_, *php, share, gate2, up2, rows2, k2, n, FFNScratch{s.gate, s.up}, y);
        });
    }

    void moe_ffn(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n, float* y,
                 ActivationRecorder* rec) override {
        const HParams* php = &hp;
        const MoEWeights* pw = &w;
        submit(SpanKind::FFN, [=] { moe_ffn_cpu(*pool_, kt_, *php, *pw, xn, n, y, moe_, rec, layer); });
    }

    void moe_router(const HParams&, int, const MoEWeights& w, const float* xn, int32_t n, float* logits) override {
        const MoEWeights* pw = &w;
        submit(SpanKind::FFN, [=] { moe_router_cpu(*pool_, kt_, *pw, xn, n, logits); });
    }

    void moe_experts(const HParams& hp, int layer, const MoEWeights& w, const float* xn, const MoEGroups& g,
                     float* d) override {
        const HParams* php = &hp;
        const MoEWeights* pw = &w;
        submit(SpanKind::FFN, [=] { moe_experts_cpu(*pool_, kt_, *php, *pw, xn, g, d, moe_, nullptr, layer); });
    }

    void moe_shared(const HParams& hp, int, const MoEWeights& w, const float* xn, int32_t n, float* sy,
                    float* sgate) override {
        const HParams* php = &hp;
        const MoEWeights* pw = &w;
        submit(SpanKind::FFN, [=] { moe_shared_cpu(*pool_, kt_, *php, *pw, xn, n, sy, sgate, moe_); });
    }

    void moe_combine(const HParams& hp, int32_t n, const float* weight, const int32_t* slot, const float* d,
                     const float* sy, const float* sgate, float* y) override {
        const HParams* php = &hp;
        const int64_t nk = (int64_t)n * hp.n_expert_used;
        submit(SpanKind::FFN,
               [=] { optiml::moe_combine(*pool_, *php, n, weight, slot, d, nk, nullptr, sy, sgate, y); });
    }

    void ffn_join(const HParams& hp, const FFNWeights& w, float* y, const float* y2, int32_t n, float* x) override {
        const HParams* php = &hp;
        const FFNWeights* pw = &w;
        submit(SpanKind::Join, [=] {
            const int64_t m = (int64_t)n * php->n_embd;
            if (y2)
                for (int64_t i = 0; i < m; i++) y[i] += y2[i];
            join_residual(*pool_, *php, pw->down_b, pw->post_norm, y, n, x);
        });
    }

    void logits(const HParams& hp, const Weight& norm, const Weight& output, const float* x, const int32_t* rows,
                int32_t n_rows, float* logits, float* scratch) override {
        const HParams* php = &hp;
        const Weight nw = norm, ow = output;
        submit(SpanKind::Logits, [=] {
            const HParams& h = *php;
            const int64_t dim = h.n_embd;
            // Rows in place when they are the batch's last ones in order (the usual case), else gathered.
            const float* in = x + (int64_t)rows[0] * dim;
            for (int32_t r = 1; r < n_rows; r++)
                if (rows[r] != rows[0] + r) {
                    for (int32_t i = 0; i < n_rows; i++) std::memcpy(scratch + i * dim, x + (int64_t)rows[i] * dim, 4 * dim);
                    in = scratch;
                    break;
                }
            rms_norm_rows(*pool_, in, nw, scratch, n_rows, dim, h.rms_eps);
            const Weight* out_w[1] = {&ow};
            float* outs[1] = {logits};
            matmul_shared_input(*pool_, kt_, out_w, outs, 1, scratch, n_rows);
            if (h.final_softcap > 0) {
                const float cap = h.final_softcap;
                for (int64_t i = 0; i < (int64_t)n_rows * h.n_vocab; i++) logits[i] = std::tanh(logits[i] / cap) * cap;
            }
        });
    }

private:
    // Whole pages of their own (page_calloc): a device may page-lock any of these blocks.
    void* device_alloc(size_t bytes) override {
        void* p = page_calloc(bytes);
        if (!p) throw Error(format("%s: out of memory allocating %zu bytes", name_.c_str(), bytes));
        return p;
    }
    void device_free(void* p, size_t bytes) override { page_free(p, bytes); }

    // Runs fn on this backend's stream (inline for the host), timed as a span of `kind` while tracing.
    void submit(SpanKind kind, std::function<void()> fn) {
        if (tracing()) {
            const int layer = current_trace_layer();
            fn = [this, kind, layer, op = std::move(fn)] {
                const double t0 = trace_clock();
                op();
                add_span(layer, kind, t0, trace_clock());
            };
        }
        if (!async_) {
            fn();
            return;
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(std::move(fn));
            submitted_++;
        }
        cv_.notify_one();
    }

    void worker_main() {
        for (;;) {
            std::function<void()> job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
                if (queue_.empty()) return;  // stopping, nothing left
                job = std::move(queue_.front());
                queue_.pop_front();
            }
            std::exception_ptr err;
            {
                bool skip;
                {
                    std::lock_guard<std::mutex> lock(mutex_);
                    skip = error_ != nullptr;  // after a failure the stream only drains
                }
                if (!skip) {
                    try {
                        job();
                    } catch (...) {
                        err = std::current_exception();
                    }
                }
            }
            {
                std::lock_guard<std::mutex> lock(mutex_);
                if (err && !error_) error_ = err;
                completed_++;
            }
            done_cv_.notify_all();
        }
    }

    // Called with mutex_ held: a failed op's exception surfaces at the next synchronization, once.
    void rethrow_locked(std::unique_lock<std::mutex>& lock) {
        if (!error_) return;
        std::exception_ptr e = error_;
        // Drain what was queued behind the failure before reporting it, so the stream is clean again.
        done_cv_.wait(lock, [&] { return completed_ >= submitted_; });
        error_ = nullptr;
        lock.unlock();
        std::rethrow_exception(e);
    }

    std::shared_ptr<ThreadPool> pool_;
    const KernelTable& kt_;
    bool async_;

    std::thread worker_;
    std::mutex mutex_;
    std::condition_variable cv_, done_cv_;
    std::deque<std::function<void()>> queue_;
    uint64_t submitted_ = 0, completed_ = 0;
    bool stop_ = false;
    std::exception_ptr error_;

    // Scratch of the sparse FFN and the recorder, used by this backend's stream only.
    std::vector<int32_t> sp_idx_, sp_count_, sp_uni_;
    std::vector<float> sp_val_, sp_z_, act_buf_;
    std::vector<uint8_t> sp_seen_;
    MoEScratch moe_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(std::shared_ptr<ThreadPool> pool) {
    return std::make_unique<CpuBackend>("cpu", std::move(pool), /*async=*/false);
}

std::unique_ptr<Backend> make_cpu_device_backend(int index, int n_threads) {
    if (index < 1) throw ArgumentError(format("cpu:%d: a second CPU device is numbered 1 or more", index));
    if (n_threads < 1) throw ArgumentError("a CPU device needs at least one thread");
    return std::make_unique<CpuBackend>(format("cpu:%d", index), std::make_shared<ThreadPool>(n_threads),
                                        /*async=*/true);
}

}  // namespace optiml
