// The device layer: what the forward pass asks of a device, and nothing else. Model code
// (native/src/model/forward.cpp, ffn.cpp) calls only this interface; the CPU backend
// (native/src/cpu/backend/backend_cpu.cpp) wraps the kernels and the thread pool, and a CUDA backend plugs in by
// implementing the same virtual functions (no CUDA header is included above this line).
//
// Semantics are those of a device stream (as in ggml-backend and CUDA): every op and copy is enqueued in
// order on the backend's stream and may still be running when the call returns; record() marks a point
// in the stream, wait() makes this stream wait for a point of another's, synchronize() blocks the host.
// The host backend ("cpu") runs each op on the calling thread before returning. A second CPU instance
// ("cpu:1") runs its ops on its own worker thread, so the split paths (a layer's FFN on two devices at
// once, partial outputs merged where the residual lives) run and are tested on machines with no GPU.
//
// Pointers handed to ops are device pointers of that backend (from alloc(), or weights it holds);
// a host backend's device pointers are ordinary host pointers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "optiml/kernels.h"
#include "optiml/matmul.h"
#include "optiml/sparse.h"

namespace optiml {

// A step's (token, expert) pairs grouped by expert, in host memory: rows first[e] .. first[e] + count[e] - 1
// go through expert e of the weights they meet (n_expert of them), row r taking token token[r]. An op
// reading them runs before the arrays change (the caller waits for the backend first).
struct MoEGroups {
    int32_t n_tok = 0;  // tokens of the step (rows of the input)
    const int32_t* token = nullptr;
    int64_t n_rows = 0;
    const int32_t* first = nullptr;
    const int32_t* count = nullptr;
    int32_t n_expert = 0;
};

struct HParams;
struct Weight;
struct FFNWeights;
struct MoEWeights;
struct LayerWeights;
class ThreadPool;
class ActivationRecorder;
struct LayerPredictor;

// A 2-D view of a backend's memory: `rows` rows of `cols` elements of `type`, row_stride bytes apart.
struct TensorView {
    int32_t type = TYPE_F32;
    int64_t cols = 0, rows = 0;
    size_t row_stride = 0;
    void* data = nullptr;
    class Backend* backend = nullptr;
};

// A point in a backend's stream.
struct Event {
    class Backend* backend = nullptr;
    uint64_t seq = 0;
};

// The tokens of one forward step as the attention sees them: token t belongs to sequence seq[t] at
// position pos[t]; it attends to positions [first, pos[t]] of its sequence (first > 0 in a sliding window).
struct BatchView {
    int32_t n = 0;
    const int32_t* seq = nullptr;  // host memory, valid for the step
    const int32_t* pos = nullptr;
};

// One layer's KV cache on the backend that computes the layer's attention. Keys: [seq][pos][n_embd_kv];
// values transposed: [seq][n_embd_kv][pos] (the weighted sum of values is then one dot product per output
// element, as in llama.cpp).
// Quantized values (Q8_0, Q4_0) cannot be stored transposed (a block spans 32 positions, and tokens come
// one at a time), so they are rows like the keys: [seq][pos][n_embd_kv] quantized along the dimensions,
// v_row bytes apart, and the weighted sum adds dequantized rows (as llama.cpp's flash attention does).
struct KVLayerView {
    int32_t type = TYPE_F16;  // the keys': F16, F32, Q8_0 or Q4_0
    int32_t v_type = TYPE_F16;  // the values': F16, F32 (transposed), Q8_0 or Q4_0 (rows)
    size_t v_row = 0;           // quantized values: bytes of one row (n_embd_kv values); 0 when transposed
    int32_t n_ctx = 0;        // positions per sequence
    uint8_t* k = nullptr;
    uint8_t* v = nullptr;
    size_t k_row = 0;   // bytes of one key row (n_embd_kv values)
    size_t k_seq = 0;   // bytes of one sequence's keys (n_ctx rows)
    size_t v_seq = 0;   // bytes of one sequence's values
};

// What one device computes of a layer's FFN: y = down(act(gate(xn)) * up(xn)) over its neurons.
//   rows == nullptr: every neuron of `w` (a whole FFN, or a share packed on its own device);
//   rows != nullptr: only neurons rows[0..n_rows) of `w`, the others contributing nothing (the host's
//   share of a split layer, read in place from the mapped file).
// For the sparse FFN: down_nm holds neuron-major down rows of the share's neurons, nm_slot[j] the row of
// neuron j (nullptr: row j).
//   stored != nullptr (with a predictor only): w's gate/up rows and biases are a copy in a placed order,
// row j being file neuron stored[j] (co-active neurons side by side: a step reads runs of rows), and
// down_nm follows that order; w.down, the predictor and neuron_scale keep the file's order.
struct FFNShare {
    const FFNWeights* w = nullptr;
    const int32_t* rows = nullptr;
    int64_t n_rows = 0;
    const NeuronMajor* down_nm = nullptr;
    const int32_t* nm_slot = nullptr;
    const int32_t* stored = nullptr;
};

// How a share skips neurons: dense, or |act(gate)| (weighted by neuron_scale) / |act(gate) * up| above a
// threshold.
struct FFNSparsity {
    bool enabled = false;
    bool on_product = false;
    float threshold = 0.0f;
    const float* neuron_scale = nullptr;  // [n_ff] or nullptr
    // With a predictor, only the neurons it predicts active (the union over the batch's tokens) have
    // their gate and up computed; the criterion above then applies to those.
    const LayerPredictor* predictor = nullptr;
    // Decide by groups of `group` consecutive neurons of the share (in the placed order when it has one):
    // a group is computed whole when any of its neurons is predicted active. Fewer, longer runs of rows
    // where co-active neurons sit together (`optiml solve --order coactive`); 1: neuron by neuron.
    int32_t group = 1;
};

// Scratch of one backend for a step of up to n_batch tokens (device memory of that backend).
struct StepScratch {
    float *x = nullptr, *xn = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *attn = nullptr;
    float *gate = nullptr, *up = nullptr, *y = nullptr, *y2 = nullptr;
};

// One span of a backend's timeline (`optiml bench --timeline`): what ran on the backend's stream, for
// which layer (-1: outside the layers), from t0 to t1 in seconds of the host's steady clock. Wait is a
// stream (or, for the host, its thread) standing still until another backend reaches an event.
enum class SpanKind : uint8_t { Embed, Norm, Attention, FFN, Join, Logits, CopyIn, CopyOut, Copy, Wait };
struct Span {
    int32_t layer;
    SpanKind kind;
    double t0, t1;
};
const char* span_kind_name(SpanKind k);
double trace_clock();  // seconds, the clock spans are in

// Launches of one kind of kernel (or copy) in one layer (-1: outside the layers) and the bytes they had
// to move at least (Backend::launch_counts; the CUDA backend's model of them: native/src/cuda/kernels.cuh).
struct LaunchCount {
    int32_t layer;
    std::string kind;
    bool copy;  // a copy (host to device, back, or within the device), not a kernel
    int64_t launches = 0, weight_bytes = 0, activation_bytes = 0, kv_bytes = 0;
};

class Backend {
public:
    explicit Backend(std::string name) : name_(std::move(name)) {}
    virtual ~Backend() = default;
    Backend(const Backend&) = delete;
    Backend& operator=(const Backend&) = delete;

