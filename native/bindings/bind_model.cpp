// optiml._core.Model (weights bound to a mapped GGUF) and optiml._core.Session (KV cache, eval).
#include "bindings.h"

#include <memory>
#include <string>

#include <nanobind/stl/string.h>

#include "optiml/common.h"
#include "optiml/model.h"

namespace {

using namespace optiml;

using Tokens1D = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

struct PyModel {
    std::shared_ptr<Model> model;
};

struct PySession {
    std::unique_ptr<Session> session;
};

PyModel load_model(const std::string& path) {
    std::shared_ptr<GGUFFile> f;
    {
        nb::gil_scoped_release release;
        f = GGUFFile::open(path);
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
    d["n_rot"] = hp.n_rot;
    d["rms_eps"] = hp.rms_eps;
    d["rope_freq_base"] = hp.rope_freq_base;
    d["rope_freq_scale"] = hp.rope_freq_scale;
    d["rope_type"] = hp.rope_type == ROPE_NEOX ? "neox" : "norm";
    d["ffn_act"] = hp.ffn_act == FFN_RELU ? "relu" : "silu";
    d["tied_embeddings"] = m.model->output.data == m.model->tok_embd.data;
    d["weight_bytes"] = m.model->weight_bytes();
    return d;
}

PySession make_session(const PyModel& m, int32_t n_ctx, int n_threads, const std::string& kv_type, int32_t n_batch) {
    int32_t kvt;
    if (kv_type == "f16") kvt = TYPE_F16;
    else if (kv_type == "f32") kvt = TYPE_F32;
    else throw ArgumentError(format("kv_type must be 'f16' or 'f32', not '%s'", kv_type.c_str()));
    if (n_threads < 0) throw ArgumentError("n_threads must be >= 0 (0 = physical cores)");
    std::shared_ptr<ThreadPool> pool = n_threads == 0 ? default_pool() : std::make_shared<ThreadPool>(n_threads);
    return PySession{std::make_unique<Session>(m.model, n_ctx, pool, kvt, n_batch)};
}

nb::ndarray<nb::numpy, float> eval(PySession& s, Tokens1D tokens, bool all_logits) {
    const int32_t n = (int32_t)tokens.shape(0);
    const size_t n_vocab = (size_t)s.session->model().hp.n_vocab;
    if (n == 0) throw ArgumentError("eval needs at least one token");
    auto out = all_logits ? new_array<float>({(size_t)n, n_vocab}) : new_array<float>({n_vocab});
    {
        nb::gil_scoped_release release;
        s.session->eval(tokens.data(), n, all_logits, out.data());
    }
    return out;
}

}  // namespace

void bind_model(nb::module_& m) {
    nb::class_<PyModel>(m, "Model")
        .def(nb::new_([](const std::string& path) { return load_model(path); }), nb::arg("path"))
        .def_prop_ro("hparams", &hparams)
        .def_prop_ro("n_vocab", [](const PyModel& pm) { return pm.model->hp.n_vocab; });
    m.def("supported_architectures", [] { return std::string(supported_architectures()); });

    nb::class_<PySession>(m, "Session")
        .def(nb::new_(&make_session), nb::arg("model"), nb::arg("n_ctx"), nb::arg("n_threads") = 0,
             nb::arg("kv_type") = "f16", nb::arg("n_batch") = 512)
        .def("eval", &eval, nb::arg("tokens"), nb::arg("all_logits") = false)
        .def_prop_ro("n_past", [](const PySession& s) { return s.session->n_past(); })
        .def_prop_ro("n_ctx", [](const PySession& s) { return s.session->n_ctx(); })
        .def_prop_ro("kv_bytes", [](const PySession& s) { return s.session->kv_bytes(); })
        .def("truncate", [](PySession& s, int32_t n) { s.session->truncate(n); }, nb::arg("n"));
}
