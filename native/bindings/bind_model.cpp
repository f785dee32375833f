// optiml._core.Model (weights bound to a mapped GGUF) and optiml._core.Session (KV cache, eval).
#include "bindings.h"

#include <cctype>
#include <memory>
#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "optiml/common.h"
#include "optiml/kv_cache.h"
#include "optiml/measure_device.h"
#include "optiml/model.h"
#include "optiml/predictor.h"

InterruptScope::InterruptScope(optiml::Session& session) {
    const nb::object main = nb::module_::import_("threading").attr("main_thread")();
    if (nb::cast<unsigned long>(main.attr("ident")) != PyThread_get_thread_ident()) return;
    session_ = &session;
    session.set_interrupt_check([] {
        nb::gil_scoped_acquire gil;
        if (PyErr_CheckSignals() != 0) throw nb::python_error();
    });
}

InterruptScope::~InterruptScope() {
    if (session_) session_->set_interrupt_check(nullptr);
}

namespace {

using namespace optiml;

using Tokens1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct PyModel {
    std::shared_ptr<Model> model;
};

struct PySession {
    std::unique_ptr<Session> session;
};

struct PyRecorder {
    std::shared_ptr<ActivationRecorder> rec;
};

using Floats1D = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::dict sparsity_config(const PyModel& m) {
    const SparsityConfig& sc = m.model->sparsity;
    nb::dict d;
    d["calibrated"] = sc.calibrated;
    d["criterion"] = sc.on_product ? "product" : "gate";
    d["threshold"] = to_array(sc.threshold);
    d["target"] = sc.target;
    if (sc.neuron_scale.empty()) d["neuron_scale"] = nb::none();
    else d["neuron_scale"] = to_array(sc.neuron_scale);
    return d;
}

void set_sparsity(PySession& s, bool enabled, std::optional<Floats1D> thresholds, bool on_product,
                  std::optional<Floats1D> neuron_scale, bool compact_down) {
    SparsitySettings st;
    st.enabled = enabled;
    st.on_product = on_product;
    st.compact_down = compact_down;
    if (thresholds) st.threshold.assign(thresholds->data(), thresholds->data() + thresholds->shape(0));
    if (neuron_scale) st.neuron_scale.assign(neuron_scale->data(), neuron_scale->data() + neuron_scale->shape(0));
    if (enabled && !thresholds) throw ArgumentError("sparsity needs per-layer thresholds");
    nb::gil_scoped_release release;  // the first call repacks the down matrices
    s.session->set_sparsity(st);
}

nb::tuple sparsity_counts(const PySession& s) {
    return nb::make_tuple(to_array(s.session->ffn_active()), to_array(s.session->ffn_seen()));
}

PyRecorder make_recorder(const PyModel& m, Floats1D thresholds, int64_t sample_every, int64_t max_samples,
                         std::optional<Floats1D> gate_weight) {
    std::vector<float> thr(thresholds.data(), thresholds.data() + thresholds.shape(0));
    std::vector<float> gw;
    if (gate_weight) gw.assign(gate_weight->data(), gate_weight->data() + gate_weight->shape(0));
    nb::gil_scoped_release release;  // reads every down matrix for its column norms
    return PyRecorder{std::make_shared<ActivationRecorder>(*m.model, std::move(thr), sample_every, max_samples,
                                                           std::move(gw))};
}

nb::dict recorder_result(const PyRecorder& pr) {
    const ActivationRecorder& r = *pr.rec;
    const size_t L = r.n_layer, F = r.n_ff, B = ActivationRecorder::kHistBins, S = r.n_samples;
    nb::dict d;
    d["n_tokens"] = r.n_tokens;
    d["threshold"] = to_array(r.thresholds, {L});
    d["fired"] = to_array(r.fired, {L, F});
    d["sum_abs"] = to_array(r.sum_abs, {L, F});
    d["sum_abs_up"] = to_array(r.sum_abs_up, {L, F});
    d["down_norm"] = to_array(r.down_norm, {L, F});
    d["hist_edges"] = to_array(ActivationRecorder::hist_edges(), {B + 1});
    d["gate_hist"] = to_array(r.gate_hist, {L, B});
    d["gate_err"] = to_array(r.gate_err, {L, B});
    d["prod_hist"] = to_array(r.prod_hist, {L, B});
    d["prod_err"] = to_array(r.prod_err, {L, B});
    d["sample_x"] = to_array(r.sample_x, {S, L, (size_t)r.n_embd});  // f16 bits
    d["sample_mask"] = to_array(r.sample_mask, {S, L, F / 8});
    if (r.n_expert > 0) {
        const size_t X = r.n_expert;
        d["expert_count"] = to_array(r.expert_count, {L, X});
        d["expert_weight"] = to_array(r.expert_weight, {L, X});
        d["expert_next"] = to_array(r.expert_next, {L, X, X});
        d["expert_fired"] = to_array(r.expert_fired, {L, X, (size_t)r.n_ff_exp});
    }
    return d;
}

PyModel load_model(const std::string& path, bool in_memory) {
    std::shared_ptr<GGUFFile> f;
    {
        nb::gil_scoped_release release;
        f = GGUFFile::open(path, in_memory);
    }
    return PyModel{Model::load(f)};
}

nb::dict hparams(const PyModel& m) {
    const HParams& hp = m.model->hp;
    nb::dict d;
    d["arch"] = hp.arch;
    d["n_vocab"] = hp.n_vocab;
    d["n_ctx_train"] = hp.n_ctx_train;
    d["n_embd"] = hp.n_embd;
    d["n_layer"] = hp.n_layer;
    d["n_head"] = hp.n_head;
    d["n_head_kv"] = hp.n_head_kv;
    d["head_dim"] = hp.head_dim;
    d["n_ff"] = hp.n_ff;
    d["n_expert"] = hp.n_expert;
    d["n_expert_used"] = hp.n_expert_used;
    d["n_ff_exp"] = hp.n_ff_exp;
    d["n_ff_shexp"] = hp.n_ff_shexp;
    d["n_rot"] = hp.n_rot;
    d["rms_eps"] = hp.rms_eps;
    d["rope_freq_base"] = hp.rope_freq_base;
    d["rope_freq_scale"] = hp.rope_freq_scale;
    d["rope_type"] = hp.rope_type == ROPE_NEOX ? "neox" : "norm";
    d["ffn_act"] = ffn_activation_name(hp.ffn_act);
    d["tied_embeddings"] = m.model->output.data == m.model->tok_embd.data;
    d["weight_bytes"] = m.model->weight_bytes();
    static const char* const kPooling[] = {"none", "mean", "cls", "last", "rank"};
    if (hp.pooling_type < 0) d["pooling"] = nb::none();
    else d["pooling"] = kPooling[hp.pooling_type];
    return d;
}

// The cache types by llama.cpp's names (--cache-type-k/-v); "" for the values: the keys' type.
int32_t kv_type_id(const std::string& kv_type, const char* what = "kv_type") {
    std::string t = kv_type;
    for (char& c : t) c = (char)std::tolower((unsigned char)c);
    if (t == "f16") return TYPE_F16;
    if (t == "f32") return TYPE_F32;
    if (t == "q8_0") return TYPE_Q8_0;
    if (t == "q4_0") return TYPE_Q4_0;
    throw ArgumentError(format("%s must be 'f16', 'f32', 'q8_0' or 'q4_0', not '%s'", what, kv_type.c_str()));
}
int32_t kv_type_v_id(const std::string& kv_type_v) {
    return kv_type_v.empty() ? -1 : kv_type_id(kv_type_v, "kv_type_v");
}

PySession make_session(const PyModel& m, int32_t n_ctx, int n_threads, const std::string& kv_type, int32_t n_batch,
                       int32_t n_seq, const std::string& device, int64_t vram, int32_t n_gpu_layers,
                       std::optional<std::vector<int32_t>> gpu_neurons, int32_t device_threads, int64_t kv_vram,
                       const std::string& kv_type_v, int32_t n_cpu_moe,
                       std::optional<std::vector<std::vector<int32_t>>> gpu_experts) {
    const int32_t kvt = kv_type_id(kv_type), kvt_v = kv_type_v_id(kv_type_v);
    if (n_threads < 0) throw ArgumentError("n_threads must be >= 0 (0 = physical cores)");
    PlanOptions o;
    o.device = device;
    o.vram = vram;
    o.n_gpu_layers = n_gpu_layers;
    if (gpu_neurons) o.gpu_neurons = *gpu_neurons;
    o.device_threads = device_threads;
    o.kv_vram = kv_vram;
    o.n_cpu_moe = n_cpu_moe;
    if (gpu_experts) o.gpu_experts = *gpu_experts;
    std::shared_ptr<ThreadPool> pool = n_threads == 0 ? default_pool() : std::make_shared<ThreadPool>(n_threads);
    nb::gil_scoped_release release;  // uploads weights to the device
    return PySession{std::make_unique<Session>(m.model, n_ctx, pool, kvt, n_batch, n_seq, &o, kvt_v)};
}

// A plan without binding anything: what `optiml info --plan` shows.
nb::dict plan_dict(const Plan& p, const Model& m) {
    nb::dict d;
    d["device"] = p.device.empty() ? std::string("cpu") : p.device;
    d["reason"] = p.reason;
    d["budget"] = p.budget;
    nb::list layers;
    for (const LayerPlan& l : p.layers) {
        nb::dict ld;
        ld["attention"] = l.attn_on_device ? p.device : std::string("cpu");
        ld["ffn_on_device"] = l.ffn_on_device;
        ld["device_experts"] = l.device_experts;
        layers.append(ld);
    }
    d["layers"] = layers;
    nb::dict bytes;
    bytes["attention_weights"] = p.device_bytes.attn_weights;
    bytes["ffn_weights"] = p.device_bytes.ffn_weights;
    bytes["kv"] = p.device_bytes.kv;
    bytes["scratch"] = p.device_bytes.scratch;
    bytes["output"] = p.device_bytes.output;
    bytes["total"] = p.device_bytes.total();
    d["device_bytes"] = bytes;
    d["output_on_device"] = p.output_on_device;
    d["logits_rows"] = p.logits_rows;
    d["host_kv_bytes"] = p.host_kv_bytes;
    d["n_seq"] = p.n_seq;
    d["kv_type_k"] = kv_type_name(p.kv_type);
    d["kv_type_v"] = kv_type_name(p.kv_type_v);
    d["n_seq_device"] = p.n_seq_device;
    d["host_scratch_bytes"] = p.host_scratch_bytes;
    d["neuron_order"] = !p.neuron_order.empty();
    d["summary"] = p.summary(m);
    return d;
}

nb::dict make_plan_py(const PyModel& m, int32_t n_ctx, int32_t n_seq, int32_t n_batch, const std::string& kv_type,
                      const std::string& device, int64_t vram, int32_t n_gpu_layers,
                      std::optional<std::vector<int32_t>> gpu_neurons, int64_t kv_vram, const std::string& kv_type_v,
                      int32_t n_cpu_moe, std::optional<std::vector<std::vector<int32_t>>> gpu_experts) {
    PlanOptions o;
    o.n_cpu_moe = n_cpu_moe;
    if (gpu_experts) o.gpu_experts = *gpu_experts;
    o.kv_type_v = kv_type_v_id(kv_type_v);
    o.kv_vram = kv_vram;
    o.n_ctx = n_ctx;
    o.n_seq = n_seq;
    o.n_batch = n_batch;
    o.kv_type = kv_type_id(kv_type);
    o.device = device;
    o.vram = vram;
    o.n_gpu_layers = n_gpu_layers;
    if (gpu_neurons) o.gpu_neurons = *gpu_neurons;
    return plan_dict(make_plan(*m.model, o), *m.model);
}

using Ints1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Bytes1D = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::ndarray<nb::numpy, float> decode(PySession& s, Tokens1D tokens, Ints1D seq, Ints1D pos, Bytes1D want) {
    const size_t n = tokens.shape(0);
    if (n == 0) throw ArgumentError("decode needs at least one token");
    if (seq.shape(0) != n || pos.shape(0) != n || want.shape(0) != n)
        throw ArgumentError("decode: tokens, seq, pos and logits must have the same length");
    size_t n_out = 0;
    for (size_t i = 0; i < n; i++) n_out += want.data()[i] != 0;
    const size_t n_vocab = (size_t)s.session->model().hp.n_vocab;
    auto out = new_array<float>({n_out, n_vocab});
    {
        InterruptScope interruptible(*s.session);
        nb::gil_scoped_release release;
        s.session->decode(tokens.data(), seq.data(), pos.data(), want.data(), (int32_t)n, out.data());
    }
    return out;
}

nb::ndarray<nb::numpy, float> eval(PySession& s, Tokens1D tokens, bool all_logits) {
    const int32_t n = (int32_t)tokens.shape(0);
    const size_t n_vocab = (size_t)s.session->model().hp.n_vocab;
    if (n == 0) throw ArgumentError("eval needs at least one token");
    auto out = all_logits ? new_array<float>({(size_t)n, n_vocab}) : new_array<float>({n_vocab});
    {
        InterruptScope interruptible(*s.session);
        nb::gil_scoped_release release;
        s.session->eval(tokens.data(), n, all_logits, out.data());
    }
    return out;
}

nb::ndarray<nb::numpy, float> hidden_states(PySession& s, Tokens1D tokens, int32_t seq) {
    const int32_t n = (int32_t)tokens.shape(0);
    if (n == 0) throw ArgumentError("hidden_states needs at least one token");
    auto out = new_array<float>({(size_t)n, (size_t)s.session->model().hp.n_embd});
    {
        InterruptScope interruptible(*s.session);
        nb::gil_scoped_release release;
        s.session->hidden_states(tokens.data(), n, seq, out.data());
    }
    return out;
}

}  // namespace

