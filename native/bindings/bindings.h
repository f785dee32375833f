// One function per concern registers its part of optiml._core (see module.cpp).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace nb = nanobind;

void bind_errors(nb::module_& m);
void bind_system(nb::module_& m);
void bind_kernels(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_gguf(nb::module_& m);
void bind_tokenizer(nb::module_& m);
void bind_sampling(nb::module_& m);
void bind_model(nb::module_& m);

// A new C-contiguous numpy array of T that owns its memory (freed when numpy drops it).
template <typename T>
nb::ndarray<nb::numpy, T> new_array(std::initializer_list<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* data = new T[n > 0 ? n : 1]();
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
    return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.begin(), owner);
}
