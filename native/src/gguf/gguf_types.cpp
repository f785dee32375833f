// GGUF metadata type names and sizes, and safe quoting of names for error messages.
#include <cstdio>

#include "optiml/gguf.h"

namespace optiml {

const char* gguf_type_name(uint32_t type) {
    static const char* const names[GGUF_TYPE_COUNT] = {
        "uint8", "int8",  "uint16", "int16",  "uint32", "int32",   "float32",
        "bool",  "string", "array", "uint64", "int64",  "float64",
    };
    return type < GGUF_TYPE_COUNT ? names[type] : "unknown";
}

size_t gguf_type_size(uint32_t type) {
    switch (type) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

bool gguf_type_is_integer(uint32_t type) {
    switch (type) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
            return true;
        default:
            return false;
    }
}

std::string gguf_quote(std::string_view s) {
    const size_t max_len = 96;
    std::string out = "'";
    for (size_t i = 0; i < s.size() && i < max_len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out += (char)c;
        } else {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\x%02x", c);
            out += buf;
        }
    }
    if (s.size() > max_len) out += "...";
    out += "'";
    return out;
}

}  // namespace optiml
