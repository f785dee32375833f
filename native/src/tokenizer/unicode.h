// Unicode helpers the tokenizer needs: UTF-8 decoding that never fails, and general-category flags
// per code point (the \p{L}, \p{N}, \s ... of the pre-tokenizer regexes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace optiml {
namespace unicode {

enum : uint16_t {
    FLAG_LETTER = 1 << 0,      // \p{L}
    FLAG_NUMBER = 1 << 1,      // \p{N}
    FLAG_PUNCT = 1 << 2,       // \p{P}
    FLAG_SYMBOL = 1 << 3,      // \p{S}
    FLAG_MARK = 1 << 4,        // \p{M}
    FLAG_SEPARATOR = 1 << 5,   // \p{Z}
    FLAG_OTHER = 1 << 6,       // \p{C} except unassigned
    FLAG_WHITESPACE = 1 << 7,  // \s (Unicode White_Space)
    // The category of a letter, beside FLAG_LETTER (the case-aware pre-tokenizers need them).
    FLAG_LU = 1 << 8,   // \p{Lu} uppercase
    FLAG_LL = 1 << 9,   // \p{Ll} lowercase
    FLAG_LT = 1 << 10,  // \p{Lt} titlecase
    FLAG_LM = 1 << 11,  // \p{Lm} modifier
    FLAG_LO = 1 << 12,  // \p{Lo} other
};

struct CodepointRange {
    uint32_t first;
    uint16_t flags;
};
// Generated (unicode_tables.cpp): sorted, the first starts at 0, each runs to the next's first.
extern const CodepointRange kCategoryRanges[];
extern const size_t kCategoryRangesCount;

constexpr uint32_t kMaxCodepoint = 0x10FFFF;
constexpr uint32_t kReplacement = 0xFFFD;

// Flags of a code point; 0 for unassigned ones and for values past U+10FFFF.
uint16_t flags(uint32_t cp);

// Length of the UTF-8 sequence starting at s[0] if it is well formed (1..4), else 0: truncated,
// overlong, a surrogate, past U+10FFFF, or a stray continuation byte.
size_t valid_utf8_len(const char* s, size_t n);

// Decodes one code point at s[0]; malformed input yields U+FFFD for one byte (*len = 1), so every
// byte string decodes and the byte offsets stay exact.
uint32_t decode_utf8(const char* s, size_t n, size_t* len);

void append_utf8(std::string& out, uint32_t cp);

// Text as llama.cpp reads it before a byte-level BPE vocabulary tokenizes it: each byte that does not
// start a sequence its next bytes complete (a stray continuation byte, a truncated sequence, 0xF8-0xFF,
// past U+10FFFF) is U+FFFD, and a complete sequence is its code point written in the shortest form
// (llama.cpp takes overlong forms and surrogates as code points). False when that is `text` itself;
// else true, with the text in `out`.
bool bpe_input_text(std::string_view text, std::string& out);

// Code points of `text` and, for each, the byte offset where it starts (plus one final entry: the
// text's size). Malformed bytes are U+FFFD each, as decode_utf8 reads them, but for a surrogate written
// as UTF-8, which is one code point here as in llama.cpp (bpe_input_text leaves them in the text).
void decode_all(std::string_view text, std::vector<uint32_t>& cpts, std::vector<uint32_t>& offsets);

}  // namespace unicode
}  // namespace optiml
