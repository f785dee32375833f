// One function per concern registers its part of optiml._core (see module.cpp).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "optiml/kernels.h"
#include "optiml/threadpool.h"

namespace nb = nanobind;

void bind_errors(nb::module_& m);
void bind_system(nb::module_& m);
void bind_kernels(nb::module_& m);
void bind_quant(nb::module_& m);
void bind_gguf(nb::module_& m);
void bind_tokenizer(nb::module_& m);
void bind_sampling(nb::module_& m);
void bind_model(nb::module_& m);
void bind_sparse(nb::module_& m);
void bind_generate(nb::module_& m);
void bind_cuda_dequant(nb::module_& m);
void bind_cuda_timing(nb::module_& m);

// The kernel table of a SIMD level by name ("" = the best available); ArgumentError when unknown
// or unavailable (bind_kernels.cpp).
const optiml::KernelTable& table_for(const std::string& simd);
// A pool of n_threads threads, kept across calls (0 = the default pool) (bind_kernels.cpp).
std::shared_ptr<optiml::ThreadPool> pool_for(int n_threads);

// The native objects behind an optiml._core.Session (bind_model.cpp), an optiml._core.Tokenizer and an
// optiml._core.Detokenizer (bind_tokenizer.cpp); nb::cast_error for another type. The Python object owns
// them: keep a reference to it for as long as they are used.
namespace optiml {
class Session;
class Tokenizer;
class Detokenizer;
}  // namespace optiml
optiml::Session& native_session(nb::handle session);
std::shared_ptr<const optiml::Tokenizer> native_tokenizer(nb::handle tokenizer);
optiml::Detokenizer& native_detokenizer(nb::handle detokenizer);

// While alive (made with the GIL held), a decode on `session` checks Python's signals between its
// n_batch-token pieces and raises what a handler raises (Ctrl-C: KeyboardInterrupt), so a long prompt
// stops within a piece instead of after the whole of it. Only on the main thread, where Python runs
// signal handlers: elsewhere (the server's threads) it does nothing and costs nothing (bind_model.cpp).
class InterruptScope {
public:
    explicit InterruptScope(optiml::Session& session);
    ~InterruptScope();
    InterruptScope(const InterruptScope&) = delete;
    InterruptScope& operator=(const InterruptScope&) = delete;

private:
    optiml::Session* session_ = nullptr;
};

// A new C-contiguous numpy array of T that owns its memory (freed when numpy drops it).
template <typename T>
nb::ndarray<nb::numpy, T> new_array(std::initializer_list<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* data = new T[n > 0 ? n : 1]();
    nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
    return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.begin(), owner);
}

// A new numpy array of `shape` (default: 1-D of v's size) holding a copy of v.
template <typename T>
nb::ndarray<nb::numpy, T> to_array(const std::vector<T>& v, std::initializer_list<size_t> shape = {}) {
    auto a = shape.size() ? new_array<T>(shape) : new_array<T>({v.size()});
    std::copy(v.begin(), v.end(), a.data());
    return a;
}
