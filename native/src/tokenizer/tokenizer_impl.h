// What a loaded tokenizer holds; shared by the loader, the BPE and SentencePiece encoders and the
// decoder (one file each).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "optiml/tokenizer.h"
#include "tokenizer/pretokenize.h"

namespace optiml {

struct Tokenizer::Impl {
    enum class Model { BPE, SPM };
    Model model = Model::BPE;
    std::string model_name;  // as in the file
    std::string pre_name;
    PreTokenizer pre = PreTokenizer::GPT2;
    bool ignore_merges = false;  // llama3: a piece that is a whole token is not merged

    // ---- vocabulary ----
    std::vector<std::string> text;   // token text as stored
    std::vector<float> score;
    std::vector<uint8_t> type;       // TokenType
    std::vector<std::string> piece;  // bytes the token stands for (specials: their text)
    // Keys point into `text`, which never changes after loading.
    std::unordered_map<std::string_view, int32_t> text_to_id;

    // ---- BPE ----
    // Token of each single byte (BPE: its GPT-2 unicode stand-in; SPM: <0xXX>), -1 when missing.
    int32_t byte_token[256];
    struct Merge {
        int32_t rank;
        int32_t result;
    };
    // (left id << 32 | right id) -> rank and merged token. Ids instead of strings: encoding never
    // builds a string.
    std::unordered_map<uint64_t, Merge> merges;
    // Decoded bytes of normal tokens -> id, for ignore_merges. Keys point into `piece`.
    std::unordered_map<std::string_view, int32_t> bytes_to_id;

    // ---- special tokens ----
    int32_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1, pad = -1;
    bool add_bos = false, add_eos = false, add_space_prefix = false;
    std::vector<uint8_t> eog;  // per id
    // Tokens matched in raw text, by first byte, longest first: control and unknown ones only with
    // parse_special, user-defined ones always; rstrip: the whitespace after the token goes with it.
    struct Special {
        int32_t id;
        bool always;
        bool rstrip;
    };
    std::vector<Special> specials_by_byte[256];

    // Encoders of one fragment of plain text (between special tokens), appending to out.
    void encode_bpe(std::string_view text, std::vector<int32_t>& out) const;
    void encode_spm(std::string_view text, std::vector<int32_t>& out) const;
    void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
};

// The GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the others map to
// U+0100.. in byte order, so every byte becomes a visible character.
uint32_t gpt2_byte_to_codepoint(uint8_t b);
// -1 when the code point is not one of the 256.
int gpt2_codepoint_to_byte(uint32_t cp);

}  // namespace optiml
