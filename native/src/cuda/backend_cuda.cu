// The CUDA device behind the backend interface (optiml/backend.h): one stream per backend, device
// memory from cudaMalloc counted by Backend::alloc, events for the order between devices, and the
// forward pass's ops as kernels (kernels.cuh).
//
// Activations are converted as the CPU converts them before its products (8-bit codes multiplied as
// integers for Q4_0/Q4_1/Q8_0 rows, else rounded and multiplied in float): the devices then differ only
// in summation order.
//
// A decode step's kernels are fused where the layout allows (issue #43): each RMSNorm is made by the
// kernel that converts its products' input (CudaInputStage), as is the FFN's act(gate) * up for down;
// q/k/v and gate/up are one launch each; biases and the residual adds run in the products' epilogue;
// the attention kernel leaves its output as the output projection reads it; RoPE and the KV write are
// one kernel. A layer of a Q4_0 llama is 9 kernels (17 before). Every kernel is counted with the bytes
// it moves (Backend::launch_counts, `optiml bench --launches`).
//
// Prompts of 32 tokens and more run their products as tensor-core tiles (matmul_tiles.cu). The host's
// scratch and the split FFN's staging are page-locked (pin_host), so their copies queue without blocking
// the host. Not yet: the embedding table on the GPU (the embedding runs on the host; its rows are copied
// over).
#include <cuda_runtime.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <map>
#include <vector>

#include "kernels.cuh"
#include "optiml/backend.h"
#include "optiml/common.h"
#include "optiml/cuda.h"
#include "optiml/ggml_types.h"
#include "optiml/kernels.h"
#include "optiml/model.h"
#include "optiml/moe_route.h"

namespace optiml {

namespace {

// Events are recorded into a ring: waiting on a slot that a later record() reused waits for that later
// point of the same stream, which is also after the one asked for.
constexpr int kEvents = 256;

class CudaBackend : public Backend, private CudaLaunchLog {
public:
    explicit CudaBackend(int device) : Backend(format("cuda:%d", device)), device_(device) {
        use();
        if (const char* env = std::getenv("OPTIML_CUDA_GRAPHS")) graphs_ = std::strcmp(env, "0") != 0;
        if (const char* env = std::getenv("OPTIML_CUDA_FUSE")) fuse_ = std::strcmp(env, "0") != 0;
        cudaDeviceProp prop{};
        mma_ = cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major >= 8;
        sm_count_ = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
        if (const char* env = std::getenv("OPTIML_CUDA_TILES")) mma_ = mma_ && std::strcmp(env, "0") != 0;
        if (const char* env = std::getenv("OPTIML_CUDA_ATTN_SPLITS")) attn_splits_forced_ = std::atoi(env);
        const char* one_token = std::getenv("OPTIML_CUDA_ONE_TOKEN");  // (process-wide: set by each backend made)
        cuda_use_one_token_kernels(!one_token || std::strcmp(one_token, "0") != 0);
        cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a stream");
        events_.resize(kEvents);
        for (cudaEvent_t& e : events_) cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "creating an event");
    }

    ~CudaBackend() override {
        cudaSetDevice(device_);
        if (capturing_) {  // (an exception between capture_begin and capture_end that nobody ended)
            cudaGraph_t g = nullptr;
            cudaStreamEndCapture(stream_, &g);
            if (g) cudaGraphDestroy(g);
            cudaGetLastError();
        }
        cudaStreamSynchronize(stream_);
        for (auto& [key, rec] : recordings_)
            if (rec.exec) cudaGraphExecDestroy(rec.exec);
        for (const auto& range : pinned_) cudaHostUnregister(range.first);
        free_all();
        for (cudaEvent_t e : events_) cudaEventDestroy(e);
        drop_timed();
        if (trace_base_) cudaEventDestroy(trace_base_);
        cudaStreamDestroy(stream_);
        if (cuda_launch_log() == this) cuda_set_launch_log(nullptr);
    }

    bool host_memory() const override { return false; }
    bool synchronous() const override { return false; }

    // ---- stream --------------------------------------------------------------------------------
    Event record() override {
        use();
        const uint64_t seq = ++recorded_;
        cuda_check(cudaEventRecord(events_[seq % kEvents], stream_), "recording an event");
        return Event{this, seq};
    }

    void wait(const Event& e) override {
        if (!e.backend || e.backend == this) return;  // stream order already
        if (e.backend->synchronous()) return;         // the host's ops are done when they return
        e.backend->host_wait(e);
    }

    void host_wait(const Event& e) override {
        if (e.seq == 0) return;
        use();
        cuda_check(cudaEventSynchronize(events_[e.seq % kEvents]), "waiting for the GPU");
    }

    void synchronize() override {
        use();
        cuda_check(cudaStreamSynchronize(stream_), "waiting for the GPU");
    }

    void pin_host(void* p, size_t bytes) override {
        use();
        if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) pinned_.push_back({p, bytes});
        else cudaGetLastError();  // stays pageable: slower copies, same results
    }
    bool pinned(const void* p, size_t bytes) const override {
        const auto* b = (const uint8_t*)p;
        for (const auto& [q, n] : pinned_)
            if (b >= (const uint8_t*)q && b + bytes <= (const uint8_t*)q + n) return true;
        return false;
    }

