// libFuzzer harness: real tokenizers on arbitrary bytes. The tokenizers come from the GGUF files named
// in OPTIML_FUZZ_TOKENIZERS (colon-separated; tools/checks/fuzz.py passes the reference models: SmolLM2's
// byte-level BPE and Gemma 3's SentencePiece). The first input byte picks one, the rest is the text.
// Checked: encode never fails or crashes, with and without special-token parsing; every id is in the
// vocabulary; decoding and streaming detokenization accept the ids; byte-level BPE gives back exactly
// the bytes it was given as llama.cpp reads them (the oracle: byte-level BPE is lossless on any byte
// string, after llama.cpp's reading of bytes that are not UTF-8, written here again from its rule).
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

// `text` as llama.cpp's unicode_cpts_from_utf8 reads it, written back as UTF-8: a lead byte with its
// continuation bytes is its code point (in the shortest form), any other byte U+FFFD.
std::string as_llama_cpp_reads(std::string_view text) {
    std::string out;
    const size_t n = text.size();
    for (size_t i = 0; i < n;) {
        const uint8_t b = (uint8_t)text[i];
        size_t len = b < 0x80 ? 1 : (b & 0xE0) == 0xC0 ? 2 : (b & 0xF0) == 0xE0 ? 3 : (b & 0xF8) == 0xF0 ? 4 : 0;
        uint32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
        if (len == 0 || i + len > n) len = 0;
        for (size_t k = 1; k < len; k++) {
            if (((uint8_t)text[i + k] & 0xC0) != 0x80) {
                len = 0;
                break;
            }
            cp = (cp << 6) | ((uint8_t)text[i + k] & 0x3F);
        }
        if (len == 0 || cp > 0x10FFFF) {
            out += "\xEF\xBF\xBD";
            i += 1;
            continue;
        }
        if (cp < 0x80) out += (char)cp;
        else if (cp < 0x800) { out += (char)(0xC0 | (cp >> 6)); out += (char)(0x80 | (cp & 0x3F)); }
        else if (cp < 0x10000) {
            out += (char)(0xE0 | (cp >> 12)); out += (char)(0x80 | ((cp >> 6) & 0x3F)); out += (char)(0x80 | (cp & 0x3F));
        } else {
            out += (char)(0xF0 | (cp >> 18)); out += (char)(0x80 | ((cp >> 12) & 0x3F));
            out += (char)(0x80 | ((cp >> 6) & 0x3F)); out += (char)(0x80 | (cp & 0x3F));
        }
        i += len;
    }
    return out;
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
        if (!special && tok.model_name() == "gpt2" && back != representable(tok, as_llama_cpp_reads(text))) {
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
