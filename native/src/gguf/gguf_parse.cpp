// Parsing a GGUF header: magic, version, metadata, tensor infos, then checks of the tensor data
// layout. Every read goes through Cursor, which refuses to step past the end of the file, and every
// count is compared with the bytes left before anything is sized by it.
#include <algorithm>
#include <cinttypes>

#include "optiml/gguf.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#error "the GGUF reader assumes a little-endian host"
#endif

namespace optiml {

namespace {

const uint32_t max_array_depth = 8;  // deeper nesting is never written; bounds recursion
const uint32_t max_dims = 4;

// Smallest encoding of one element: lets a count be checked against the bytes left.
uint64_t min_encoded_size(uint32_t type) {
    if (type == GGUF_TYPE_STRING) return 8;  // length
    if (type == GGUF_TYPE_ARRAY) return 12;  // element type + length
    return gguf_type_size(type);
}

bool valid_utf8(std::string_view s) {
    const unsigned char* p = (const unsigned char*)s.data();
    size_t n = s.size(), i = 0;
    while (i < n) {
        unsigned c = p[i];
        if (c < 0x80) { i++; continue; }
        size_t len;
        unsigned cp;
        if (c >= 0xc2 && c <= 0xdf) { len = 2; cp = c & 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { len = 3; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { len = 4; cp = c & 0x07; }
        else return false;
        if (n - i < len) return false;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xc0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3f);
        }
        // Overlong forms, UTF-16 surrogates and code points past U+10FFFF.
        if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10ffff ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += len;
    }
    return true;
}

struct Cursor {
    const uint8_t* base;
    uint64_t size;
    uint64_t pos = 0;

    uint64_t left() const { return size - pos; }

    const uint8_t* take(uint64_t n, const std::string& what) {
        if (n > left())
            throw GGUFError(format("file truncated: %s at byte offset %" PRIu64 " needs %" PRIu64
                                   " bytes, only %" PRIu64 " left",
                                   what.c_str(), pos, n, left()));
        const uint8_t* p = base + pos;
        pos += n;
        return p;
    }

    template <typename T>
    T read(const std::string& what) {
        T v;
        std::memcpy(&v, take(sizeof(T), what), sizeof(T));
        return v;
    }

