// Pre-tokenizers of byte-level BPE: the regexes llama.cpp runs before BPE (tokenizer.ggml.pre),
// written by hand over code points and Unicode categories. No std::regex: it is slow and knows no
// \p{L}. Each splitter follows its regex's leftmost-first alternation and greedy repetition, with
// lookahead limited to the current piece, as both llama.cpp and HF tokenizers apply them.
#pragma once

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace optiml {

enum class PreTokenizer {
    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    GPT2,
    // \p{N} first (every digit alone), then GPT2 on each piece: smollm, starcoder, refact, command-r...
    DIGITS_GPT2,
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    LLAMA3,
    // LLAMA3 with \p{N} instead of \p{N}{1,3}.
    QWEN2,
    // OpenAI's o200k (gpt-4o, gpt-oss), llama4: words split at case changes, a contraction ends a word.
    // [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    // [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|
    // \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
    // As the regex says (and HF tokenizers does); llama.cpp runs an approximation (see pretokenize.cpp).
    GPT4O,
    // llama.cpp's fallback for "default" / no pre-tokenizer: [\p{P}\$\+<=>\^~\|]+, GPT2, \p{N}+, [0-9][0-9][0-9]
    DEFAULT,
    // [\p{P}\$\+<=>\^~\|`]+, GPT2, [0-9][0-9][0-9]
    FALCON,
};

// Byte ranges [begin, end) of the pieces of `text`, in order, covering it without gaps.
using Pieces = std::vector<std::pair<uint32_t, uint32_t>>;
void pretokenize(PreTokenizer kind, std::string_view text, Pieces& out);

}  // namespace optiml
