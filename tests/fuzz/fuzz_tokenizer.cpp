// libFuzzer harness: real tokenizers on arbitrary bytes. The tokenizers come from the GGUF files named
// in OPTIML_FUZZ_TOKENIZERS (colon-separated; tools/checks/fuzz.py passes the reference models: SmolLM2's
// byte-level BPE and Gemma 3's SentencePiece). The first input byte picks one, the rest is the text.
// Checked: encode never fails or crashes, with and without special-token parsing; every id is in the
// vocabulary; decoding and streaming detokenization accept the ids; byte-level BPE gives back exactly
// the bytes it was given (the oracle: byte-level BPE is lossless on any byte string).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "optiml/tokenizer.h"

using namespace optiml;

namespace {

// GPT-2's byte-to-character map (the text byte-level BPE vocabularies store bytes as): printable
// Latin-1 bytes stand for themselves, the others for U+0100 upwards in byte order.
std::string gpt2_byte_text(uint8_t b) {
    auto printable = [](unsigned c) { return (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174; };
    unsigned cp = b;
    if (!printable(b)) {
        cp = 256;
        for (unsigned c = 0; c < b; c++) cp += !printable(c);
    }
    std::string s;
    if (cp < 0x80) s += (char)cp;
    else { s += (char)(0xc0 | (cp >> 6)); s += (char)(0x80 | (cp & 0x3f)); }
    return s;
}

// The bytes of `text` that have a token of their own in a byte-level BPE vocabulary.
std::string representable(const Tokenizer& tok, std::string_view text) {
    std::string out;
    for (char c : text)
        if (tok.token_id(gpt2_byte_text((uint8_t)c)) >= 0) out += c;
    return out;
}

std::vector<std::unique_ptr<Tokenizer>>& tokenizers() {
    static std::vector<std::unique_ptr<Tokenizer>> toks = [] {
        std::vector<std::unique_ptr<Tokenizer>> out;
        const char* env = std::getenv("OPTIML_FUZZ_TOKENIZERS");
        if (!env || !*env) {
            std::fprintf(stderr, "fuzz_tokenizer: set OPTIML_FUZZ_TOKENIZERS to GGUF paths (colon-separated)\n");
            std::abort();
        }
        std::string s(env);
        size_t start = 0;
        while (start <= s.size()) {
            size_t end = s.find(':', start);
            if (end == std::string::npos) end = s.size();
            if (end > start) out.push_back(Tokenizer::from_file(s.substr(start, end - start)));
            start = end + 1;
        }
        return out;
    }();
    return toks;
}

}  // namespace

// Loading the vocabularies (Gemma 3's has 262k tokens) happens before the first input, outside its
// time limit.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
    tokenizers();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    auto& toks = tokenizers();
    if (size == 0) return 0;
    const Tokenizer& tok = *toks[data[0] % toks.size()];
    std::string_view text((const char*)data + 1, size - 1);
    for (int special = 0; special < 2; special++) {
        std::vector<int32_t> ids = tok.encode(text, special, special);
        for (int32_t id : ids)
            if (id < 0 || id >= tok.n_vocab()) std::abort();
        std::string back = tok.decode(ids, special);
        if (!special && tok.model_name() == "gpt2" && back != representable(tok, text)) {
            std::fprintf(stderr, "byte-level BPE lost bytes: %zu in, %zu out\n", text.size(), back.size());
            std::abort();
        }
        Detokenizer detok(tok, special);
        std::string streamed;
        for (int32_t id : ids) streamed += detok.push(id);
        streamed += detok.flush();
    }
    (void)tok.pre_tokenize(text);
    return 0;
}
