// optiml._core.Tokenizer and optiml._core.Detokenizer; python/optiml/tokenizer.py wraps them.
#include "bindings.h"

#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "optiml/gguf.h"
#include "optiml/tokenizer.h"

using namespace optiml;

namespace {

// Python objects hold the tokenizer by shared_ptr, so a Detokenizer keeps its tokenizer alive.
struct PyTokenizer {
    std::shared_ptr<const Tokenizer> tok;
};

struct PyDetokenizer {
    std::shared_ptr<const Tokenizer> tok;  // declared first: outlives `d`, which refers to it
    Detokenizer d;
    PyDetokenizer(std::shared_ptr<const Tokenizer> t, bool render_special)
        : tok(std::move(t)), d(*tok, render_special) {}
};

nb::list to_list(const std::vector<int32_t>& ids) {
    PyObject* list = PyList_New((Py_ssize_t)ids.size());
    if (!list) throw nb::python_error();
    for (size_t i = 0; i < ids.size(); i++) PyList_SET_ITEM(list, (Py_ssize_t)i, PyLong_FromLong(ids[i]));
    return nb::steal<nb::list>(list);
}

// Below this many bytes the GIL round trip costs more than the encoding.
constexpr size_t kReleaseGilBytes = 4096;

}  // namespace

void bind_tokenizer(nb::module_& m) {
    nb::class_<PyTokenizer>(m, "Tokenizer")
        .def("__init__", [](PyTokenizer* self, nb::bytes path) {
            std::string p(path.c_str(), path.size());
            std::unique_ptr<Tokenizer> t;
            {
                nb::gil_scoped_release release;
                t = Tokenizer::from_file(p);
            }
            new (self) PyTokenizer{std::shared_ptr<const Tokenizer>(std::move(t))};
        }, nb::arg("path"), "Reads the tokenizer of the GGUF file at `path` (bytes).")
        .def_static("from_gguf", [](const GGUFFile& f) {
            return PyTokenizer{std::shared_ptr<const Tokenizer>(Tokenizer::from_gguf(f))};
        }, nb::arg("file"), "Reads the tokenizer of an open optiml._core.GGUFFile.")
        .def("encode", [](const PyTokenizer& t, nb::handle text, bool add_special, bool parse_special) {
            // str (as UTF-8) or bytes, copied before the GIL goes.
            std::string s;
            if (PyUnicode_Check(text.ptr())) {
                Py_ssize_t n;
                const char* p = PyUnicode_AsUTF8AndSize(text.ptr(), &n);
                if (!p) throw nb::python_error();  // lone surrogates
                s.assign(p, (size_t)n);
            } else if (PyBytes_Check(text.ptr())) {
                s.assign(PyBytes_AS_STRING(text.ptr()), (size_t)PyBytes_GET_SIZE(text.ptr()));
            } else {
                throw nb::type_error("encode() takes str or bytes");
            }
            std::vector<int32_t> ids;
            if (s.size() >= kReleaseGilBytes) {
                nb::gil_scoped_release release;
                ids = t.tok->encode(s, add_special, parse_special);
            } else {
                ids = t.tok->encode(s, add_special, parse_special);
            }
            return to_list(ids);
        }, nb::arg("text"), nb::arg("add_special") = true, nb::arg("parse_special") = false)
        .def("decode", [](const PyTokenizer& t, const std::vector<int32_t>& ids, bool render_special) {
            std::string s;
            if (ids.size() >= kReleaseGilBytes) {
                nb::gil_scoped_release release;
                s = t.tok->decode(ids, render_special);
            } else {
                s = t.tok->decode(ids, render_special);
            }
            return nb::bytes(s.data(), s.size());
        }, nb::arg("ids"), nb::arg("render_special") = false, "Raw bytes of the tokens.")
        .def("token_to_piece", [](const PyTokenizer& t, int32_t id, bool render_special) {
            std::string s = t.tok->token_to_piece(id, render_special);
            return nb::bytes(s.data(), s.size());
        }, nb::arg("id"), nb::arg("render_special") = true)
        .def("pre_tokenize", [](const PyTokenizer& t, const std::string& text) {
            nb::list out;
            for (const std::string& p : t.tok->pre_tokenize(text)) out.append(nb::bytes(p.data(), p.size()));
            return out;
        }, nb::arg("text"), "The pre-tokenizer's pieces of `text` (bytes), for debugging.")
        .def("token_text", [](const PyTokenizer& t, int32_t id) {
            const std::string& s = t.tok->token_text(id);
            return nb::bytes(s.data(), s.size());
        }, nb::arg("id"))
        .def("token_id", [](const PyTokenizer& t, const std::string& s) { return t.tok->token_id(s); }, nb::arg("text"))
        .def("token_type", [](const PyTokenizer& t, int32_t id) { return (int)t.tok->token_type(id); }, nb::arg("id"))
        .def("token_score", [](const PyTokenizer& t, int32_t id) { return t.tok->token_score(id); }, nb::arg("id"))
        .def("is_eog", [](const PyTokenizer& t, int32_t id) { return t.tok->is_eog(id); }, nb::arg("id"))
        .def("is_control", [](const PyTokenizer& t, int32_t id) { return t.tok->is_control(id); }, nb::arg("id"))
        .def_prop_ro("eog_ids", [](const PyTokenizer& t) { return t.tok->eog_ids(); })
        .def_prop_ro("n_vocab", [](const PyTokenizer& t) { return t.tok->n_vocab(); })
        .def_prop_ro("bos_id", [](const PyTokenizer& t) { return t.tok->bos_id(); })
        .def_prop_ro("eos_id", [](const PyTokenizer& t) { return t.tok->eos_id(); })
        .def_prop_ro("eot_id", [](const PyTokenizer& t) { return t.tok->eot_id(); })
        .def_prop_ro("unk_id", [](const PyTokenizer& t) { return t.tok->unk_id(); })
        .def_prop_ro("pad_id", [](const PyTokenizer& t) { return t.tok->pad_id(); })
        .def_prop_ro("add_bos", [](const PyTokenizer& t) { return t.tok->add_bos(); })
        .def_prop_ro("add_eos", [](const PyTokenizer& t) { return t.tok->add_eos(); })
        .def_prop_ro("add_space_prefix", [](const PyTokenizer& t) { return t.tok->add_space_prefix(); })
        .def_prop_ro("model_name", [](const PyTokenizer& t) { return t.tok->model_name(); })
        .def_prop_ro("pre_name", [](const PyTokenizer& t) { return t.tok->pre_name(); });

    nb::class_<PyDetokenizer>(m, "Detokenizer")
        .def("__init__", [](PyDetokenizer* self, const PyTokenizer& t, bool render_special) {
            new (self) PyDetokenizer(t.tok, render_special);
        }, nb::arg("tokenizer"), nb::arg("render_special") = false)
        .def("push", [](PyDetokenizer& d, int32_t id) {
            std::string s = d.d.push(id);
            return nb::str(s.data(), s.size());
        }, nb::arg("id"), "Text completed by this token (valid UTF-8; may be empty).")
        .def("flush", [](PyDetokenizer& d) {
            std::string s = d.d.flush();
            return nb::str(s.data(), s.size());
        })
        .def("reset", [](PyDetokenizer& d) { d.d.reset(); })
        .def_prop_ro("pending_bytes", [](const PyDetokenizer& d) { return d.d.pending_bytes(); });
}

std::shared_ptr<const optiml::Tokenizer> native_tokenizer(nb::handle tokenizer) {
    return nb::cast<PyTokenizer&>(tokenizer).tok;
}

optiml::Detokenizer& native_detokenizer(nb::handle detokenizer) {
    return nb::cast<PyDetokenizer&>(detokenizer).d;
}