    void copy_from_host(void* dst, const void* src, size_t bytes) override {
        use();
        const OpSpan span(*this, SpanKind::CopyIn);
        cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "copying to the GPU");
        count(CudaKernel::CopyIn, {0, (int64_t)bytes});
    }
    void copy_to_host(void* dst, const void* src, size_t bytes) override {
        use();
        const OpSpan span(*this, SpanKind::CopyOut);
        cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copying from the GPU");
        count(CudaKernel::CopyOut, {0, (int64_t)bytes});
    }
    void copy(void* dst, const void* src, size_t bytes) override {
        use();
        const OpSpan span(*this, SpanKind::Copy);
        cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "copying on the GPU");
        count(CudaKernel::Copy, {0, 2 * (int64_t)bytes});
    }

    // ---- recorded steps (CUDA graphs) ------------------------------------------------------------
    void upload_batch(const BatchView& b) override {
        if (!graphs_) return;  // (nothing recorded reads it: the ops upload their own batch)
        use();
        const size_t count = 2 * (size_t)b.n;
        if (count > step_batch_capacity_) {  // once: the largest recorded step (a new allocation drops recordings)
            step_batch_capacity_ = count < 64 ? 64 : count;
            step_batch_ = (int32_t*)alloc(sizeof(int32_t) * step_batch_capacity_, "scratch");
        }
        step_batch_host_.assign(b.seq, b.seq + b.n);
        step_batch_host_.insert(step_batch_host_.end(), b.pos, b.pos + b.n);
        copy_from_host(step_batch_, step_batch_host_.data(), sizeof(int32_t) * count);
        count_pos_.assign(b.pos, b.pos + b.n);  // what a replayed step's attention reads
    }

    bool replay(const std::vector<int32_t>& key) override {
        auto it = recordings_.find(key);
        if (it == recordings_.end() || !it->second.exec || it->second.epoch != alloc_epoch_) return false;
        it->second.used = ++record_clock_;
        use();
        cuda_check(cudaGraphLaunch(it->second.exec, stream_), "launching a recorded step");
        ++launches_;
        ++host_launches_;
        for (const Counted& c : it->second.counted) add_count(c.layer, c.kind, c.traffic);
        return true;
    }
    int64_t recorded_launches() const override { return launches_; }

    // ---- launch counts (kernels.cuh: the launchers count, count() keeps) --------------------------
    std::vector<LaunchCount> launch_counts() const override {
        std::vector<LaunchCount> out;
        for (size_t l = 0; l < counts_.size(); l++)
            for (size_t k = 0; k < counts_[l].size(); k++) {
                const KindCount& c = counts_[l][k];
                if (c.launches == 0) continue;
                out.push_back({(int32_t)l - 1, cuda_kernel_name((CudaKernel)k), cuda_kernel_is_copy((CudaKernel)k),
                               c.launches, c.weights, c.activations, c.kv});
            }
        return out;
    }
    int64_t host_launches() const override { return host_launches_; }
    void reset_launch_counts() override {
        counts_.clear();
        host_launches_ = 0;
    }

    bool capture_begin(const std::vector<int32_t>& key) override {
        if (!graphs_ || tracing()) return false;  // (tracing: ops timed one by one)
        if (recordings_.size() >= kMaxRecorded && !recordings_.count(key)) drop_least_used();
        Recording& rec = recordings_[key];
        rec.used = ++record_clock_;
        // The first step of a shape runs plain: memory the ops allocate on first use (outside a recording,
        // where allocating is not allowed) exists from then on.
        if (rec.failed || ++rec.seen < 2) return false;
        use();
        rec.counted.clear();
        if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
            cudaGetLastError();
            rec.failed = true;  // this device cannot record: every step of this shape runs plain
            return false;
        }
        capturing_ = &rec;
        return true;
    }

    bool capture_end(bool ok) override {
        Recording* rec = capturing_;
        if (!rec) return ok;
        capturing_ = nullptr;
        use();
        cudaGraph_t graph = nullptr;
        cudaError_t err = cudaStreamEndCapture(stream_, &graph);
        if (ok && err == cudaSuccess && graph) {
            if (rec->exec) {  // the same shape after memory moved: update the launchable graph in place
                cudaGraphExecUpdateResultInfo info;
                if (cudaGraphExecUpdate(rec->exec, graph, &info) != cudaSuccess) {
                    cudaGetLastError();
                    cudaGraphExecDestroy(rec->exec);
                    rec->exec = nullptr;
                }
            }
            if (!rec->exec) err = cudaGraphInstantiate(&rec->exec, graph, 0);
        }
        if (graph) cudaGraphDestroy(graph);
        if (!ok) {  // an exception while recording: this shape's ops run plain from now on
            cudaGetLastError();
            rec->failed = true;
            return false;
        }
        if (err != cudaSuccess || !rec->exec) {
            cudaGetLastError();
            rec->failed = true;
            if (rec->exec) cudaGraphExecDestroy(rec->exec);
            rec->exec = nullptr;
            return false;
        }
        rec->epoch = alloc_epoch_;
        cuda_check(cudaGraphLaunch(rec->exec, stream_), "launching a recorded step");
        ++launches_;
        ++host_launches_;
        for (const Counted& c : rec->counted) add_count(c.layer, c.kind, c.traffic);
        return true;
    }

    // ---- ops -----------------------------------------------------------------------------------
    void embed(const Weight&, const int32_t*, int32_t, float, float*) override {  // (the plan keeps it there)
        throw Error("internal: the embedding runs on the host, not on " + name_);
    }

    void rms_norm(const float* x, const Weight& w, float* out, int32_t n, int64_t dim, float eps) override {
        use();
        const OpSpan span(*this, SpanKind::Norm);
        cuda_rms_norm(stream_, x, (const float*)w.data, out, n, dim, eps);
    }

    void attention(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                   const KVLayerView& kv, const BatchView& b, float* x, const StepScratch& s) override {
        use();
        const OpSpan span(*this, SpanKind::Attention);
        qkv(hp, L, x, b.n, s);
        // The attention's output made as the output projection reads it, by the attention kernel itself
        // (only here: attention_core's output may be joined by rows the host computed).
        Input attn = core(hp, layer, L, rope_freqs, kv, b, s, fuse_ ? &L.wo : nullptr);
        out(hp, L, x, s, attn);
    }

    void attention_qkv(const HParams& hp, const LayerWeights& L, const float* x, int32_t n,
                       const StepScratch& s) override {
        use();
        const OpSpan span(*this, SpanKind::Attention);
        qkv(hp, L, x, n, s);
    }

    void attention_core(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                        const KVLayerView& kv, const BatchView& b, const StepScratch& s) override {
        use();
        const OpSpan span(*this, SpanKind::Attention);
        core(hp, layer, L, rope_freqs, kv, b, s, nullptr);
    }

    void attention_out(const HParams& hp, const LayerWeights& L, int32_t n, float* x, const StepScratch& s) override {
        use();
        const OpSpan span(*this, SpanKind::Attention);
        Input attn = floats(s.attn, s.attn, n, hp.n_embd_q());
        out(hp, L, x, s, attn);
    }

    void ffn(const HParams& hp, int, const FFNShare& share, const FFNSparsity& sp, const float* xn, int32_t n,
             float* y, const StepScratch& s, int64_t* active, ActivationRecorder* recorder) override {
        // The plan gives a device packed shares computed dense (forward.cpp): the rest is the host's work.
        if (recorder || sp.enabled || share.rows)
            throw Error("internal: the CUDA backend computes packed FFN shares densely only");
        const NeuronMajor* nm = share.down_nm;
        if (!share.w->down.present() &&
            (!nm || nm->type != TYPE_Q8_0 || nm->grouped || share.nm_slot || !nm->external_dim_scale))
            throw Error("internal: a CUDA share's down matrix is neither dense nor 8-bit neuron-major rows");
        use();
        const OpSpan span(*this, SpanKind::FFN);
        const FFNWeights& w = *share.w;
        Input in = floats(const_cast<float*>(xn), y, n, hp.n_embd);  // y holds xn rounded until down writes it
        Input h = gate_up(hp, w, in, s);
        if (w.down.present()) {
            products(h, {{&w.down, y, nullptr, false}});
        } else {  // a placement's reordered share: its down columns as neuron-major rows (session.cpp)
            make_floats(h);
            cuda_down_neuron_major_q8(stream_, nm->bytes(), nm->row_bytes, nm->external_dim_scale, s.gate, w.gate.rows,
                                      hp.n_embd, n, y);
        }
        if (active) *active += (int64_t)n * w.gate.rows;
    }

    // A packed share's gate and up products (Backend::ffn_gate_up); s.y takes the input's rounding (the
    // share computes no down product here).
    void ffn_gate_up(const HParams& hp, int, const FFNShare& share, const float* xn, int32_t n, float* gate,
                     float* up, const StepScratch& s, int64_t* active) override {
        if (share.rows) throw Error("internal: the CUDA backend computes packed FFN shares only");
        use();
        const OpSpan span(*this, SpanKind::FFN);
        const FFNWeights& w = *share.w;
        Input in = floats(const_cast<float*>(xn), s.y, n, hp.n_embd);
        // The CPU's bits where the weights' type has an exact kernel (cuda_matmul_exact_reads): the host then
        // finishes the layer as the CPU alone would (forward.cpp), and the split costs no fidelity.
        struct Exact {
            bool& on;
            ~Exact() { on = false; }
        } exact{exact_ = true};
        products(in, {{&w.gate, gate, (const float*)w.gate_b.data, false},
                      {&w.up, up, (const float*)w.up_b.data, false}});
        if (active) *active += (int64_t)n * w.gate.rows;
    }

    // The FFN block where the residual stream is (Backend::ffn_block): the norm made with the gate and up
    // products' input, gate and up in one launch, act(gate) * up made with down's input, and down's sums
    // added into x by its own epilogue (Gemma 3's post-norm: down into y, then normalized and added in one
    // kernel). The same ops as rms_norm, ffn and ffn_join, fused, with the same bits.
    bool ffn_block(const HParams& hp, int, const FFNShare& share, const FFNWeights& join, float* x, int32_t n,
                   const StepScratch& s, int64_t* active) override {
        if (!fuse_ || share.rows || !share.w->down.present()) return false;  // (neuron-major: ffn + ffn_join)
        use();
        const FFNWeights& w = *share.w;
        {
            const OpSpan span(*this, SpanKind::FFN);
            Input in = normed(x, join.norm, hp.rms_eps, s.xn, s.y, n, hp.n_embd);
            Input h = gate_up(hp, w, in, s);
            const bool post = join.post_norm.present();
            products(h, {{&w.down, post ? s.y : x, (const float*)join.down_b.data, !post}});
            if (active) *active += (int64_t)n * w.gate.rows;
            if (!post) return true;
        }
        const OpSpan span(*this, SpanKind::Join);
        cuda_rms_norm_add(stream_, s.y, (const float*)join.post_norm.data, x, n, hp.n_embd, hp.rms_eps);
        return true;
    }

    // ---- mixtures of experts ----------------------------------------------------------------------
    // Each token's experts summed where the residual lives (Backend::moe_combine).
    void moe_combine(const HParams& hp, int32_t n, const float* weight, const int32_t* slot, const float* d,
                     const float* sy, const float* sgate, float* y) override {
        use();
        const OpSpan span(*this, SpanKind::FFN);
        cuda_moe_combine(stream_, n, hp.n_expert_used, hp.n_embd, weight, slot, d, sy, sgate, y);
    }

    // The router's logits (Backend::moe_router).
    void moe_router(const HParams& hp, int, const MoEWeights& w, const float* xn, int32_t n, float* logits) override {
        use();
        const OpSpan span(*this, SpanKind::FFN);
        Input in = floats(const_cast<float*>(xn), moe_buffer(moe_round_, (size_t)n * hp.n_embd), n, hp.n_embd);
        products(in, {{&w.gate_inp, logits, (const float*)w.gate_inp_b.data, false}});
    }

    // Expert e's row of an experts' bias of rows values (gpt-oss), or nullptr.
    static const float* expert_bias(const Weight& b, int32_t e) {
        return b.present() ? (const float*)b.data + (size_t)e * b.cols : nullptr;
    }

    // Each expert's rows (Backend::moe_experts): the step's rows gathered by expert once, their input
    // converted once, the chosen experts' gate and up products in launches of up to 16 matrices (each
    // over its expert's rows), act(gate) * up made once for all rows by down's input stage, the downs
    // likewise: four kernels for a decode step's experts (llama.cpp's mul_mat_id does it in two). Rows that
    // the integer products would read as more than 16 rows of codes (prompts of Q4_0/Q4_1/Q8_0 experts)
    // go an expert at a time.
    void moe_experts(const HParams& hp, int, const MoEWeights& w, const float* xn, const MoEGroups& g,
                     float* d) override {
        if (g.n_rows == 0) return;
        use();
        const int64_t E = hp.n_embd, F = w.gate.rows, nr = g.n_rows;
        int32_t* idx = (int32_t*)moe_buffer(moe_idx_, (size_t)nr);
        float* xg = moe_buffer(moe_xg_, (size_t)nr * E);
        float* round = moe_buffer(moe_round_, (size_t)nr * E);
        StepScratch ss;
        ss.gate = moe_buffer(moe_gate_, (size_t)nr * F);
        ss.up = moe_buffer(moe_up_, (size_t)nr * F);
        copy_from_host(idx, g.token, sizeof(int32_t) * nr);
        const OpSpan span(*this, SpanKind::FFN);
        cuda_gather_rows(stream_, xn, idx, nr, E, xg);
        const Weight gate0 = expert(w.gate, 0), up0 = expert(w.up, 0), down0 = expert(w.down, 0);
        if (fuse_ && (nr <= kCodeTokens || !(q8x(gate0) || q8x(up0) || q8x(down0)))) {
            std::vector<Weight> ws;  // (read by products() as it enqueues them)
            for (int32_t e = 0; e < g.n_expert; e++)
                if (g.count[e]) ws.insert(ws.end(), {expert(w.gate, e), expert(w.up, e), expert(w.down, e)});
            std::vector<Out> gu, dn;
            for (int32_t e = 0, i = 0; e < g.n_expert; e++) {
                if (!g.count[e]) continue;
                const int32_t r0 = g.first[e], c = g.count[e];
                gu.push_back({&ws[i], ss.gate + (size_t)r0 * F, expert_bias(w.gate_b, e), false, r0, c});
                gu.push_back({&ws[i + 1], ss.up + (size_t)r0 * F, expert_bias(w.up_b, e), false, r0, c});
                dn.push_back({&ws[i + 2], d + (size_t)r0 * E, expert_bias(w.down_b, e), false, r0, c});
                i += 3;
            }
            Input in = floats(xg, round, (int32_t)nr, E);
            products(in, gu.data(), (int)gu.size());
            Input h = act_input(hp, w.gate.type, ss.gate, ss.up, (int32_t)nr, F);
            products(h, dn.data(), (int)dn.size());
            return;
        }
        for (int32_t e = 0; e < g.n_expert; e++) {
            if (!g.count[e]) continue;
            const size_t r0 = (size_t)g.first[e];
            FFNWeights fw;
            fw.gate = expert(w.gate, e);
            fw.up = expert(w.up, e);
            fw.gate_b.data = (const uint8_t*)expert_bias(w.gate_b, e);
            fw.up_b.data = (const uint8_t*)expert_bias(w.up_b, e);
            const Weight down = expert(w.down, e);
            StepScratch se;
            se.gate = ss.gate + r0 * F;
            se.up = ss.up + r0 * F;
            Input in = floats(xg + r0 * E, round + r0 * E, g.count[e], E);
            Input h = gate_up(hp, fw, in, se);
            products(h, {{&down, d + r0 * E, expert_bias(w.down_b, e), false}});
        }
    }

    // The shared expert and its gate (Backend::moe_shared).
    void moe_shared(const HParams& hp, int, const MoEWeights& w, const float* xn, int32_t n, float* sy,
                    float* sgate) override {
        use();
        const OpSpan span(*this, SpanKind::FFN);
        const int64_t S = w.shared.gate.rows;
        float* round = moe_buffer(moe_round_, (size_t)n * hp.n_embd);
        StepScratch ss;
        ss.gate = moe_buffer(moe_gate_, (size_t)n * S);
        ss.up = moe_buffer(moe_up_, (size_t)n * S);
        Input in = floats(const_cast<float*>(xn), round, n, hp.n_embd);
        Input h = gate_up(hp, w.shared, in, ss);
        products(h, {{&w.shared.down, sy, nullptr, false}});
        if (w.gate_inp_shexp.present()) {
            Input g = floats(const_cast<float*>(xn), round, n, hp.n_embd);
            products(g, {{&w.gate_inp_shexp, sgate, nullptr, false}});
            cuda_sigmoid(stream_, sgate, n);
        } else {
            cuda_fill(stream_, sgate, n, 1.0f);
        }
    }

    // A whole mixture of experts here (Backend::moe_ffn). A step of at most kMoEPairsOnDevice (token,
    // expert) pairs (decode) stays on the GPU: the router, its top k (cuda_moe_route), each pair through its chosen
    // expert's gate and up in one launch and down in another, the shared expert and the weighted sum; such
    // steps can be recorded (Session::forward_recorded). A longer step routes on the host, which groups
    // the pairs by expert so each expert reads its weights once for its tokens (moe_experts): a sync per
    // layer, as llama.cpp's experts split across devices have.
    void moe_ffn(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n, float* y,
                 ActivationRecorder* rec) override {
        if (rec) throw Error("internal: the profiler records on the host");
        const int32_t X = hp.n_expert, k = hp.n_expert_used;
        const int64_t nk = (int64_t)n * k, E = hp.n_embd;
        if (nk <= kMoEPairsOnDevice && w.gate.expert_bytes % 16 == 0 && w.up.expert_bytes % 16 == 0 &&
            w.down.expert_bytes % 16 == 0) {
            moe_ffn_routed_here(hp, layer, w, xn, n, y);
            return;
        }
        MoEHost& m = moe_host_;
        float* logits = moe_buffer(moe_logits_, (size_t)n * X);
        moe_router(hp, layer, w, xn, n, logits);
        m.logits.resize((size_t)n * X);
        copy_to_host(m.logits.data(), logits, sizeof(float) * n * X);
        synchronize();
        m.chosen.resize(nk);
        m.weight.resize(nk);
        m.slot.resize(nk);
        moe_route(hp, m.logits.data(), n, m.chosen.data(), m.weight.data());
        moe_group(m.chosen.data(), nk, k, X, nullptr, m.count, m.first, m.token, m.slot.data());
        float* d = moe_buffer(moe_d_, (size_t)nk * E);
        moe_experts(hp, layer, w, xn, MoEGroups{n, m.token.data(), nk, m.first.data(), m.count.data(), X}, d);
        const bool shared = w.shared.gate.present();
        float* sy = shared ? moe_buffer(moe_sy_, (size_t)n * E + n) : nullptr;
        if (shared) moe_shared(hp, layer, w, xn, n, sy, sy + (size_t)n * E);
        float* wd = moe_buffer(moe_weight_, 2 * (size_t)nk);  // the weights, then the slots
        copy_from_host(wd, m.weight.data(), sizeof(float) * nk);
        copy_from_host(wd + nk, m.slot.data(), sizeof(int32_t) * nk);
        const OpSpan span(*this, SpanKind::FFN);
        cuda_moe_combine(stream_, n, k, E, wd, (const int32_t*)(wd + nk), d, sy, shared ? sy + (size_t)n * E : nullptr, y);
    }

    // moe_ffn's decode path: nothing leaves the GPU.
    void moe_ffn_routed_here(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n, float* y) {
        const int32_t X = hp.n_expert, k = hp.n_expert_used;
        const int32_t nk = n * k;
        const int64_t E = hp.n_embd, F = w.gate.rows;
        float* logits = moe_buffer(moe_logits_, (size_t)n * X);
        float* route = moe_buffer(moe_weight_, 2 * (size_t)nk);  // the weights, then the chosen experts
        int32_t* chosen = (int32_t*)(route + nk);
        float* d = moe_buffer(moe_d_, (size_t)nk * E);
        const bool shared = w.shared.gate.present();
        float* sy = shared ? moe_buffer(moe_sy_, (size_t)n * E + n) : nullptr;
        moe_router(hp, layer, w, xn, n, logits);
        {
            use();
            const OpSpan span(*this, SpanKind::FFN);
            cuda_moe_route(stream_, logits, n, X, k, hp.expert_weights_norm, hp.expert_weights_scale,
                           hp.expert_gating == MOE_GATING_SOFTMAX_CHOSEN, chosen, route);
            StepScratch ss;
            ss.gate = moe_buffer(moe_gate_, (size_t)nk * F);
            ss.up = moe_buffer(moe_up_, (size_t)nk * F);
            const Weight gate = expert(w.gate, 0), up = expert(w.up, 0), down = expert(w.down, 0);
            Input in = floats(const_cast<float*>(xn), moe_buffer(moe_round_, (size_t)n * E), n, E);
            const Out gu[2] = {{&gate, ss.gate, nullptr, false, 0, nk, chosen, w.gate.expert_bytes, k},
                               {&up, ss.up, nullptr, false, 0, nk, chosen, w.up.expert_bytes, k}};
            products(in, gu, 2);
            // (each pair's own expert's biases: a kernel after the products, which add one bias to all rows)
            cuda_add_expert_bias(stream_, ss.gate, (const float*)w.gate_b.data, chosen, nk, F);
            cuda_add_expert_bias(stream_, ss.up, (const float*)w.up_b.data, chosen, nk, F);
            Input h = act_input(hp, w.gate.type, ss.gate, ss.up, nk, F);
            const Out dn[1] = {{&down, d, nullptr, false, 0, nk, chosen, w.down.expert_bytes, 1}};
            products(h, dn, 1);
            cuda_add_expert_bias(stream_, d, (const float*)w.down_b.data, chosen, nk, E);
        }
        if (shared) moe_shared(hp, layer, w, xn, n, sy, sy + (size_t)n * E);
        use();
        const OpSpan span(*this, SpanKind::FFN);
        cuda_moe_combine(stream_, n, k, E, route, nullptr, d, sy, shared ? sy + (size_t)n * E : nullptr, y);
    }

    void ffn_join(const HParams& hp, const FFNWeights& w, float* y, const float* y2, int32_t n, float* x) override {
        use();
        const OpSpan span(*this, SpanKind::Join);
        const int64_t count = (int64_t)n * hp.n_embd;
        if (y2) cuda_add(stream_, y, y2, nullptr, count);
        cuda_add_bias(stream_, y, (const float*)w.down_b.data, n, hp.n_embd);
        if (w.post_norm.present()) norm_add(y, w.post_norm, x, n, hp);
        else cuda_add(stream_, x, y, nullptr, count);
    }

    void logits(const HParams& hp, const Weight& norm, const Weight& output, const float* x, const int32_t* rows,
                int32_t n_rows, float* logits, float* scratch) override {
        use();
        const OpSpan span(*this, SpanKind::Logits);
        const int64_t dim = hp.n_embd;
        // Rows in place when they are the batch's last ones in order (the usual case), else gathered.
        const float* in = x + (int64_t)rows[0] * dim;
        for (int32_t r = 1; r < n_rows; r++)
            if (rows[r] != rows[0] + r) {
                for (int32_t i = 0; i < n_rows; i++) copy(scratch + i * dim, x + (int64_t)rows[i] * dim, 4 * dim);
                in = scratch;
                break;
            }
        Input normed_in;
        if (in == scratch) {  // (a normalizing stage cannot write its own rows)
            cuda_rms_norm(stream_, in, (const float*)norm.data, scratch, n_rows, dim, hp.rms_eps);
            normed_in = floats(scratch, scratch, n_rows, dim);
        } else {
            normed_in = normed(in, norm, hp.rms_eps, scratch, scratch, n_rows, dim);
        }
        products(normed_in, {{&output, logits, nullptr, false}});
        if (hp.final_softcap > 0) cuda_softcap(stream_, logits, (int64_t)n_rows * hp.n_vocab, hp.final_softcap);
    }