    const std::string& name() const { return name_; }
    // True when device pointers are host pointers (the CPU backends).
    virtual bool host_memory() const = 0;
    // True when ops run on the calling thread before returning (then record/wait are trivial).
    virtual bool synchronous() const = 0;

    // ---- memory: every byte counted --------------------------------------------------------------
    // Zeroed device memory for `bytes`, freed with the backend. `what` names the use in the accounting.
    void* alloc(size_t bytes, const char* what);
    // Frees one block of alloc() now (a buffer that grows); the caller knows no queued op reads it.
    void release(void* p);
    size_t allocated_bytes() const { return allocated_; }
    // Bytes allocated per use ("weights", "kv", "scratch", ...).
    std::vector<std::pair<std::string, size_t>> allocation_summary() const;

    // ---- stream ----------------------------------------------------------------------------------
    virtual Event record() = 0;
    // This backend's stream waits until `e` (of any backend) has completed.
    virtual void wait(const Event& e) = 0;
    // The calling thread waits until `e`, an event of this backend, has completed.
    virtual void host_wait(const Event& e) = 0;
    // The host waits until this backend's stream is empty.
    virtual void synchronize() = 0;
    // Host <-> device and device <-> device copies, in stream order. The host side must stay valid
    // until the copy has run (record() and wait on it).
    virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
    virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;
    virtual void copy(void* dst, const void* src, size_t bytes) = 0;
    // Page-locks host memory that this device copies to and from every step (the host's scratch, the KV
    // cache of offloaded sequences), so those copies run asynchronously and at full bus speed: a CUDA
    // copy into pageable memory blocks the calling thread, which would serialize the host's work behind
    // the device's. Best effort (nothing on a CPU device; a failure leaves the memory pageable); undone
    // when the backend goes, which must be before the memory is freed.
    virtual void pin_host(void* p, size_t bytes) { (void)p, (void)bytes; }
    // Whether [p, p + bytes) lies in memory pin_host page-locked: copies there neither block the caller
    // nor keep a recording from holding them.
    virtual bool pinned(const void* p, size_t bytes) const { (void)p, (void)bytes; return false; }

