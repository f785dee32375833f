// optiml._core: the native core as a Python module. Python code should use the optiml package,
// which wraps this module; names here are not a stable API.
#include "bindings.h"

#include <Python.h>

#include <cstring>

#include "optiml/common.h"

NB_MODULE(_core, m) {
    m.doc() = "OptiML native core";
    bind_errors(m);
    bind_system(m);
    bind_kernels(m);
    bind_quant(m);
    bind_gguf(m);
    bind_tokenizer(m);
    bind_sampling(m);
    bind_model(m);
    bind_sparse(m);
    bind_generate(m);
    bind_cuda_dequant(m);
    bind_cuda_timing(m);
}

namespace {

void set_error(PyObject* type, const char* what) {
    PyObject* msg = PyUnicode_DecodeUTF8(what, (Py_ssize_t)std::strlen(what), "backslashreplace");
    if (!msg) {
        PyErr_Clear();
        msg = PyUnicode_FromString("(an error message that could not be decoded)");
    }
    PyErr_SetObject(type, msg);
    Py_XDECREF(msg);
}

}  // namespace

void bind_errors(nb::module_& m) {
    static nb::exception<optiml::Error> optiml_error(m, "OptimlError");
    static nb::exception<optiml::GGUFError> gguf_error(m, "GGUFError", optiml_error);
    static nb::exception<optiml::UnsupportedModelError> unsupported(m, "UnsupportedModelError", optiml_error);
    static nb::exception<optiml::ContextOverflowError> overflow(m, "ContextOverflowError", optiml_error);
    // ArgumentError is both an OptimlError and a ValueError, so `except ValueError` works too.
    nb::object bases = nb::make_tuple(optiml_error, nb::handle(PyExc_ValueError));
    static PyObject* argument_error =
        PyErr_NewException("optiml._core.ArgumentError", bases.ptr(), nullptr);
    m.attr("ArgumentError") = nb::handle(argument_error);
    // One translator for all of them (registered last, so it runs first): messages may quote bytes from a
    // file or a path that are not UTF-8, which PyErr_SetString (nanobind's default) would turn into a
    // UnicodeDecodeError; here such bytes become \xNN escapes and the exception keeps its type.
    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const optiml::ArgumentError& e) {
            set_error(argument_error, e.what());
        } catch (const optiml::GGUFError& e) {
            set_error(gguf_error.ptr(), e.what());
        } catch (const optiml::UnsupportedModelError& e) {
            set_error(unsupported.ptr(), e.what());
        } catch (const optiml::ContextOverflowError& e) {
            set_error(overflow.ptr(), e.what());
        } catch (const optiml::Error& e) {
            set_error(optiml_error.ptr(), e.what());
        }
    });
}