    std::string_view string(const std::string& what) {
        uint64_t at = pos;
        uint64_t n = read<uint64_t>(what);
        if (n > left())
            throw GGUFError(format("%s at byte offset %" PRIu64 " has string length %" PRIu64
                                   ", more than the %" PRIu64 " bytes left in the file",
                                   what.c_str(), at, n, left()));
        return std::string_view((const char*)take(n, what), n);
    }
};

void check_bools(const uint8_t* p, uint64_t n, const std::string& what, uint64_t at) {
    for (uint64_t i = 0; i < n; i++)
        if (p[i] > 1)
            throw GGUFError(format("%s at byte offset %" PRIu64 " has invalid bool byte %u",
                                   what.c_str(), at + i, p[i]));
}

void parse_value(Cursor& c, uint32_t type, GGUFValue& out, const std::string& what, uint32_t depth) {
    out.type = (GGUFValueType)type;
    if (type == GGUF_TYPE_STRING) {
        std::string_view s = c.string(what);
        out.data = (const uint8_t*)s.data();
        out.n = s.size();
        return;
    }
    if (type != GGUF_TYPE_ARRAY) {
        uint64_t at = c.pos;
        out.data = c.take(gguf_type_size(type), what);
        if (type == GGUF_TYPE_BOOL) check_bools(out.data, 1, what, at);
        return;
    }

    uint64_t at = c.pos;
    uint32_t elem = c.read<uint32_t>(what);
    if (elem >= GGUF_TYPE_COUNT)
        throw GGUFError(format("%s: array at byte offset %" PRIu64 " has unknown value type %u",
                               what.c_str(), at, elem));
    if (elem == GGUF_TYPE_ARRAY && depth >= max_array_depth)
        throw GGUFError(format("%s: arrays nested more than %u deep at byte offset %" PRIu64,
                               what.c_str(), max_array_depth, at));
    uint64_t n = c.read<uint64_t>(what);
    if (n > c.left() / min_encoded_size(elem))
        throw GGUFError(format("%s: array at byte offset %" PRIu64 " has length %" PRIu64
                               " (%s elements), which cannot fit in the %" PRIu64 " bytes left",
                               what.c_str(), at, n, gguf_type_name(elem), c.left()));
    out.elem_type = (GGUFValueType)elem;
    out.n = n;
    if (elem == GGUF_TYPE_STRING) {
        // Capacity grows with what is actually parsed, not with the claimed count.
        out.strings.reserve((size_t)std::min<uint64_t>(n, 1 << 16));
        for (uint64_t i = 0; i < n; i++) out.strings.push_back(c.string(what));
    } else if (elem == GGUF_TYPE_ARRAY) {
        for (uint64_t i = 0; i < n; i++) {
            out.arrays.emplace_back();
            parse_value(c, GGUF_TYPE_ARRAY, out.arrays.back(), what, depth + 1);
        }
    } else {
        uint64_t data_at = c.pos;
        out.data = c.take(n * gguf_type_size(elem), what);
        if (elem == GGUF_TYPE_BOOL) check_bools(out.data, n, what, data_at);
    }
}

}  // namespace

std::shared_ptr<GGUFFile> GGUFFile::open(const std::string& path, bool in_memory) {
    std::shared_ptr<GGUFFile> f(new GGUFFile());
    f->path_ = path;
    f->map_ = std::make_shared<const MappedFile>(path, in_memory);
    try {
        f->parse();
    } catch (const GGUFError& e) {
        throw GGUFError(path + ": " + e.what());
    }
    return f;
}

namespace {

// A metadata key or tensor name (`what` and its index i say which in errors): a string of valid UTF-8,
// not yet in `index`. `named` is set to `noun` and the quoted name, how later errors name the entry.
std::string_view read_name(Cursor& c, const char* what, uint64_t i,
                           const std::map<std::string, size_t, std::less<>>& index, const char* noun,
                           std::string& named) {
    const uint64_t at = c.pos;
    const std::string_view s = c.string(format("%s %" PRIu64, what, i));
    if (!valid_utf8(s))
        throw GGUFError(format("%s %" PRIu64 " at byte offset %" PRIu64 " is not valid UTF-8: %s", what, i, at,
                               gguf_quote(s).c_str()));
    named = std::string(noun) + " " + gguf_quote(s);
    if (index.count(s)) throw GGUFError(format("duplicate %s at byte offset %" PRIu64, named.c_str(), at));
    return s;
}

// A tensor's shape and type after its name (what names it in errors): checked so that its element
// count and byte size cannot overflow; t.n_bytes set.
void read_tensor_shape(Cursor& c, GGUFTensorInfo& t, const std::string& what) {
    t.n_dims = c.read<uint32_t>(what);
    if (t.n_dims == 0 || t.n_dims > max_dims)
        throw GGUFError(format("%s has n_dims %u (must be 1 to %u)", what.c_str(), t.n_dims,
                               max_dims));
    for (uint32_t d = 0; d < t.n_dims; d++) {
        uint64_t ne = c.read<uint64_t>(what);
        if (ne > (uint64_t)INT64_MAX)
            throw GGUFError(format("%s has negative dimension ne[%u] = %" PRId64, what.c_str(),
                                   d, (int64_t)ne));
        t.ne[d] = (int64_t)ne;
    }
    // Rows are multiplied out on their own too, so n_rows() cannot overflow when ne[0] is 0.
    int64_t rows = 1;
    for (uint32_t d = 1; d <= max_dims; d++) {
        int64_t ne = t.ne[d % max_dims];
        if (ne != 0 && rows > INT64_MAX / ne)
            throw GGUFError(format("%s: element count overflows (shape %" PRId64 " x %" PRId64
                                   " x %" PRId64 " x %" PRId64 ")",
                                   what.c_str(), t.ne[0], t.ne[1], t.ne[2], t.ne[3]));
        if (d < max_dims) rows *= ne;
    }

    uint32_t type = c.read<uint32_t>(what);
    if (type > (uint32_t)INT32_MAX || !type_is_known((int32_t)type))
        throw GGUFError(format("%s has unknown tensor type %u", what.c_str(), type));
    t.type = (int32_t)type;
    const TypeTraits& tt = type_traits(t.type);
    if (t.ne[0] % tt.block_size != 0)
        throw GGUFError(format("%s: ne[0] = %" PRId64 " is not a multiple of the %s block size %"
                               PRId64, what.c_str(), t.ne[0], tt.name, tt.block_size));
    uint64_t blocks = (uint64_t)(t.ne[0] / tt.block_size);
    if (blocks > UINT64_MAX / tt.type_size)
        throw GGUFError(format("%s: byte size overflows", what.c_str()));
    uint64_t row_bytes = blocks * tt.type_size;
    if (rows != 0 && row_bytes > UINT64_MAX / (uint64_t)rows)
        throw GGUFError(format("%s: byte size overflows", what.c_str()));
    t.n_bytes = row_bytes * (uint64_t)rows;

}

// Every tensor's data within the file (the data section at data_offset), aligned; t.file_offset set.
void place_tensor_data(std::vector<GGUFTensorInfo>& tensors, uint64_t data_offset, uint64_t alignment, uint64_t size) {
    for (GGUFTensorInfo& t : tensors) {
        std::string what = "tensor " + gguf_quote(t.name);
        if (t.offset % alignment != 0)
            throw GGUFError(format("%s: data offset %" PRIu64 " is not a multiple of the alignment %"
                                   PRIu64, what.c_str(), t.offset, alignment));
        if (data_offset > size || t.offset > size - data_offset ||
            t.n_bytes > size - data_offset - t.offset)
            throw GGUFError(format("%s: data (%" PRIu64 " bytes at data offset %" PRIu64
                                   ") extends past the end of the file (%" PRIu64
                                   " bytes, data section at %" PRIu64 ")",
                                   what.c_str(), t.n_bytes, t.offset, size, data_offset));
        t.file_offset = data_offset + t.offset;
    }

}

// No two tensors' bytes overlap.
void check_no_overlap(const std::vector<GGUFTensorInfo>& tensors) {
    // Sorted by start, two ranges overlap exactly when some pair of neighbours does.
    std::vector<const GGUFTensorInfo*> by_offset;
    for (const GGUFTensorInfo& t : tensors)
        if (t.n_bytes > 0) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GGUFTensorInfo* a, const GGUFTensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); i++) {
        const GGUFTensorInfo* a = by_offset[i - 1];
        const GGUFTensorInfo* b = by_offset[i];
        if (b->offset < a->offset + a->n_bytes)
            throw GGUFError(format("tensors %s and %s overlap: [%" PRIu64 ", %" PRIu64 ") and [%"
                                   PRIu64 ", %" PRIu64 ") in the data section",
                                   gguf_quote(a->name).c_str(), gguf_quote(b->name).c_str(),
                                   a->offset, a->offset + a->n_bytes, b->offset,
                                   b->offset + b->n_bytes));
    }
}

}  // namespace

