// Errors shared by the whole native core. Each becomes a Python exception in optiml._core
// (see native/bindings/module.cpp): Error -> optiml.OptimlError, GGUFError -> optiml.GGUFError,
// UnsupportedModelError -> optiml.UnsupportedModelError, ArgumentError -> optiml.ArgumentError (also a
// ValueError).
#pragma once

#include <cstdarg>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace optiml {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A malformed, truncated or unsupported GGUF file.
struct GGUFError : Error {
    using Error::Error;
};

// A valid file holding a model this build cannot run (architecture, tokenizer, tensor type).
struct UnsupportedModelError : Error {
    using Error::Error;
};

// More tokens than the context (n_ctx) holds.
struct ContextOverflowError : Error {
    using Error::Error;
};

// A caller passed something the function cannot accept (bad type, size, shape).
struct ArgumentError : Error {
    using Error::Error;
};

// printf-style message building for exceptions.
inline std::string format(const char* fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return std::string(buf);
}

}  // namespace optiml
