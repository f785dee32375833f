// UTF-8 decoding and the category lookup behind the pre-tokenizers.
#include "tokenizer/unicode.h"

#include <map>
#include <vector>

namespace optiml {
namespace unicode {

namespace {

// The pre-tokenizers look flags up for every character, and a binary search over the ranges per
// character would dominate encoding time. So the flags are expanded once into blocks of 256 code
// points, each distinct block stored once (about 150 of the 4352: most of the code space is
// unassigned or a run of one category): 85 KB where a flat table would take 2.2 MB, read with two
// loads.
constexpr uint32_t kBlockBits = 8;
constexpr uint32_t kBlockSize = 1u << kBlockBits;

struct FlagTable {
    std::vector<uint16_t> block_of;  // per block of code points: its number among the distinct ones
    std::vector<uint16_t> blocks;    // the distinct blocks' flags, one block after the other
};

FlagTable build_flag_table() {
    FlagTable t;
    const uint32_t n_blocks = (kMaxCodepoint + 1) >> kBlockBits;
    t.block_of.resize(n_blocks);
    std::map<std::vector<uint16_t>, uint16_t> seen;
    std::vector<uint16_t> block(kBlockSize);
    size_t r = 0;  // the range holding the code point being filled in
    for (uint32_t b = 0; b < n_blocks; b++) {
        for (uint32_t i = 0; i < kBlockSize; i++) {
            const uint32_t cp = (b << kBlockBits) | i;
            while (r + 1 < kCategoryRangesCount && kCategoryRanges[r + 1].first <= cp) r++;
            block[i] = kCategoryRanges[r].flags;
        }
        auto res = seen.emplace(block, (uint16_t)seen.size());
        if (res.second) t.blocks.insert(t.blocks.end(), block.begin(), block.end());
        t.block_of[b] = res.first->second;
    }
    return t;
}

}  // namespace

uint16_t flags(uint32_t cp) {
    static const FlagTable table = build_flag_table();
    if (cp > kMaxCodepoint) return 0;
    return table.blocks[((size_t)table.block_of[cp >> kBlockBits] << kBlockBits) | (cp & (kBlockSize - 1))];
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

namespace {
// The code point of the sequence at p[0] as llama.cpp's unicode_cpt_from_utf8 reads it (lead and
// continuation bits only), and its length; 0 where it throws.
size_t lenient_utf8(const uint8_t* p, size_t n, uint32_t& cp) {
    const uint8_t b = p[0];
    size_t len;
    if (b < 0x80) { cp = b; return 1; }
    if (!(b & 0x40)) return 0;
    if (!(b & 0x20)) { len = 2; cp = b & 0x1F; }
    else if (!(b & 0x10)) { len = 3; cp = b & 0x0F; }
    else if (!(b & 0x08)) { len = 4; cp = b & 0x07; }
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    return cp <= kMaxCodepoint ? len : 0;
}
}  // namespace

bool bpe_input_text(std::string_view text, std::string& out) {
    const uint8_t* p = (const uint8_t*)text.data();
    const size_t n = text.size();
    size_t i = 0, copied = 0;  // text[copied, i) is still to be copied as it is
    bool changed = false;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        const size_t len = lenient_utf8(p + i, n - i, cp);
        if (len > 0 && (valid_utf8_len(text.data() + i, n - i) == len || (cp >= 0xD800 && cp <= 0xDFFF))) {
            i += len;  // well formed, or a surrogate (a 3-byte form is its shortest): written back as it is
            continue;
        }
        if (!changed) {
            out.clear();
            out.reserve(n + 8);
            changed = true;
        }
        out.append(text.data() + copied, i - copied);
        append_utf8(out, len > 0 ? cp : kReplacement);
        i += len > 0 ? len : 1;
        copied = i;
    }
    if (changed) out.append(text.data() + copied, n - copied);
    return changed;
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
        const uint8_t* p = (const uint8_t*)text.data() + i;
        if (len == 1 && cp == kReplacement && text.size() - i >= 3 && p[0] == 0xED && (p[1] & 0xE0) == 0xA0 &&
            (p[2] & 0xC0) == 0x80) {
            // A surrogate written as UTF-8: one code point, as llama.cpp reads it (bpe_input_text keeps them)
            cp = 0xD000 | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
            len = 3;
        }
        cpts.push_back(cp);
        offsets.push_back((uint32_t)i);
        i += len;
    }
    offsets.push_back((uint32_t)text.size());
}

}  // namespace unicode
}  // namespace optiml