    // ---- steps recorded once and launched again as one unit -------------------------------------
    // A decode step enqueues hundreds of small ops; on a GPU the host's cost of launching each one sets
    // its speed. A device that can record a step (CUDA graphs) launches it again in one call:
    //   upload_batch(b)  each such step: b's sequence slots and positions to where the recorded
    //                    attention reads them;
    //   replay(key)      true when the ops recorded under `key` were launched (the caller skips them);
    //   capture_begin(key) / capture_end(ok)  otherwise, around the caller enqueuing them; capture_end
    //                    launches what was recorded and returns true, or false when the ops did not run
    //                    (recording failed, or ok was false after an exception): the caller runs them plain.
    // Whole steps are recorded (Session::forward_recorded), and so are the units of a step split between
    // the devices: a layer's device work between two points where the host meets it, its copies to and
    // from pinned() host memory included (Session::device_segment; keys {-1 - layer, ...}).
    // The key names everything the ops depend on besides memory contents (token count, rows of logits);
    // a recording is dropped when the backend's memory is allocated or freed again. Devices without the
    // feature keep the defaults: replay() false, capture_begin() false (the ops run as usual), and so does
    // a CUDA device when OPTIML_CUDA_GRAPHS=0 (comparisons, or a driver whose graphs misbehave).
    virtual void upload_batch(const BatchView& b) { (void)b; }
    virtual bool replay(const std::vector<int32_t>& key) { (void)key; return false; }
    virtual bool capture_begin(const std::vector<int32_t>& key) { (void)key; return false; }
    virtual bool capture_end(bool ok) { (void)ok; return true; }
    // Steps launched from a recording so far (replay() true, or capture_end() launching what it recorded).
    virtual int64_t recorded_launches() const { return 0; }