// optiml hw: a device's sync, copy and per-op costs, measured through the backend interface.
nb::dict measure_device_py(const std::string& device, size_t bytes, size_t small_bytes, int n_threads) {
    std::unique_ptr<Backend> be = make_device_backend(device, n_threads < 1 ? 1 : n_threads);
    DeviceMeasurements r;
    {
        nb::gil_scoped_release release;
        r = measure_device(*be, bytes, small_bytes);
    }
    nb::dict d;
    d["device"] = be->name();
    d["sync_s"] = r.sync_s;
    d["transfer_latency_s"] = r.transfer_latency_s;
    d["h2d_bytes_per_s"] = r.h2d_bytes_per_s;
    d["d2h_bytes_per_s"] = r.d2h_bytes_per_s;
    d["device_bytes_per_s"] = r.device_bytes_per_s;
    d["op_s"] = r.op_s;
    return d;
}

// A session's activation predictors, and how a placed file's neurons are read with them.
static void bind_predictors(nb::class_<PySession>& session) {
    session
        .def("set_predictors", [](PySession& s, std::optional<std::string> path) {
            std::shared_ptr<const Predictors> p;
            nb::gil_scoped_release release;  // the first call repacks the down matrices
            if (path) p = Predictors::load(*path, s.session->model());
            s.session->set_predictors(std::move(p));
        }, nb::arg("path").none(), "Attaches the activation predictors of a companion GGUF (None detaches).")
        .def_prop_ro("has_predictors", [](const PySession& s) { return s.session->has_predictors(); })
        .def_prop_ro("placed_copy_layers", [](const PySession& s) { return s.session->placed_copy_layers(); },
                     "Layers whose FFN the host reads from a copy in the file's placed order (with predictors).")
        .def_prop_ro("placed_copy_bytes", [](const PySession& s) { return s.session->placed_copy_bytes(); })
        .def_prop_rw("placed_copies", [](const PySession& s) { return s.session->placed_copies(); },
                     [](PySession& s, bool on) {
                         nb::gil_scoped_release release;  // may copy the layers
                         s.session->set_placed_copies(on);
                     }, "Whether the host reads a placed file's neurons from copies in the placed order.")
        .def_prop_rw("predictor_group", [](const PySession& s) { return s.session->predictor_group(); },
                     [](PySession& s, int32_t g) { s.session->set_predictor_group(g); },
                     "Predictors decide by groups of this many consecutive neurons (1: neuron by neuron).");
}

