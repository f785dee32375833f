// Text <-> token ids from the tokenizer stored in a GGUF file, as llama.cpp reads it.
//
// Two models: byte-level BPE (tokenizer.ggml.model = "gpt2": GPT-2 byte-to-unicode mapping, merges
// by rank, a regex-style pre-tokenizer named by tokenizer.ggml.pre) and SentencePiece
// (tokenizer.ggml.model = "llama": merges by token score, U+2581 for spaces, <0xXX> byte fallback).
// Control, user-defined and unknown tokens are matched in the raw text before either runs.
//
// Loading validates the metadata (array lengths, ids in range, token types, merges) and throws
// GGUFError for a malformed file and UnsupportedModelError for a model or pre-tokenizer this build
// does not implement, naming the ones it does. After loading, a Tokenizer is immutable and every
// const method is safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "optiml/common.h"

namespace optiml {

class GGUFFile;

// Token types as GGUF stores them (tokenizer.ggml.token_type).
enum TokenType : int32_t {
    TOKEN_TYPE_UNDEFINED = 0,
    TOKEN_TYPE_NORMAL = 1,
    TOKEN_TYPE_UNKNOWN = 2,
    TOKEN_TYPE_CONTROL = 3,
    TOKEN_TYPE_USER_DEFINED = 4,
    TOKEN_TYPE_UNUSED = 5,
    TOKEN_TYPE_BYTE = 6,
};

class Tokenizer {
public:
    struct Impl;

    // Reads tokenizer.ggml.* from an open file. The Tokenizer copies what it needs: it does not keep
    // the file alive.
    static std::unique_ptr<Tokenizer> from_gguf(const GGUFFile& f);
    // Opens the file at `path` and reads its tokenizer.
    static std::unique_ptr<Tokenizer> from_file(const std::string& path);

    ~Tokenizer();
    Tokenizer(const Tokenizer&) = delete;
    Tokenizer& operator=(const Tokenizer&) = delete;

    // add_special: prepend BOS / append EOS as the file's add_bos_token / add_eos_token say.
    // parse_special: text spelling a control token (e.g. "<|im_start|>") becomes that token;
    // otherwise it is tokenized as plain text. User-defined tokens are always matched, as in
    // llama.cpp and HF tokenizers. Any byte string is accepted (invalid UTF-8 is encoded byte-wise
    // by BPE and through byte fallback by SentencePiece).
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

    // The pieces BPE would merge within (the pre-tokenizer's split of `text`, special tokens not
    // considered); SentencePiece merges over the whole text, so there it is {text}. For debugging
    // and tests.
    std::vector<std::string> pre_tokenize(std::string_view text) const;

    // The bytes a token stands for; may be part of a UTF-8 sequence. Control and unknown tokens give
    // "" unless render_special. Throws ArgumentError for an id outside [0, n_vocab).
    std::string token_to_piece(int32_t id, bool render_special) const;
    // The pieces concatenated (SentencePiece: without the space its encoder put in front). Raw
    // bytes: a cut-off sequence stays as it is. Throws ArgumentError for an out-of-range id.
    std::string decode(const std::vector<int32_t>& ids, bool render_special) const;

    int32_t n_vocab() const;
    int32_t bos_id() const;  // -1 when absent
    int32_t eos_id() const;
    int32_t eot_id() const;
    int32_t unk_id() const;
    int32_t pad_id() const;
    bool add_bos() const;
    bool add_eos() const;
    bool add_space_prefix() const;  // SentencePiece only
    // End of generation: eos, eot, eom and the tokens llama.cpp recognises by their text
    // (<|im_end|>, <|eot_id|>, <|endoftext|>, <end_of_turn>, ...).
    bool is_eog(int32_t id) const;
    std::vector<int32_t> eog_ids() const;
    bool is_control(int32_t id) const;
    TokenType token_type(int32_t id) const;
    float token_score(int32_t id) const;
    const std::string& token_text(int32_t id) const;  // as stored in the file
    // Id of the token stored with exactly this text, -1 when none.
    int32_t token_id(std::string_view text) const;
    std::string model_name() const;  // "gpt2" or "llama"
    std::string pre_name() const;    // tokenizer.ggml.pre as given ("default" when absent); "" for llama

private:
    explicit Tokenizer(std::unique_ptr<Impl> impl);
    void check_id(int32_t id) const;
    std::unique_ptr<Impl> impl_;
};

// Streams text from token ids as they are generated: push() returns only complete UTF-8, holding
// back a sequence cut between tokens until its last byte arrives. Bytes that can never become
// valid UTF-8 come out as U+FFFD (one per maximal ill-formed subsequence, as Python's
// errors="replace" does), so everything returned is valid UTF-8.
class Detokenizer {
public:
    explicit Detokenizer(const Tokenizer& tok, bool render_special = false);
    // Throws ArgumentError for an out-of-range id.
    std::string push(int32_t id);
    // Whatever is still held back (a cut-off sequence) as U+FFFD; the stream starts over.
    std::string flush();
    void reset();
    size_t pending_bytes() const { return pending_.size(); }

private:
    const Tokenizer& tok_;
    bool render_special_;
    bool at_start_ = true;
    std::string pending_;
};

// Appends to `out` the valid UTF-8 at the front of `bytes` and consumes it, replacing ill-formed
// subsequences by U+FFFD. With `final` false an incomplete sequence at the end stays in `bytes`.
void utf8_drain(std::string& bytes, std::string& out, bool final);

}  // namespace optiml
