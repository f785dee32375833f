// GGUF, the file format llama.cpp stores models in (versions 2 and 3, little-endian).
//
// GGUFFile maps a file read-only and parses its header once. Every count, length, offset and
// dimension is checked against the file size before it is used, so a malformed file becomes a
// GGUFError naming the problem, never a crash or a huge allocation. Metadata values and tensor data
// point into the mapping: nothing is copied, and they stay valid while the GGUFFile lives (tensor
// data also while someone holds mapping()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "optiml/common.h"
#include "optiml/ggml_types.h"

namespace optiml {

// Metadata value types, numbered as GGUF stores them.
enum GGUFValueType : uint32_t {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT = 13,
};

// "uint8", ..., "float64"; "unknown" for ids past the enum.
const char* gguf_type_name(uint32_t type);
// Bytes of one value of a fixed-size type; 0 for STRING, ARRAY and unknown ids.
size_t gguf_type_size(uint32_t type);
bool gguf_type_is_integer(uint32_t type);

// A whole file mapped read-only.
class MappedFile {
public:
    // Throws std::system_error when the OS refuses (missing file, no permission, a directory) and
    // GGUFError when the path is not a regular file.
    //
    // in_memory: read the whole file into private memory instead of mapping it; on Linux that memory
    // is advised to use 2 MiB pages. A decoding step streams every weight once, and over a file mapping's
    // 4 KiB pages the matrix-vector kernels reach about 80% of the rate they reach over 2 MiB pages (a
    // 7B Q4_0 model, 2 threads, AVX-512: 28 against 35 GB/s). The cost: the file is read up front, and
    // the copy is not shared with the page cache or other processes. Elsewhere than on POSIX the file
    // is mapped either way.
    explicit MappedFile(const std::string& path, bool in_memory = false);
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const uint8_t* data() const { return data_; }
    uint64_t size() const { return size_; }
    // Whether the bytes are a private copy (in_memory) rather than a mapping of the file.
    bool in_memory() const { return in_memory_; }

private:
    const uint8_t* data_ = nullptr;
    uint64_t size_ = 0;
    bool in_memory_ = false;
};

// One metadata value. Scalars, strings and arrays of fixed-size elements are the raw
// little-endian bytes in the mapping (possibly unaligned: read them with memcpy or scalar<T>()).
struct GGUFValue {
    GGUFValueType type = GGUF_TYPE_UINT8;
    GGUFValueType elem_type = GGUF_TYPE_UINT8;  // arrays: type of the elements
    uint64_t n = 0;                             // strings: bytes; arrays: elements
    const uint8_t* data = nullptr;              // scalars, strings, arrays of fixed-size elements
    std::vector<std::string_view> strings;      // arrays of strings
    std::vector<GGUFValue> arrays;              // arrays of arrays

    template <typename T>
    T scalar() const {
        T v;
        std::memcpy(&v, data, sizeof(T));
        return v;
    }
    template <typename T>
    T element(uint64_t i) const {
        T v;
        std::memcpy(&v, data + i * sizeof(T), sizeof(T));
        return v;
    }
    std::string_view str() const { return std::string_view((const char*)data, n); }
};

struct GGUFKeyValue {
    std::string key;
    GGUFValue value;
};

struct GGUFTensorInfo {
    std::string name;
    uint32_t n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ggml order, innermost first; dims past n_dims are 1
    int32_t type = TYPE_F32;       // a GGMLType
    uint64_t offset = 0;           // relative to the data section, as stored in the file
    uint64_t file_offset = 0;      // absolute offset in the file
    uint64_t n_bytes = 0;

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
};

class GGUFFile {
public:
    // Maps `path` (with in_memory, reads it: see MappedFile) and parses it. Throws std::system_error when
    // the file cannot be opened and GGUFError (message starting with the path) when it is not a valid
    // GGUF file.
    static std::shared_ptr<GGUFFile> open(const std::string& path, bool in_memory = false);

    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }
    uint64_t file_size() const { return map_->size(); }

    // ---- metadata ----
    // In file order.
    const std::vector<GGUFKeyValue>& metadata() const { return kv_; }
    // nullptr when absent.
    const GGUFValue* find(std::string_view key) const;
    bool has(std::string_view key) const { return find(key) != nullptr; }
    // The getters below throw GGUFError naming the key when it is missing or holds another type.
    // Integer getters take any integer type whose value fits the result; float getters take
    // float32 and float64.
    const GGUFValue& get(std::string_view key) const;
    std::string get_string(std::string_view key) const;
    uint32_t get_u32(std::string_view key) const;
    uint64_t get_u64(std::string_view key) const;
    int32_t get_i32(std::string_view key) const;
    int64_t get_i64(std::string_view key) const;
    float get_f32(std::string_view key) const;
    double get_f64(std::string_view key) const;
    bool get_bool(std::string_view key) const;
    // With a fallback for a missing key (a present key of the wrong type still throws).
    std::string get_string(std::string_view key, const std::string& fallback) const;
    uint32_t get_u32(std::string_view key, uint32_t fallback) const;
    float get_f32(std::string_view key, float fallback) const;
    bool get_bool(std::string_view key, bool fallback) const;
    // Arrays: elements converted as by the scalar getters.
    std::vector<std::string> get_string_array(std::string_view key) const;
    std::vector<float> get_f32_array(std::string_view key) const;
    std::vector<int32_t> get_i32_array(std::string_view key) const;
    std::vector<uint32_t> get_u32_array(std::string_view key) const;

    // ---- tensors ----
    // In file order.
    const std::vector<GGUFTensorInfo>& tensors() const { return tensors_; }
    // nullptr when absent.
    const GGUFTensorInfo* find_tensor(std::string_view name) const;
    // Throws GGUFError when absent.
    const GGUFTensorInfo& tensor(std::string_view name) const;
    const void* tensor_data(const GGUFTensorInfo& t) const { return map_->data() + t.file_offset; }
    const void* tensor_data(std::string_view name) const { return tensor_data(tensor(name)); }
    // Keeps the mapping alive independently of this object, e.g. for views handed to Python.
    std::shared_ptr<const MappedFile> mapping() const { return map_; }

private:
    GGUFFile() = default;
    void parse();

    std::string path_;
    std::shared_ptr<const MappedFile> map_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    std::vector<GGUFKeyValue> kv_;
    std::map<std::string, size_t, std::less<>> kv_index_;
    std::vector<GGUFTensorInfo> tensors_;
    std::map<std::string, size_t, std::less<>> tensor_index_;
};

// `s` in single quotes, cut to a readable length, with bytes that are not printable ASCII written
// as \xNN: names from a damaged file can hold anything, and messages must stay plain text.
std::string gguf_quote(std::string_view s);

}  // namespace optiml