private:
    void use() {
        cuda_check(cudaSetDevice(device_), "selecting the GPU");
        cuda_set_launch_log(this);  // the launchers called from here on count into this backend
    }

    // CudaLaunchLog: one kernel or copy enqueued. While a step is being recorded the launches are kept
    // with the recording and counted when it is launched (capture_end, replay), since until then none ran.
    void count(CudaKernel k, const CudaTraffic& t) override {
        const int layer = current_trace_layer();
        if (capturing_) {
            capturing_->counted.push_back({layer, k, t});
            return;
        }
        ++host_launches_;
        add_count(layer, k, t);
    }
    void add_count(int layer, CudaKernel k, const CudaTraffic& t) {
        const size_t l = layer < -1 ? 0 : (size_t)(layer + 1);
        if (counts_.size() <= l) counts_.resize(l + 1);
        KindCount& c = counts_[l][(size_t)k];
        c.launches++;
        c.weights += t.weights;
        c.activations += t.activations;
        c.kv += t.kv;
        if (t.kv_per_position)  // attention reads: each token's visible positions (count_pos_: the batch's)
            for (const int32_t p : count_pos_) {
                const int64_t seen = (int64_t)p + 1;
                c.kv += t.kv_per_position * (t.n_swa > 0 && seen > t.n_swa ? t.n_swa : seen);
            }
    }

    // ---- products ------------------------------------------------------------------------------
    // The input a group of products shares: n rows of `cols` floats at x, or (made.make != Copy) values
    // still to be made from other rows by the input stage (`made`, kernels.cuh's CudaInputStage: the
    // RMSNorm of made.x, or act(made.x) * made.up), which makes them in the same kernel that converts them for the first product that
    // needs them, and stores them at x when keep_values (or when a product reads them as floats). Then
    // what has been made of them so far: rounded into buf for a vec_dot type (-1: not yet; buf may be x
    // when nothing reads x afterwards), 8-bit codes in codes_ (the integer path).
    struct Input {
        float* x = nullptr;
        float* buf = nullptr;
        int32_t n = 0;
        int64_t cols = 0;
        CudaInputStage made;  // how the values are made: make, its source rows x, norm/eps or up/act
        bool keep_values = true;
        int32_t rounded = -1;
        int32_t codes = 0;  // the codes buffer holds every row as kCudaCodes or kCudaCodesK (0: neither)
    };
    static Input floats(float* x, float* buf, int32_t n, int64_t cols) {
        Input in;
        in.x = x;
        in.buf = buf;
        in.n = n;
        in.cols = cols;
        return in;
    }
    // The RMSNorm of src's rows by norm, into x (src != x).
    static Input normed(const float* src, const Weight& norm, float eps, float* x, float* buf, int32_t n, int64_t cols) {
        Input in = floats(x, buf, n, cols);
        in.made.make = CudaInputStage::Norm;
        in.made.x = src;
        in.made.norm = (const float*)norm.data;
        in.made.eps = eps;
        return in;
    }

    // The stage for rows [t0, t0 + m) of `in`: its values made (or read), converted as `convert` asks
    // (kCudaCodes: into codes_ from its row 0; a vec_dot type: into buf; -1: only the values, into x).
    void stage(Input& in, int32_t convert, int32_t t0, int32_t m) {
        CudaInputStage& made = in.made;
        if (!fuse_ && made.make != CudaInputStage::Copy && convert != -1) {  // made first, then converted
            stage(in, -1, 0, in.n);
            made.make = CudaInputStage::Copy;
        }
        if (!fuse_ && made.make == CudaInputStage::Norm) {  // (the plain kernel, as before the fusion)
            cuda_rms_norm(stream_, made.x, made.norm, in.x, in.n, in.cols, made.eps);
            made.make = CudaInputStage::Copy;
            return;
        }
        const size_t off = (size_t)t0 * in.cols;
        CudaInputStage st = made;
        st.x = (made.make == CudaInputStage::Copy ? in.x : made.x) + off;
        st.up = made.up ? made.up + off : nullptr;
        const bool store = made.make != CudaInputStage::Copy && (in.keep_values || convert == -1);
        st.values = store ? in.x + off : nullptr;
        st.convert = convert;
        st.rounded = convert >= 0 ? in.buf + off : nullptr;
        st.codes = codes_;
        st.meta = codes_meta_;
        cuda_input_stage(stream_, st, m, in.cols);
        // Made and stored for every row: from now on x holds them (unless the rounding went over them).
        if (store && t0 == 0 && m == in.n) made.make = CudaInputStage::Copy;
    }
    // x holds the values as floats.
    void make_floats(Input& in) {
        if (in.made.make != CudaInputStage::Copy) stage(in, -1, 0, in.n);
    }

    // One product of a group: y (+)= W x (+ bias), over the input's rows, or n of them from row x_row on.
    struct Out {
        const Weight* w;
        float* y;
        const float* bias;
        bool accumulate;
        int32_t x_row = 0;
        int32_t n = -1;
        const int32_t* ids = nullptr;  // experts chosen on the GPU (CudaMatrix::ids)
        size_t id_stride = 0;
        int32_t x_group = 1;
    };
    // The products of `outs` over the shared input, each converted as the CPU converts activations for its
    // weights (the products then differ from the CPU's only in summation order): for Q4_0/Q4_1/Q8_0 rows,
    // to 8-bit codes multiplied as integers (dp4a, as the CPU's own block dot products), else rounded into
    // buf and multiplied in float. Consecutive products of one type and path go out as one launch.
    void products(Input& in, std::initializer_list<Out> outs) { products(in, outs.begin(), (int)outs.size()); }
    void products(Input& in, const Out* o, int count) {
        for (int i = 0; i < count;) {
            const Weight& w0 = *o[i].w;
            const bool ints = ints_for(o[i], in.n);
            int j = i + 1;
            while (fuse_ && j < count && j - i < kCudaMaxMatrices && o[j].w->type == w0.type &&
                   ints_for(o[j], in.n) == ints)
                j++;
            CudaMatrix m[kCudaMaxMatrices];
            for (int k = i; k < j; k++) {
                const Weight& w = *o[k].w;
                if (w.cols != in.cols) throw Error("internal: products of one input with different widths");
                m[k - i].w = w.data;
                m[k - i].rows = w.rows;
                m[k - i].row_bytes = w.row_bytes;
                m[k - i].y = o[k].y;
                m[k - i].bias = fuse_ ? o[k].bias : nullptr;
                m[k - i].accumulate = o[k].accumulate;
                m[k - i].x_row = o[k].x_row;
                m[k - i].n = o[k].n;
                m[k - i].ids = o[k].ids;
                m[k - i].id_stride = o[k].id_stride;
                m[k - i].x_group = o[k].x_group;
            }
            launch_products(in, w0.type, ints, m, j - i);
            // (unfused: one product, its bias a kernel of its own, after any add into the output as before)
            if (!fuse_ && o[i].bias) cuda_add_bias(stream_, o[i].y, o[i].bias, in.n, w0.rows);
            i = j;
        }
    }
    // The exact products (a split share's gate and up) for this type and row length.
    bool exact_for(int32_t type, int64_t cols) const { return exact_ && cuda_matmul_exact_reads(type, cols); }
    bool q8x(const Weight& w) const { return cuda_matmul_q8x_reads(w.type, w.cols, w.row_bytes, w.data); }
    // The integer path for n tokens: the decode kernels' (rows 16-byte aligned) or the tiles' (any row, every
    // row of the input).
    bool ints_for(const Weight& w, int32_t n) const {
        return q8x(w) || (tiles(w.type, n) && w.cols % (cuda_tile_codes(w.type) == kCudaCodesK ? 256 : 32) == 0);
    }
    bool ints_for(const Out& o, int32_t n) const {
        return q8x(*o.w) || (o.n < 0 && !o.ids && (exact_for(o.w->type, o.w->cols) || ints_for(*o.w, n)));
    }

    void launch_products(Input& in, int32_t type, bool ints, CudaMatrix* m, int count) {
        const int32_t n = in.n;
        bool whole = true;  // every matrix over all rows of the input (not a mixture's slots or parts): tiles may run
        for (int k = 0; k < count; k++) whole = whole && m[k].n < 0 && !m[k].ids && m[k].x_row == 0;
        if (ints) {
            const bool exact = exact_for(type, in.cols);
            const bool tiled = whole && tiles(type, n) && !exact;
            const int32_t kind = tiled ? cuda_tile_codes(type) : exact ? cuda_matmul_exact_codes(type) : kCudaCodes;
            const int32_t slice_rows = tiled ? kTileCodeTokens : kCodeTokens;
            ensure_codes(in.cols, n < slice_rows ? n : slice_rows);
            auto launch = [&](const CudaMatrix* ms, int32_t rows) {
                if (tiled) cuda_matmul_q8x_tiles(stream_, type, ms, count, in.cols, codes_, codes_meta_, rows);
                else if (exact) cuda_matmul_exact_many(stream_, type, ms, count, in.cols, codes_, codes_meta_, rows);
                else cuda_matmul_q8x_many(stream_, type, ms, count, in.cols, codes_, codes_meta_, rows);
            };
            if (n <= slice_rows) {  // the codes of every token fit: converted once for the group
                if (in.codes != kind) stage(in, kind, 0, n);
                in.codes = kind;
                launch(m, n);
                return;
            }
            if (!whole) throw Error("internal: products over parts of the input take 8-bit codes of at most 16 rows");
            CudaMatrix slice[kCudaMaxMatrices];
            for (int32_t t0 = 0; t0 < n; t0 += slice_rows) {  // a long prompt: slice_rows rows at a time
                const int32_t rows = n - t0 < slice_rows ? n - t0 : slice_rows;
                stage(in, kind, t0, rows);
                for (int k = 0; k < count; k++) {
                    slice[k] = m[k];
                    slice[k].y = m[k].y + (size_t)t0 * m[k].rows;
                }
                launch(slice, rows);
            }
            return;
        }
        const int32_t t = type_traits(type).vec_dot_type;
        const float* x = in.x;
        if (t == TYPE_F32) {
            make_floats(in);
        } else {
            if (in.rounded != t) {
                stage(in, t, 0, n);
                in.rounded = t;
                if (in.buf == in.x) in.made.make = CudaInputStage::Copy;  // (x holds the rounded values now)
            }
            x = in.buf;
        }
        if (whole && mma_ && n >= kTileMinTokens && cuda_matmul_tiles_f_reads(type) && in.cols % 2 == 0)
            cuda_matmul_f_tiles(stream_, type, m, count, in.cols, x, n);
        else
            cuda_matmul_many(stream_, type, m, count, in.cols, x, n);
    }

    // The 8-bit codes of up to codes_rows_ rows of `cols` values (a longer batch is converted a slice at a
    // time): kCodeTokens rows for the decode kernels, up to kTileCodeTokens for the tiled products of a
    // prompt. Grown on first use (a plain step always runs before a step of its shape is recorded, so
    // growing never happens while recording); the old buffers are released once the stream is done.
    static constexpr int32_t kCodeTokens = 16;
    // From here on, products of the tiles' types as tiles. At 16 tokens the decode kernels read the weights
    // twice and a 4096-row matrix is only 64 tiles (half the multiprocessors of an H100): from 32, where they
    // read them four times. Unmeasured on a GPU yet (gpu_kernels.py prints both at any token count).
    static constexpr int32_t kTileMinTokens = 32;
    static constexpr int32_t kTileCodeTokens = 512;  // the most rows one conversion makes for them
    bool tiles(int32_t type, int32_t n) const { return mma_ && n >= kTileMinTokens && cuda_matmul_tiles_reads(type); }
    // The rows of codes a product of n tokens converts at once.
    int32_t code_rows(int32_t type, int32_t n) const { return tiles(type, n) ? kTileCodeTokens : kCodeTokens; }
    void ensure_codes(int64_t cols, int32_t rows = kCodeTokens) {
        if (rows < kCodeTokens) rows = kCodeTokens;
        if (cols <= codes_cols_ && rows <= codes_rows_) return;
        if (codes_) {  // (queued products may still read the old codes; nothing points at them after)
            synchronize();
            release(codes_);
            release(codes_meta_);
            codes_ = nullptr;
            codes_meta_ = nullptr;
        }
        const int64_t new_cols = std::max({codes_cols_, cols, (int64_t)16384});  // n_embd and n_ff of most models
        const int32_t new_rows = std::max(codes_rows_, (rows + 63) / 64 * 64);
        codes_cols_ = codes_rows_ = 0;  // (until both allocations have succeeded)
        int8_t* codes = (int8_t*)alloc((size_t)new_rows * new_cols, "scratch");
        try {
            codes_meta_ = (CudaQ8Meta*)alloc(sizeof(CudaQ8Meta) * new_rows * (size_t)(new_cols / 32), "scratch");
        } catch (...) {
            release(codes);
            throw;
        }
        codes_ = codes;
        codes_cols_ = new_cols;
        codes_rows_ = new_rows;
    }

    // Gate and up of the FFN over `in` (one launch where their types agree, biases in the epilogue), and
    // the input of down: act(gate) * up, made by down's input stage.
    Input gate_up(const HParams& hp, const FFNWeights& w, Input& in, const StepScratch& s) {
        const int64_t width = w.gate.rows;
        products(in, {{&w.gate, s.gate, (const float*)w.gate_b.data, false},
                      {&w.up, s.up, (const float*)w.up_b.data, false}});
        return act_input(hp, w.gate.type, s.gate, s.up, in.n, width);
    }
    // down's input: act(gate) * up of n rows of `width`, made by down's input stage.
    static Input act_input(const HParams& hp, int32_t gate_type, float* gate, float* up, int32_t n, int64_t width) {
        // GELU as the CPU's ffn_activate picks it: the f16 table unless the gate's input stays float.
        const int32_t gate_x = type_traits(gate_type).vec_dot_type;
        const bool gelu_f16 = gate_x != TYPE_F32 && gate_x != TYPE_F16 && gate_x != TYPE_BF16;
        Input h = floats(gate, gate, n, width);  // (rounded in place: nothing reads the gate after down)
        h.made.make = CudaInputStage::ActMul;
        h.made.x = gate;
        h.made.up = up;
        h.made.act = cuda_act_code(hp.ffn_act, gelu_f16);
        h.keep_values = false;
        return h;
    }

    // The attention block's three parts (see Backend::attention_qkv): the norm made with the products'
    // input, q, k and v in one launch where their types agree, their biases in its epilogue.
    void qkv(const HParams& hp, const LayerWeights& L, const float* x, int32_t n, const StepScratch& s) {
        // s.xn gets the norm, s.y its rounding (the FFN's y is free until the FFN)
        Input in = normed(x, L.attn_norm, hp.rms_eps, s.xn, s.y, n, hp.n_embd);
        products(in, {{&L.wq, s.q, (const float*)L.bq.data, false},
                      {&L.wk, s.k, (const float*)L.bk.data, false},
                      {&L.wv, s.v, (const float*)L.bv.data, false}});
    }

    // RoPE, the cache write and the attention. With `next` (the output projection's weights), the
    // attention kernel leaves its output as that product reads it where it can (codes, or Q8_0/Q8_1
    // rounding, heads of whole 32-value blocks): the Input says what it made.
    Input core(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs, const KVLayerView& kv,
               const BatchView& b, const StepScratch& s, const Weight* next) {
        const int32_t n = b.n;
        const int32_t* seq = batch_on_device(b);
        const int32_t* pos = seq + n;
        count_pos_.assign(b.pos, b.pos + n);
        const bool swa = hp.is_swa(layer);
        CudaAttnArgs a{};
        a.n_head = hp.n_head;
        a.n_head_kv = hp.n_head_kv;
        a.head_dim = hp.head_dim;
        a.n_rot = hp.rot(layer);  // (0 on a layer without RoPE)
        a.neox = hp.rope_type == ROPE_NEOX;
        a.rope_base = hp.rope_base(layer);
        a.rope_scale = hp.rope_scale(layer);
        a.q_scale = hp.attn_q_scale;
        a.kq_scale = hp.attn_kq_scale;
        a.softcap = hp.attn_softcap;
        a.rms_eps = hp.rms_eps;
        const RopeYarnRange yarn = hp.rope_yarn(layer);
        a.yarn_ext = yarn.ext_factor;
        a.yarn_low = yarn.low;
        a.yarn_high = yarn.high;
        a.rope_mscale = yarn.mscale;
        a.n_swa = swa ? hp.n_swa : 0;
        a.sinks = L.attn_sinks.present() ? (const float*)L.attn_sinks.data : nullptr;
        a.freq_factors = rope_freqs.present() ? (const float*)rope_freqs.data : nullptr;
        a.q_norm = L.q_norm.present() ? (const float*)L.q_norm.data : nullptr;
        a.k_norm = L.k_norm.present() ? (const float*)L.k_norm.data : nullptr;
        a.k_type = kv.type;
        a.v_type = kv.v_type;
        a.n_ctx = kv.n_ctx;
        // The CPU's rotation of a quantized side: the same bytes in the cache on either device.
        a.rot_k = (int32_t)kv_rotation_block(kv.type, hp.head_dim, false);
        a.rot_v = (int32_t)kv_rotation_block(kv.v_type, hp.head_dim, true);
        a.k_cache = kv.k;
        a.v_cache = kv.v;
        a.k_row = kv.k_row;
        a.k_seq = kv.k_seq;
        a.v_row = kv.v_row;
        a.v_seq = kv.v_seq;
        cuda_attn_prepare(stream_, a, s.q, s.k, s.v, seq, pos, n);
        Input out = floats(s.attn, s.attn, n, hp.n_embd_q());  // (rounded in place: nothing reads it after)
        int32_t convert = -1;
        if (next && hp.head_dim % 32 == 0) {
            // (the K-quants' tiles read Q8_K's codes, which the attention kernel does not write)
            const bool k_codes = tiles(next->type, n) && cuda_tile_codes(next->type) == kCudaCodesK;
            if (ints_for(*next, n) && !k_codes && n <= code_rows(next->type, n)) {
                ensure_codes(next->cols, n);
                convert = kCudaCodes;
                out.codes = kCudaCodes;
            } else if (!ints_for(*next, n)) {
                const int32_t t = type_traits(next->type).vec_dot_type;
                if (t == TYPE_Q8_0 || t == TYPE_Q8_1) {
                    convert = t;
                    out.rounded = t;
                }
            }
        }
        const int32_t splits = attn_splits(n, hp.n_head, a.n_ctx);
        float* part = splits > 1 ? attn_partials(cuda_attn_partial_floats(n, hp.n_head, hp.head_dim, splits)) : nullptr;
        cuda_attn_scores(stream_, a, s.q, seq, pos, n, s.attn, convert, codes_, codes_meta_, splits, part);
        return out;
    }

    // The attention split over the positions (flash-decoding) when a step's tokens and heads are too few
    // blocks for the GPU and the cache is long: about two blocks per multiprocessor, at most one split per
    // kSplitPositions positions of the cache. Fixed by the step's shape (a recorded step keeps it), whatever
    // the positions; OPTIML_CUDA_ATTN_SPLITS=N forces N (tests, comparisons).
    static constexpr int32_t kSplitPositions = 512;
    int32_t attn_splits(int32_t n, int32_t n_head, int32_t n_ctx) const {
        if (attn_splits_forced_ > 0) return std::min(attn_splits_forced_, kCudaMaxAttnSplits);
        const int64_t blocks = (int64_t)n * n_head;
        if (blocks >= sm_count_ || n_ctx < 2 * kSplitPositions) return 1;
        const int64_t fill = (2 * sm_count_ + blocks - 1) / blocks;
        return (int32_t)std::max<int64_t>(1, std::min<int64_t>({fill, n_ctx / kSplitPositions, kCudaMaxAttnSplits}));
    }
    // The split attention's partial sums: grown on first use, as the codes.
    float* attn_partials(int64_t floats) {
        if (floats > attn_part_floats_) {
            if (attn_part_) {
                synchronize();
                release(attn_part_);
                attn_part_ = nullptr;
                attn_part_floats_ = 0;
            }
            attn_part_ = (float*)alloc(sizeof(float) * (size_t)floats, "scratch");
            attn_part_floats_ = floats;
        }
        return attn_part_;
    }

    // x += rms_norm(y) * w: one kernel, or (unfused) y normalized in place, then added.
    void norm_add(float* y, const Weight& w, float* x, int32_t n, const HParams& hp) {
        if (fuse_) return cuda_rms_norm_add(stream_, y, (const float*)w.data, x, n, hp.n_embd, hp.rms_eps);
        cuda_rms_norm(stream_, y, (const float*)w.data, y, n, hp.n_embd, hp.rms_eps);
        cuda_add(stream_, x, y, nullptr, (int64_t)n * hp.n_embd);
    }

    // Output projection into the residual stream, added by the product's epilogue with its bias (Gemma 3
    // normalizes it first: into xn, then normalized and added in one kernel).
    void out(const HParams& hp, const LayerWeights& L, float* x, const StepScratch& s, Input& attn) {
        const float* bo = (const float*)L.bo.data;
        if (!L.attn_post_norm.present()) {
            products(attn, {{&L.wo, x, bo, true}});
            return;
        }
        products(attn, {{&L.wo, s.xn, bo, false}});
        norm_add(s.xn, L.attn_post_norm, x, attn.n, hp);
    }

    // The batch's seq and pos on the device. The offload pass (forward_offload.cpp) alternates two
    // sub-batches at every layer: one cached copy each, so neither goes up again per layer (a copy from
    // pageable memory first waits for the stream, which would undo the overlap that pass is for).
    const int32_t* batch_on_device(const BatchView& b) {
        if (capturing_) return step_batch_;  // a recorded step reads what upload_batch wrote
        const size_t count = 2 * (size_t)b.n, half = sizeof(int32_t) * b.n;
        for (BatchOnDevice& c : batch_cache_)
            if (c.dev && c.host.size() == count && std::memcmp(c.host.data(), b.seq, half) == 0 &&
                std::memcmp(c.host.data() + b.n, b.pos, half) == 0) {
                c.used = ++batch_clock_;
                return c.dev;
            }
        BatchOnDevice& c = batch_cache_[0].used <= batch_cache_[1].used ? batch_cache_[0] : batch_cache_[1];
        if (count > c.capacity) {
            // Grows to the largest batch once; counted as scratch like the rest of the step's memory.
            c.capacity = count < 1024 ? 1024 : count;
            c.dev = (int32_t*)alloc(sizeof(int32_t) * c.capacity, "scratch");
        }
        c.host.resize(count);
        std::memcpy(c.host.data(), b.seq, half);
        std::memcpy(c.host.data() + b.n, b.pos, half);
        copy_from_host(c.dev, c.host.data(), sizeof(int32_t) * count);
        c.used = ++batch_clock_;
        return c.dev;
    }

    // ---- timeline: a pair of timing events around each op while tracing ---------------------------
    struct TimedOp {
        int layer;
        SpanKind kind;
        cudaEvent_t start, end;
    };
    // An event recorded now on the stream, or nullptr when CUDA refuses (the op's span is then left out:
    // timing must never fail the op it times).
    cudaEvent_t timing_event() noexcept {
        cudaEvent_t e = nullptr;
        if (cudaEventCreate(&e) != cudaSuccess) {
            cudaGetLastError();
            return nullptr;
        }
        if (cudaEventRecord(e, stream_) != cudaSuccess) {
            cudaGetLastError();
            cudaEventDestroy(e);
            return nullptr;
        }
        return e;
    }
    struct OpSpan {
        CudaBackend& be;
        int layer = -1;
        SpanKind kind;
        cudaEvent_t start = nullptr;
        OpSpan(CudaBackend& b, SpanKind k) : be(b), kind(k) {
            if (be.tracing()) {
                layer = be.current_trace_layer();
                start = be.timing_event();
            }
        }
        ~OpSpan() {
            if (!start) return;
            cudaEvent_t end = be.timing_event();
            try {
                if (end) {
                    be.timed_.push_back({layer, kind, start, end});
                    return;
                }
            } catch (...) {  // out of memory for the span: it is left out
                cudaEventDestroy(end);
            }
            cudaEventDestroy(start);
        }
    };
    void drop_timed() {
        for (const TimedOp& op : timed_) {
            cudaEventDestroy(op.start);
            cudaEventDestroy(op.end);
        }
        timed_.clear();
    }
    // The stream is empty: an event recorded now completes at once, at (about) this host time.
    void begin_spans() override {
        use();
        drop_timed();  // a trace started again without being stopped
        if (!trace_base_) cuda_check(cudaEventCreate(&trace_base_), "creating a timing event");
        cuda_check(cudaEventRecord(trace_base_, stream_), "recording a timing event");
        cuda_check(cudaEventSynchronize(trace_base_), "waiting for the GPU");
        trace_base_host_ = trace_clock();
    }
    // Start times from the base; durations from each op's own pair (float milliseconds lose microseconds
    // over a long trace when both ends are taken from the base).
    void collect_spans() override {
        use();
        std::vector<TimedOp> ops;
        ops.swap(timed_);
        std::exception_ptr err;
        for (const TimedOp& op : ops) {
            float at = 0, dur = 0;
            if (!err) {
                const cudaError_t e1 = cudaEventElapsedTime(&at, trace_base_, op.start);
                const cudaError_t e2 = cudaEventElapsedTime(&dur, op.start, op.end);
                if (e1 == cudaSuccess && e2 == cudaSuccess) {
                    const double t0 = trace_base_host_ + at * 1e-3;
                    add_span(op.layer, op.kind, t0, t0 + dur * 1e-3);
                } else {
                    cudaGetLastError();
                    err = std::make_exception_ptr(Error(format("%s: timing an op: %s", name_.c_str(),
                                                               cudaGetErrorString(e1 != cudaSuccess ? e1 : e2))));
                }
            }
            cudaEventDestroy(op.start);
            cudaEventDestroy(op.end);
        }
        if (err) std::rethrow_exception(err);
    }

    // Expert e of a 3-D expert tensor as a matrix.
    static Weight expert(const ExpertWeights& x, int32_t e) {
        Weight w;
        w.name = x.name;
        w.type = x.type;
        w.rows = x.rows;
        w.cols = x.cols;
        w.row_bytes = x.row_bytes;
        w.data = x.data + (size_t)e * x.expert_bytes;
        return w;
    }
    // A buffer of the experts' steps of at least `floats` 4-byte values, grown as steps need (device
    // scratch allocated at first use, as the activations' codes, outside the plan's count).
    struct MoEBuffer {
        float* p = nullptr;
        size_t floats = 0;
    };
    float* moe_buffer(MoEBuffer& b, size_t floats) {
        if (floats <= b.floats) return b.p;
        if (b.p) {
            synchronize();  // queued ops may still read the old one
            release(b.p);
        }
        b.floats = floats + floats / 4;
        b.p = (float*)alloc(b.floats * sizeof(float), "scratch");
        return b.p;
    }

    void* device_alloc(size_t bytes) override {
        use();
        void* p = nullptr;
        const cudaError_t err = cudaMalloc(&p, bytes);
        if (err != cudaSuccess) {
            cudaGetLastError();
            throw Error(format("%s: out of GPU memory allocating %zu bytes (%s); lower vram or n_gpu_layers",
                               name_.c_str(), bytes, cudaGetErrorString(err)));
        }
        // On this backend's stream: cudaMemset runs on the legacy default stream, which a non-blocking
        // stream does not wait for, so it could land after the copies that fill the memory (seen on an
        // H200: a lazily allocated buffer of positions zeroed after they were uploaded).
        cuda_check(cudaMemsetAsync(p, 0, bytes, stream_), "clearing GPU memory");
        ++alloc_epoch_;  // recorded steps may point at memory that moved
        return p;
    }
    void device_free(void* p, size_t) override {
        ++alloc_epoch_;
        cudaFree(p);
    }
    // Room for one more shape: the one launched least recently goes (a server's steps of many sizes over
    // a split model's units would otherwise drop every recording each time the map fills).
    void drop_least_used() {
        auto oldest = recordings_.begin();
        for (auto it = recordings_.begin(); it != recordings_.end(); ++it)
            if (it->second.used < oldest->second.used) oldest = it;
        if (oldest == recordings_.end()) return;
        if (oldest->second.exec) cudaGraphExecDestroy(oldest->second.exec);
        recordings_.erase(oldest);
    }

    int device_;
    cudaStream_t stream_ = nullptr;
    std::vector<cudaEvent_t> events_;
    uint64_t recorded_ = 0;
    struct BatchOnDevice {
        int32_t* dev = nullptr;
        size_t capacity = 0;
        std::vector<int32_t> host;  // what dev holds: seq then pos
        uint64_t used = 0;          // batch_clock_ at the last use (the older entry is replaced)
    };
    BatchOnDevice batch_cache_[2];
    uint64_t batch_clock_ = 0;
    // Recorded steps by key (Backend::replay); epoch: alloc_epoch_ when recorded.
    struct Counted {
        int layer;
        CudaKernel kind;
        CudaTraffic traffic;
    };
    struct Recording {
        cudaGraphExec_t exec = nullptr;
        uint64_t epoch = 0;
        int seen = 0;
        bool failed = false;
        uint64_t used = 0;             // record_clock_ when last seen or launched
        std::vector<Counted> counted;  // what the recorded step launches (counted again each launch)
    };
    // Shapes kept: decode steps of 1..16 tokens and a few logits rows, or a split model's units per layer
    // and step size (Session::device_segment: up to four a layer, each a few nodes).
    static constexpr size_t kMaxRecorded = 4096;
    std::map<std::vector<int32_t>, Recording> recordings_;
    Recording* capturing_ = nullptr;
    uint64_t record_clock_ = 0;
    uint64_t alloc_epoch_ = 0;
    int64_t launches_ = 0;
    // Launch counts: [layer + 1][kind], the calls that enqueued work, and the positions of the batch whose
    // attention is being enqueued or replayed (the cache bytes it reads).
    struct KindCount {
        int64_t launches = 0, weights = 0, activations = 0, kv = 0;
    };
    std::vector<std::array<KindCount, (size_t)CudaKernel::kCount>> counts_;
    int64_t host_launches_ = 0;
    std::vector<int32_t> count_pos_;
    bool graphs_ = true;  // OPTIML_CUDA_GRAPHS=0 turns recording off
    // OPTIML_CUDA_FUSE=0: every op as its own kernels, as before issue #43's fusions (the same bits, more
    // launches: for comparisons of the two, in the tests and on a GPU).
    bool fuse_ = true;
    // Products in the CPU's order (cuda_matmul_exact_many) while a split share's gate and up are computed.
    bool exact_ = false;
    // OPTIML_CUDA_TILES=0: prompts' integer products with the decode kernels (as before the tiles).
    bool mma_ = true;  // the tiled products run here (compute capability 8.0 and later)
    int8_t* codes_ = nullptr;  // the products' 8-bit activations: [codes_rows_][codes_cols_]
    CudaQ8Meta* codes_meta_ = nullptr;
    int64_t codes_cols_ = 0;
    int32_t codes_rows_ = 0;
    int sm_count_ = 1;
    int32_t attn_splits_forced_ = 0;  // OPTIML_CUDA_ATTN_SPLITS
    float* attn_part_ = nullptr;
    int64_t attn_part_floats_ = 0;
    int32_t* step_batch_ = nullptr;  // upload_batch's seq and pos
    size_t step_batch_capacity_ = 0;
    std::vector<int32_t> step_batch_host_;
    std::vector<std::pair<void*, size_t>> pinned_;  // host ranges page-locked by pin_host
    MoEBuffer moe_idx_, moe_xg_, moe_round_, moe_gate_, moe_up_, moe_logits_, moe_d_, moe_sy_, moe_weight_;
    struct MoEHost {  // a whole mixture of experts' routing, on the host
        std::vector<float> logits, weight;
        std::vector<int32_t> chosen, slot, count, first, token;
    };
    MoEHost moe_host_;
    std::vector<TimedOp> timed_;
    cudaEvent_t trace_base_ = nullptr;
    double trace_base_host_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int index) {
    std::string why;
    const std::vector<CudaDevice> devices = cuda_devices(&why);
    if (index < 0 || index >= (int)devices.size())
        throw ArgumentError(devices.empty() ? format("cuda:%d: %s", index, why.c_str())
                                            : format("cuda:%d: this machine has %zu CUDA device(s)", index,
                                                     devices.size()));
    return std::make_unique<CudaBackend>(index);
}

}  // namespace optiml