void GGUFFile::parse() {
    Cursor c{map_->data(), map_->size()};

    const uint8_t* magic = c.take(4, "magic");
    if (std::memcmp(magic, "GGUF", 4) != 0)
        throw GGUFError(format("not a GGUF file: bad magic %s (expected 'GGUF')",
                               gguf_quote(std::string_view((const char*)magic, 4)).c_str()));

    version_ = c.read<uint32_t>("version");
    if (version_ != 2 && version_ != 3) {
        uint32_t swapped = (version_ >> 24) | ((version_ >> 8) & 0xff00) |
                           ((version_ << 8) & 0xff0000) | (version_ << 24);
        if (swapped >= 1 && swapped <= 3)
            throw GGUFError("big-endian GGUF files are not supported");
        throw GGUFError(format("unsupported GGUF version %u (only versions 2 and 3 are supported)",
                               version_));
    }

    uint64_t n_tensors = c.read<uint64_t>("tensor count");
    uint64_t n_kv = c.read<uint64_t>("metadata count");
    // Smallest tensor info: name length, n_dims, one dimension, type, offset. Smallest entry:
    // key length, value type, a one-byte value.
    if (n_tensors > c.left() / 32)
        throw GGUFError(format("tensor count %" PRIu64 " cannot fit in a file of %" PRIu64 " bytes",
                               n_tensors, c.size));
    if (n_kv > c.left() / 13)
        throw GGUFError(format("metadata count %" PRIu64 " cannot fit in a file of %" PRIu64
                               " bytes", n_kv, c.size));

    for (uint64_t i = 0; i < n_kv; i++) {
        std::string what;
        const std::string_view key = read_name(c, "key of metadata entry", i, kv_index_, "metadata key", what);
        uint64_t type_at = c.pos;
        uint32_t type = c.read<uint32_t>(what);
        if (type >= GGUF_TYPE_COUNT)
            throw GGUFError(format("%s has unknown value type %u at byte offset %" PRIu64,
                                   what.c_str(), type, type_at));
        kv_.push_back(GGUFKeyValue{std::string(key), GGUFValue()});
        kv_index_.emplace(kv_.back().key, kv_.size() - 1);
        parse_value(c, type, kv_.back().value, what, 0);
    }

    if (const GGUFValue* a = find("general.alignment")) {
        if (a->type != GGUF_TYPE_UINT32)
            throw GGUFError(format("general.alignment must be a uint32, not %s",
                                   gguf_type_name(a->type)));
        uint32_t v = a->scalar<uint32_t>();
        if (v == 0 || (v & (v - 1)) != 0)
            throw GGUFError(format("general.alignment %u is not a power of two", v));
        alignment_ = v;
    }

    for (uint64_t i = 0; i < n_tensors; i++) {
        std::string what;
        const std::string_view name = read_name(c, "name of tensor", i, tensor_index_, "tensor", what);
        GGUFTensorInfo t;
        t.name = std::string(name);

        read_tensor_shape(c, t, what);
        t.offset = c.read<uint64_t>(what);
        tensors_.push_back(std::move(t));
        tensor_index_.emplace(tensors_.back().name, tensors_.size() - 1);
    }

    // The data section starts at the first aligned offset after the header.
    data_offset_ = (c.pos + alignment_ - 1) / alignment_ * alignment_;
    place_tensor_data(tensors_, data_offset_, alignment_, c.size);

    check_no_overlap(tensors_);
}

}  // namespace optiml