    // ---- the ops of the forward pass ---------------------------------------------------------------
    // x[t] = row tokens[t] of the embedding table (dequantized) times scale. tokens: host memory.
    virtual void embed(const Weight& table, const int32_t* tokens, int32_t n, float scale, float* x) = 0;
    // out[t] = rms_norm(x[t]) * w.
    virtual void rms_norm(const float* x, const Weight& w, float* out, int32_t n, int64_t dim, float eps) = 0;
    // The attention block of a layer for the batch, added into the residual x ([n][n_embd]): norm, q/k/v
    // projections and biases, per-head q/k norms, RoPE, the new keys and values into the cache,
    // causal (and sliding-window) attention over each token's sequence, output projection.
    virtual void attention(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                           const KVLayerView& kv, const BatchView& b, float* x, const StepScratch& s) = 0;
    // The same block in three parts, for a batch whose attention is split between devices (CPU attention
    // offload, forward_offload.cpp): attention_qkv writes the norm of x and the q/k/v projections (with
    // biases) of n tokens to s.q, s.k, s.v; attention_core applies the per-head norms and RoPE, writes
    // the new keys and values into kv and the attention of each token into s.attn; attention_out adds
    // the output projection of s.attn into x. attention() is the three in order, with the same bits.
    virtual void attention_qkv(const HParams& hp, const LayerWeights& L, const float* x, int32_t n,
                               const StepScratch& s) = 0;
    virtual void attention_core(const HParams& hp, int layer, const LayerWeights& L, const Weight& rope_freqs,
                                const KVLayerView& kv, const BatchView& b, const StepScratch& s) = 0;
    virtual void attention_out(const HParams& hp, const LayerWeights& L, int32_t n, float* x, const StepScratch& s) = 0;
    // y[t] = the share's part of the FFN for xn[t] (no bias of down, no post-norm): see FFNShare.
    // The (token, neuron) activations computed are added to *active (host memory) when the op has run.
    // recorder: profile the FFN (dense, whole layers on a host backend only).
    virtual void ffn(const HParams& hp, int layer, const FFNShare& share, const FFNSparsity& sp, const float* xn,
                     int32_t n, float* y, const StepScratch& s, int64_t* active, ActivationRecorder* recorder) = 0;
    // A split layer's dense FFN computed as one device computes it whole (forward.cpp, ffn_layer), so that
    // a split gives the unsplit run's bits: ffn_gate_up writes the share's gate and up products with their
    // biases, [n][share.w->gate.rows] each (a share with rows: those neurons only, the others zero); then
    // ffn_finish, on the host backend, puts the other share's products (gate2, up2: [n][k2], of file
    // neurons rows2; host memory) beside its own in s.gate and s.up, and computes act(gate) * up and the
    // whole down product into y. Adding two partial down products instead would reassociate each sum, and
    // with 8-bit activations a last-bit difference grows into another draw of the quantization noise
    // (docs/results/split-fidelity.md).
    virtual void ffn_gate_up(const HParams& hp, int layer, const FFNShare& share, const float* xn, int32_t n,
                             float* gate, float* up, const StepScratch& s, int64_t* active) = 0;
    virtual void ffn_finish(const HParams& hp, const FFNShare& share, const float* gate2, const float* up2,
                            const int32_t* rows2, int64_t k2, int32_t n, float* y, const StepScratch& s);
    // y[t] = a mixture-of-experts FFN of xn[t]: the router's choice of experts, their weighted sum and the
    // shared expert (optiml/model.h: HParams, MoEWeights). The CPU backends (the host and cpu:N) implement
    // it (native/src/cpu/backend/moe_ffn.cpp); the default refuses (UnsupportedModelError), and make_plan
    // keeps experts off a device without it (CUDA: every layer's experts on the host).
    // rec: the profiler's recorder (optiml/recorder.h), on the host only.
    // A device keeps a step of at most kMoEPairsOnDevice (token, expert) pairs on the device, its router's
    // choice too (the CUDA backend: no host sync, so Session::forward_recorded may record such steps).
    static constexpr int64_t kMoEPairsOnDevice = 16;
    virtual void moe_ffn(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n, float* y,
                         ActivationRecorder* rec);
    // The parts of a mixture of experts whose experts are split between two devices (Session::moe_split),
    // which routes on the host and sums every token's experts there in the order moe_ffn does. The
    // defaults refuse, as moe_ffn's.
    // logits[t] = w's router . xn[t], [n][n_expert].
    virtual void moe_router(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n,
                            float* logits);
    // d[r] = expert(xn[g.token[r]]) for the rows of g, each through the expert of w it is grouped under.
    virtual void moe_experts(const HParams& hp, int layer, const MoEWeights& w, const float* xn, const MoEGroups& g,
                             float* d);
    // sy[t] = the shared expert of xn[t] and sgate[t] its gate (sigmoid(gate_inp_shexp . xn[t]); 1 without one).
    virtual void moe_shared(const HParams& hp, int layer, const MoEWeights& w, const float* xn, int32_t n, float* sy,
                            float* sgate);
    // y[t] = sum over t's k experts, best first, of weight * d[slot] (then + sgate[t] * sy[t] when sy): the
    // sum moe_ffn makes, where the residual lives on this device (the host's rows copied in beside its own).
    virtual void moe_combine(const HParams& hp, int32_t n, const float* weight, const int32_t* slot, const float* d,
                             const float* sy, const float* sgate, float* y);
    // x[t] += post_norm(y[t] (+ y2[t] when y2) + bias): the FFN's parts join the residual stream.
    virtual void ffn_join(const HParams& hp, const FFNWeights& w, float* y, const float* y2, int32_t n, float* x) = 0;
    // A layer's whole FFN where one device computes it densely and the residual stream x lives there too:
    // the results of rms_norm(x, join.norm, s.xn), ffn(share) into s.y and ffn_join(join, s.y) into x, which
    // a device may fuse (the CUDA backend: the norm into the products' input, the residual add into the
    // last product); scratch s as ffn's. False when the device does not (the default): the caller runs the
    // three. Not for shares computed sparsely or profiled (those are the host's).
    virtual bool ffn_block(const HParams& hp, int layer, const FFNShare& share, const FFNWeights& join, float* x,
                           int32_t n, const StepScratch& s, int64_t* active) {
        (void)hp, (void)layer, (void)share, (void)join, (void)x, (void)n, (void)s, (void)active;
        return false;
    }
    // logits[r] = softcap(output(rms_norm(x[rows[r]]))) for r < n_rows; rows: host memory.
    virtual void logits(const HParams& hp, const Weight& norm, const Weight& output, const float* x,
                        const int32_t* rows, int32_t n_rows, float* logits, float* scratch) = 0;

