// optiml._core: the native core as a Python module. Python code should use the optiml package,
// which wraps this module; names here are not a stable API.
#include "bindings.h"

#include <Python.h>

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
}

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
    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const optiml::ArgumentError& e) {
            PyErr_SetString(argument_error, e.what());
        }
    });
}
