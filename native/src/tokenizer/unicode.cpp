// UTF-8 decoding and the category lookup behind the pre-tokenizers.
#include "tokenizer/unicode.h"

#include <memory>

namespace optiml {
namespace unicode {

namespace {

// A flat byte per code point (1.1 MB) built once from the range table: the pre-tokenizers look
// flags up for every character, and a binary search per character would dominate encoding time.
const uint8_t* flag_table() {
    static const std::unique_ptr<uint8_t[]> table = [] {
        std::unique_ptr<uint8_t[]> t(new uint8_t[kMaxCodepoint + 1]);
        for (size_t i = 0; i < kCategoryRangesCount; i++) {
            uint32_t end = i + 1 < kCategoryRangesCount ? kCategoryRanges[i + 1].first : kMaxCodepoint + 1;
            for (uint32_t cp = kCategoryRanges[i].first; cp < end; cp++) t[cp] = kCategoryRanges[i].flags;
        }
        return t;
    }();
    return table.get();
}

}  // namespace

uint8_t flags(uint32_t cp) {
    return cp <= kMaxCodepoint ? flag_table()[cp] : 0;
}

size_t valid_utf8_len(const char* s, size_t n) {
    if (n == 0) return 0;
    const uint8_t* p = (const uint8_t*)s;
    uint8_t b = p[0];
    if (b < 0x80) return 1;
    size_t len;
    uint32_t cp, min;
    if ((b & 0xE0) == 0xC0) { len = 2; cp = b & 0x1F; min = 0x80; }
    else if ((b & 0xF0) == 0xE0) { len = 3; cp = b & 0x0F; min = 0x800; }
    else if ((b & 0xF8) == 0xF0) { len = 4; cp = b & 0x07; min = 0x10000; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    if (cp < min || cp > kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

uint32_t decode_utf8(const char* s, size_t n, size_t* len) {
    size_t l = valid_utf8_len(s, n);
    const uint8_t* p = (const uint8_t*)s;
    switch (l) {
        case 1: *len = 1; return p[0];
        case 2: *len = 2; return ((p[0] & 0x1F) << 6) | (p[1] & 0x3F);
        case 3: *len = 3; return ((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        case 4:
            *len = 4;
            return ((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
        default: *len = 1; return kReplacement;
    }
}

void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += (char)cp;
    } else if (cp < 0x800) {
        out += (char)(0xC0 | (cp >> 6));
        out += (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += (char)(0xE0 | (cp >> 12));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    } else {
        out += (char)(0xF0 | (cp >> 18));
        out += (char)(0x80 | ((cp >> 12) & 0x3F));
        out += (char)(0x80 | ((cp >> 6) & 0x3F));
        out += (char)(0x80 | (cp & 0x3F));
    }
}

void decode_all(std::string_view text, std::vector<uint32_t>& cpts, std::vector<uint32_t>& offsets) {
    cpts.clear();
    offsets.clear();
    cpts.reserve(text.size());
    offsets.reserve(text.size() + 1);
    size_t i = 0;
    while (i < text.size()) {
        size_t len;
        uint32_t cp = decode_utf8(text.data() + i, text.size() - i, &len);
        cpts.push_back(cp);
        offsets.push_back((uint32_t)i);
        i += len;
    }
    offsets.push_back((uint32_t)text.size());
}

}  // namespace unicode
}  // namespace optiml