    // ---- timeline ------------------------------------------------------------------------------
    // Between trace_start() and trace_stop() every op and copy enqueued is timed where it runs (on the
    // device: events around it). trace_stop() waits for the stream and returns the spans in order.
    // trace_layer() names the layer the next ops belong to (the session sets it; -1 outside layers).
    void trace_start();
    std::vector<Span> trace_stop();
    void trace_layer(int layer) { trace_layer_.store(layer, std::memory_order_relaxed); }
    bool tracing() const { return tracing_.load(std::memory_order_relaxed); }

    // ---- kernels launched and bytes moved -------------------------------------------------------
    // A device that counts what its ops launch (the CUDA backend: every kernel and copy, per layer as
    // trace_layer() names it, always on) reports the counts since the last reset; a recorded step that is
    // launched again counts its kernels again. host_launches: the calls that put work on the stream (a
    // kernel, a copy, or a whole recorded step). Devices that count nothing: empty, 0.
    virtual std::vector<LaunchCount> launch_counts() const { return {}; }
    virtual int64_t host_launches() const { return 0; }
    virtual void reset_launch_counts() {}

    // ---- weights on this device ----------------------------------------------------------------
    // A copy of w (or of its rows [r0, r1)) in this backend's memory, counted as "weights".
    Weight upload(const Weight& w, const char* what = "weights");
    Weight upload_rows(const Weight& w, const int32_t* rows, int64_t n_rows, const char* what = "weights");
    // Columns [c0, c1) of every row, packed (c0 and c1 whole blocks of w's type): exact bytes, no requantization.
    Weight upload_cols(const Weight& w, int64_t c0, int64_t c1, const char* what = "weights");

protected:
    std::string name_;

    int current_trace_layer() const { return trace_layer_.load(std::memory_order_relaxed); }
    void add_span(int layer, SpanKind kind, double t0, double t1);
    // A device whose spans are timed by events marks the start of the timeline (trace_start, stream
    // drained) and turns its events into spans (trace_stop, stream drained).
    virtual void begin_spans() {}
    virtual void collect_spans() {}

private:
    virtual void* device_alloc(size_t bytes) = 0;  // zeroed memory
    virtual void device_free(void* p, size_t bytes) = 0;  // bytes: as allocated

protected:
    void free_all();  // derived destructors call this while their device is still usable

private:
    struct Allocation {
        void* ptr;
        size_t bytes;
        std::string what;
    };
    std::vector<Allocation> blocks_;
    size_t allocated_ = 0;
    std::mutex alloc_mutex_;

    std::atomic<bool> tracing_{false};
    std::atomic<int> trace_layer_{-1};
    std::mutex trace_mutex_;
    std::vector<Span> spans_;
};

// "cpu": the host backend over `pool`. "cpu:N" (N >= 1): another CPU instance with its own worker
// thread and an n_threads pool, treated as an accelerator by the plan (for tests of split execution).
std::unique_ptr<Backend> make_cpu_backend(std::shared_ptr<ThreadPool> pool);
std::unique_ptr<Backend> make_cpu_device_backend(int index, int n_threads);

// "cpu:N" -> N (prefix "cpu"), "cuda" / "cuda:N" -> N (prefix "cuda"); -1 when d is not such a name.
int device_index(const std::string& d, const char* prefix);
// The accelerator named "cuda[:N]" or "cpu:N" (N >= 1, with n_threads threads); ArgumentError otherwise.
std::unique_ptr<Backend> make_device_backend(const std::string& device, int n_threads);

}  // namespace optiml