void bind_model(nb::module_& m) {
    m.def("measure_device", &measure_device_py, nb::arg("device"), nb::arg("bytes") = (size_t)256 << 20,
          nb::arg("small_bytes") = (size_t)16384, nb::arg("n_threads") = 1);
    nb::class_<PyModel>(m, "Model")
        .def(nb::new_([](const std::string& path, bool in_memory) { return load_model(path, in_memory); }),
             nb::arg("path"), nb::arg("in_memory") = false)
        // bytes (os.fsencode): file names that are not UTF-8 load too
        .def(nb::new_([](nb::bytes path, bool in_memory) {
                 return load_model(std::string(path.c_str(), path.size()), in_memory);
             }),
             nb::arg("path"), nb::arg("in_memory") = false)
        .def_prop_ro("in_memory", [](const PyModel& pm) { return pm.model->file->mapping()->in_memory(); })
        // How many matrices are in the rows16 layout now (optiml/rows16.h; a session places them).
        .def_prop_ro("rows16_matrices",
                     [](const PyModel& pm) {
                         int n = 0;
                         for (const Model::DenseMatrix& m : pm.model->dense_matrices()) n += m.w->rows16;
                         return n;
                     })
        .def_prop_ro("hparams", &hparams)
        .def_prop_ro("n_vocab", [](const PyModel& pm) { return pm.model->hp.n_vocab; })
        .def_prop_ro("sparsity", &sparsity_config);

    nb::class_<PyRecorder>(m, "ActivationRecorder")
        .def(nb::new_(&make_recorder), nb::arg("model"), nb::arg("thresholds"), nb::arg("sample_every") = 0,
             nb::arg("max_samples") = 0, nb::arg("gate_weight").none() = nb::none())
        .def_prop_ro("n_tokens", [](const PyRecorder& r) { return r.rec->n_tokens; })
        .def("result", &recorder_result);
    m.def("make_plan", &make_plan_py, nb::arg("model"), nb::arg("n_ctx"), nb::arg("n_seq") = 1,
          nb::arg("n_batch") = 512, nb::arg("kv_type") = "f16", nb::arg("device") = "auto", nb::arg("vram") = -1,
          nb::arg("n_gpu_layers") = -1, nb::arg("gpu_neurons").none() = nb::none(), nb::arg("kv_vram") = -1,
          nb::arg("kv_type_v") = "", nb::arg("n_cpu_moe") = -1, nb::arg("gpu_experts").none() = nb::none());
    m.def("supported_architectures", [] { return std::string(supported_architectures()); });

    auto session = nb::class_<PySession>(m, "Session");
    session
        .def(nb::new_(&make_session), nb::arg("model"), nb::arg("n_ctx"), nb::arg("n_threads") = 0,
             nb::arg("kv_type") = "f16", nb::arg("n_batch") = 512, nb::arg("n_seq") = 1, nb::arg("device") = "cpu",
             nb::arg("vram") = -1, nb::arg("n_gpu_layers") = -1, nb::arg("gpu_neurons").none() = nb::none(),
             nb::arg("device_threads") = 1, nb::arg("kv_vram") = -1, nb::arg("kv_type_v") = "",
             nb::arg("n_cpu_moe") = -1, nb::arg("gpu_experts").none() = nb::none())
        .def("decode", &decode, nb::arg("tokens"), nb::arg("seq"), nb::arg("pos"), nb::arg("logits"))
        .def_prop_ro("n_seq", [](const PySession& s) { return s.session->n_seq(); })
        .def("seq_len", [](const PySession& s, int32_t seq) { return s.session->kv().seq_len(seq); }, nb::arg("seq"))
        .def("kv_clear", [](PySession& s, int32_t seq) { s.session->kv().clear(seq); }, nb::arg("seq"))
        .def("kv_truncate", [](PySession& s, int32_t seq, int32_t n) { s.session->kv().truncate(seq, n); },
             nb::arg("seq"), nb::arg("n"))
        .def("kv_copy", [](PySession& s, int32_t src, int32_t dst, int32_t n) {
            nb::gil_scoped_release release;
            s.session->kv().copy(src, dst, n);
        }, nb::arg("src"), nb::arg("dst"), nb::arg("n") = -1)
        .def("kv_place", [](PySession& s, int32_t seq, bool on_host) {
            nb::gil_scoped_release release;
            s.session->place_seq(seq, on_host);
        }, nb::arg("seq"), nb::arg("on_host"))
        .def("kv_on_host", [](const PySession& s, int32_t seq) {
            s.session->kv().check_seq(seq);
            return s.session->kv().on_host(seq);
        }, nb::arg("seq"))
        .def_prop_ro("plan", [](const PySession& s) { return plan_dict(s.session->plan(), s.session->model()); })
        .def_prop_ro("device_allocations", [](const PySession& s) {
            nb::dict d;
            for (const auto& [k, v] : s.session->device_allocations()) d[k.c_str()] = v;
            return d;
        })
        .def_prop_ro("recorded_steps", [](const PySession& s) { return s.session->recorded_steps(); })
        .def("launch_counts", [](const PySession& s) {
            nb::list out;
            for (const LaunchCount& c : s.session->launch_counts())
                out.append(nb::make_tuple(c.layer, c.kind, c.copy, c.launches, c.weight_bytes, c.activation_bytes,
                                          c.kv_bytes));
            return out;
        }, "[(layer, kind, is_copy, launches, weight_bytes, activation_bytes, kv_bytes)] since the last reset")
        .def_prop_ro("host_launches", [](const PySession& s) { return s.session->host_launches(); })
        .def("reset_launch_counts", [](PySession& s) { s.session->reset_launch_counts(); })
        .def("timeline_start", [](PySession& s) {
            nb::gil_scoped_release release;  // waits for the device's stream
            s.session->timeline_start();
        })
        .def("timeline_stop", [](PySession& s) {
            std::vector<Session::TimedSpan> spans;
            {
                nb::gil_scoped_release release;
                spans = s.session->timeline_stop();
            }
            nb::list out;  // (device 0 host / 1 the plan's device, layer or -1, kind, t0, t1)
            for (const Session::TimedSpan& t : spans)
                out.append(nb::make_tuple(t.device, t.span.layer, span_kind_name(t.span.kind), t.span.t0, t.span.t1));
            return out;
        })
        .def("eval", &eval, nb::arg("tokens"), nb::arg("all_logits") = false)
        .def("hidden_states", &hidden_states, nb::arg("tokens"), nb::arg("seq") = 0)
        .def_prop_ro("n_past", [](const PySession& s) { return s.session->n_past(); })
        .def_prop_ro("n_ctx", [](const PySession& s) { return s.session->n_ctx(); })
        .def_prop_ro("kv_bytes", [](const PySession& s) { return s.session->kv_bytes(); })
        .def("truncate", [](PySession& s, int32_t n) { s.session->truncate(n); }, nb::arg("n"))
        .def("set_sparsity", &set_sparsity, nb::arg("enabled"), nb::arg("thresholds") = nb::none(),
             nb::arg("on_product") = false, nb::arg("neuron_scale").none() = nb::none(),
             nb::arg("compact_down") = false)
        .def("set_compact_down", [](PySession& s, bool compact) {
            nb::gil_scoped_release release;  // may repack the down matrices
            s.session->set_compact_down(compact);
        }, nb::arg("compact"))
        .def("sparsity_counts", &sparsity_counts)
        .def("reset_sparsity_counts", [](PySession& s) { s.session->reset_sparsity_counts(); })
        .def("set_recorder", [](PySession& s, std::optional<PyRecorder*> r) {
            std::shared_ptr<ActivationRecorder> rec = r && *r ? (*r)->rec : nullptr;
            // Without the GIL: placing the weights takes the model's layout lock, which a decode on another
            // session holds while it checks for Ctrl-C, and that check takes the GIL.
            nb::gil_scoped_release release;
            s.session->set_recorder(std::move(rec));
        }, nb::arg("recorder").none());
    bind_predictors(session);
}

optiml::Session& native_session(nb::handle session) { return *nb::cast<PySession&>(session).session; }
