// Looking up metadata and tensors by name, with typed metadata getters for engine code.
#include <cinttypes>
#include <limits>
#include <type_traits>

#include "optiml/gguf.h"

namespace optiml {

namespace {

std::string key_msg(std::string_view key) { return "metadata key " + gguf_quote(key); }

// An integer of any GGUF integer type at p, checked to fit in T.
template <typename T>
T integer_as(const uint8_t* p, uint32_t type, std::string_view key) {
    int64_t s = 0;
    uint64_t u = 0;
    switch (type) {
        case GGUF_TYPE_UINT8: { uint8_t v; std::memcpy(&v, p, 1); u = v; break; }
        case GGUF_TYPE_UINT16: { uint16_t v; std::memcpy(&v, p, 2); u = v; break; }
        case GGUF_TYPE_UINT32: { uint32_t v; std::memcpy(&v, p, 4); u = v; break; }
        case GGUF_TYPE_UINT64: std::memcpy(&u, p, 8); break;
        case GGUF_TYPE_INT8: { int8_t v; std::memcpy(&v, p, 1); s = v; break; }
        case GGUF_TYPE_INT16: { int16_t v; std::memcpy(&v, p, 2); s = v; break; }
        case GGUF_TYPE_INT32: { int32_t v; std::memcpy(&v, p, 4); s = v; break; }
        case GGUF_TYPE_INT64: std::memcpy(&s, p, 8); break;
        default:
            throw GGUFError(format("%s holds %s, expected an integer", key_msg(key).c_str(),
                                   gguf_type_name(type)));
    }
    if (s < 0) {
        if (!std::is_signed<T>::value || s < (int64_t)std::numeric_limits<T>::min())
            throw GGUFError(format("%s value %" PRId64 " does not fit the requested type",
                                   key_msg(key).c_str(), s));
        return (T)s;
    }
    if (s > 0) u = (uint64_t)s;
    if (u > (uint64_t)std::numeric_limits<T>::max())
        throw GGUFError(format("%s value %" PRIu64 " does not fit the requested type",
                               key_msg(key).c_str(), u));
    return (T)u;
}

// A scalar integer value, checked to fit in T.
template <typename T>
T integer_of(const GGUFValue& v, std::string_view key) { return integer_as<T>(v.data, v.type, key); }

double float_at(const uint8_t* p, uint32_t type, std::string_view key) {
    if (type == GGUF_TYPE_FLOAT32) { float v; std::memcpy(&v, p, 4); return v; }
    if (type == GGUF_TYPE_FLOAT64) { double v; std::memcpy(&v, p, 8); return v; }
    throw GGUFError(format("%s holds %s, expected a float", key_msg(key).c_str(),
                           gguf_type_name(type)));
}

const GGUFValue& array_of(const GGUFValue& v, std::string_view key) {
    if (v.type != GGUF_TYPE_ARRAY)
        throw GGUFError(format("%s holds %s, expected an array", key_msg(key).c_str(),
                               gguf_type_name(v.type)));
    return v;
}

template <typename T>
std::vector<T> integer_array(const GGUFValue& v, std::string_view key) {
    const GGUFValue& a = array_of(v, key);
    if (!gguf_type_is_integer(a.elem_type))
        throw GGUFError(format("%s holds an array of %s, expected integers", key_msg(key).c_str(),
                               gguf_type_name(a.elem_type)));
    size_t size = gguf_type_size(a.elem_type);
    std::vector<T> out((size_t)a.n);
    for (uint64_t i = 0; i < a.n; i++) out[i] = integer_as<T>(a.data + i * size, a.elem_type, key);
    return out;
}

}  // namespace

const GGUFValue* GGUFFile::find(std::string_view key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].value;
}

const GGUFValue& GGUFFile::get(std::string_view key) const {
    const GGUFValue* v = find(key);
    if (!v) throw GGUFError(path_ + ": missing " + key_msg(key));
    return *v;
}

std::string GGUFFile::get_string(std::string_view key) const {
    const GGUFValue& v = get(key);
    if (v.type != GGUF_TYPE_STRING)
        throw GGUFError(format("%s holds %s, expected a string", key_msg(key).c_str(),
                               gguf_type_name(v.type)));
    return std::string(v.str());
}

uint32_t GGUFFile::get_u32(std::string_view key) const { return integer_of<uint32_t>(get(key), key); }
uint64_t GGUFFile::get_u64(std::string_view key) const { return integer_of<uint64_t>(get(key), key); }
int32_t GGUFFile::get_i32(std::string_view key) const { return integer_of<int32_t>(get(key), key); }
int64_t GGUFFile::get_i64(std::string_view key) const { return integer_of<int64_t>(get(key), key); }

float GGUFFile::get_f32(std::string_view key) const { return (float)get_f64(key); }

double GGUFFile::get_f64(std::string_view key) const {
    const GGUFValue& v = get(key);
    return float_at(v.data, v.type, key);
}

bool GGUFFile::get_bool(std::string_view key) const {
    const GGUFValue& v = get(key);
    if (v.type != GGUF_TYPE_BOOL)
        throw GGUFError(format("%s holds %s, expected a bool", key_msg(key).c_str(),
                               gguf_type_name(v.type)));
    return v.data[0] != 0;
}

std::string GGUFFile::get_string(std::string_view key, const std::string& fallback) const {
    return has(key) ? get_string(key) : fallback;
}

uint32_t GGUFFile::get_u32(std::string_view key, uint32_t fallback) const {
    return has(key) ? get_u32(key) : fallback;
}

float GGUFFile::get_f32(std::string_view key, float fallback) const {
    return has(key) ? get_f32(key) : fallback;
}

bool GGUFFile::get_bool(std::string_view key, bool fallback) const {
    return has(key) ? get_bool(key) : fallback;
}

std::vector<std::string> GGUFFile::get_string_array(std::string_view key) const {
    const GGUFValue& a = array_of(get(key), key);
    if (a.elem_type != GGUF_TYPE_STRING)
        throw GGUFError(format("%s holds an array of %s, expected strings", key_msg(key).c_str(),
                               gguf_type_name(a.elem_type)));
    return std::vector<std::string>(a.strings.begin(), a.strings.end());
}

std::vector<float> GGUFFile::get_f32_array(std::string_view key) const {
    const GGUFValue& a = array_of(get(key), key);
    if (a.elem_type != GGUF_TYPE_FLOAT32 && a.elem_type != GGUF_TYPE_FLOAT64)
        throw GGUFError(format("%s holds an array of %s, expected floats", key_msg(key).c_str(),
                               gguf_type_name(a.elem_type)));
    size_t size = gguf_type_size(a.elem_type);
    std::vector<float> out((size_t)a.n);
    for (uint64_t i = 0; i < a.n; i++) out[i] = (float)float_at(a.data + i * size, a.elem_type, key);
    return out;
}

std::vector<int32_t> GGUFFile::get_i32_array(std::string_view key) const {
    return integer_array<int32_t>(get(key), key);
}

std::vector<uint32_t> GGUFFile::get_u32_array(std::string_view key) const {
    return integer_array<uint32_t>(get(key), key);
}

const GGUFTensorInfo* GGUFFile::find_tensor(std::string_view name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GGUFTensorInfo& GGUFFile::tensor(std::string_view name) const {
    const GGUFTensorInfo* t = find_tensor(name);
    if (!t) throw GGUFError(path_ + ": no tensor named " + gguf_quote(name));
    return *t;
}

}  // namespace optiml
