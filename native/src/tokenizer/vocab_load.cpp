// Tokenizer::from_gguf: reads and validates tokenizer.ggml.*, decides the special tokens the way
// llama.cpp does (llama_vocab::load), and precomputes what encoding and decoding look up.
#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "optiml/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace optiml {

namespace {

struct PreEntry {
    const char* name;
    PreTokenizer kind;
    bool ignore_merges;
    bool add_bos;  // default when the file has no add_bos_token
};

// tokenizer.ggml.pre names llama.cpp maps to the pre-tokenizers implemented here.
const PreEntry kPreTokenizers[] = {
    {"default", PreTokenizer::DEFAULT, false, false},
    {"gpt2", PreTokenizer::GPT2, false, false},
    {"gpt-2", PreTokenizer::GPT2, false, false},
    {"phi-2", PreTokenizer::GPT2, false, false},
    {"mpt", PreTokenizer::GPT2, false, false},
    {"olmo", PreTokenizer::GPT2, false, false},
    {"jais", PreTokenizer::GPT2, false, false},
    {"trillion", PreTokenizer::GPT2, false, false},
    {"exaone4", PreTokenizer::GPT2, false, false},
    {"granite-docling", PreTokenizer::GPT2, false, false},
    {"mellum", PreTokenizer::GPT2, false, false},
    {"smollm", PreTokenizer::DIGITS_GPT2, false, false},
    {"starcoder", PreTokenizer::DIGITS_GPT2, false, false},
    {"refact", PreTokenizer::DIGITS_GPT2, false, false},
    {"command-r", PreTokenizer::DIGITS_GPT2, false, false},
    {"codeshell", PreTokenizer::DIGITS_GPT2, false, false},
    {"exaone", PreTokenizer::DIGITS_GPT2, false, false},
    {"minerva-7b", PreTokenizer::DIGITS_GPT2, false, false},
    {"llama3", PreTokenizer::LLAMA3, true, true},
    {"llama-v3", PreTokenizer::LLAMA3, true, true},
    {"llama-bpe", PreTokenizer::LLAMA3, true, true},
    {"falcon3", PreTokenizer::LLAMA3, true, true},
    {"falcon-h1", PreTokenizer::LLAMA3, true, true},
    {"pixtral", PreTokenizer::LLAMA3, true, true},
    {"lfm2", PreTokenizer::LLAMA3, true, true},
    {"dbrx", PreTokenizer::LLAMA3, false, false},
    {"smaug-bpe", PreTokenizer::LLAMA3, false, false},
    {"qwen2", PreTokenizer::QWEN2, false, false},
    {"deepseek-r1-qwen", PreTokenizer::QWEN2, false, false},
    {"stablelm2", PreTokenizer::QWEN2, false, false},
    {"megrez", PreTokenizer::QWEN2, false, false},
    {"hunyuan", PreTokenizer::QWEN2, false, false},
    // llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O (gpt-oss writes "gpt-4o"), and minimax-m2, which it
    // splits with the same regex.
    {"gpt-4o", PreTokenizer::GPT4O, false, false},
    {"llama4", PreTokenizer::GPT4O, false, false},
    {"kanana2", PreTokenizer::GPT4O, false, false},
    {"talkie", PreTokenizer::GPT4O, false, false},
    {"minimax-m2", PreTokenizer::GPT4O, false, false},
    {"falcon", PreTokenizer::FALCON, false, false},
};

std::string supported_pre_names() {
    std::string s;
    for (const PreEntry& e : kPreTokenizers) s += std::string(s.empty() ? "" : ", ") + e.name;
    return s;
}

// Texts llama.cpp treats as end of generation (llama_vocab::load), beyond eos/eot/eom ids.
const char* const kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
};
const char* const kEotTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "<end_of_utterance>",
};
// Fill-in-the-middle pad / repo / file-separator tokens also end generation in llama.cpp.
const char* const kFimEogTexts[][6] = {
    {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", nullptr},
    {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", nullptr},
    {"<|file_sep|>", nullptr},
};

template <size_t N>
bool in_list(const std::string& s, const char* const (&list)[N]) {
    for (const char* t : list) {
        if (t && s == t) return true;
    }
    return false;
}

// tokenizer.ggml.<name>_token_id: -1 when absent or negative; GGUFError when past the vocabulary.
int32_t special_id(const GGUFFile& f, const std::string& key, int32_t fallback, int32_t n_vocab) {
    if (!f.has(key)) return fallback < n_vocab ? fallback : -1;
    int64_t v = f.get_i64(key);
    if (v < 0) return -1;
    if (v >= n_vocab) {
        throw GGUFError(f.path() + ": " + key + " = " + std::to_string(v) + " is outside the vocabulary of " +
                        std::to_string(n_vocab) + " tokens");
    }
    return (int32_t)v;
}

// "<0x41>" -> 0x41; -1 when the text is not of that form.
int parse_byte_token(const std::string& s) {
    if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') return -1;
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    int hi = hex(s[3]), lo = hex(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// GPT-2 byte-level text back to the bytes it stands for; characters outside the 256 stand-ins
// (text a converter left unmapped) pass through as UTF-8.
std::string gpt2_decode(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
        size_t len;
        uint32_t cp = unicode::decode_utf8(text.data() + i, text.size() - i, &len);
        int b = gpt2_codepoint_to_byte(cp);
        if (b >= 0) out += (char)b;
        else out.append(text, i, len);
        i += len;
    }
    return out;
}

std::string replace_all(std::string s, std::string_view from, std::string_view to) {
    std::string out;
    out.reserve(s.size());
    size_t pos = 0;
    for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
        out.append(s, pos, hit - pos);
        out += to;
    }
    out.append(s, pos, std::string::npos);
    return out;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_file(const std::string& path) {
    std::shared_ptr<GGUFFile> f = GGUFFile::open(path);
    return from_gguf(*f);
}

namespace {

typedef Tokenizer::Impl Vocab;

// tokenizer.ggml.model (and, for gpt2, tokenizer.ggml.pre): the pre-tokenizer entry it selects.
PreEntry read_model(const GGUFFile& f, Vocab& v, const std::string& where) {
    if (!f.has("tokenizer.ggml.model")) throw GGUFError(where + "no tokenizer.ggml.model: the file holds no tokenizer");
    v.model_name = f.get_string("tokenizer.ggml.model");
    if (v.model_name == "gpt2") {
        v.model = Vocab::Model::BPE;
    } else if (v.model_name == "llama") {
        v.model = Vocab::Model::SPM;
    } else {
        throw UnsupportedModelError(where + "tokenizer model " + gguf_quote(v.model_name) +
                                    " is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece)");
    }
    PreEntry pre{"", PreTokenizer::GPT2, false, v.model == Vocab::Model::SPM};
    if (v.model == Vocab::Model::BPE) {
        // llama.cpp falls back to its "default" splitting when the key is missing (and warns).
        v.pre_name = f.get_string("tokenizer.ggml.pre", "default");
        const PreEntry* found = nullptr;
        for (const PreEntry& e : kPreTokenizers) {
            if (v.pre_name == e.name) found = &e;
        }
        if (!found) {
            throw UnsupportedModelError(where + "pre-tokenizer " + gguf_quote(v.pre_name) +
                                        " (tokenizer.ggml.pre) is not supported; supported: " + supported_pre_names());
        }
        pre = *found;
        v.pre = pre.kind;
        v.ignore_merges = pre.ignore_merges;
    }

    return pre;
}

// The tokens' texts, scores and types, and the text -> id table.
void read_tokens(const GGUFFile& f, Vocab& v, const std::string& where) {
    const GGUFValue* tv = f.find("tokenizer.ggml.tokens");
    if (!tv || tv->type != GGUF_TYPE_ARRAY || tv->elem_type != GGUF_TYPE_STRING) {
        throw GGUFError(where + "tokenizer.ggml.tokens is missing or not an array of strings");
    }
    const size_t n = tv->strings.size();
    if (n == 0) throw GGUFError(where + "tokenizer.ggml.tokens is empty");
    if (n > (size_t)INT32_MAX) throw GGUFError(where + "tokenizer.ggml.tokens has too many entries");
    v.text.resize(n);
    for (size_t i = 0; i < n; i++) {
        v.text[i] = std::string(tv->strings[i]);
        // As llama.cpp: an empty token could never be matched, and would break the lookup table.
        if (v.text[i].empty()) v.text[i] = "[EMPTY_" + std::to_string(i) + "]";
    }
    if (f.has("tokenizer.ggml.scores")) {
        v.score = f.get_f32_array("tokenizer.ggml.scores");
        if (v.score.size() != n) {
            throw GGUFError(where + "tokenizer.ggml.scores has " + std::to_string(v.score.size()) +
                            " entries for " + std::to_string(n) + " tokens");
        }
    } else {
        v.score.assign(n, 0.0f);
    }
    v.type.assign(n, TOKEN_TYPE_NORMAL);
    if (f.has("tokenizer.ggml.token_type")) {
        std::vector<int32_t> t = f.get_i32_array("tokenizer.ggml.token_type");
        if (t.size() != n) {
            throw GGUFError(where + "tokenizer.ggml.token_type has " + std::to_string(t.size()) + " entries for " +
                            std::to_string(n) + " tokens");
        }
        for (size_t i = 0; i < n; i++) {
            if (t[i] < TOKEN_TYPE_UNDEFINED || t[i] > TOKEN_TYPE_BYTE) {
                throw GGUFError(where + "tokenizer.ggml.token_type[" + std::to_string(i) + "] = " +
                                std::to_string(t[i]) + " is not a token type (0..6)");
            }
            v.type[i] = (uint8_t)t[i];
        }
    }
    v.text_to_id.reserve(n);
    for (size_t i = 0; i < n; i++) {
        auto res = v.text_to_id.emplace(std::string_view(v.text[i]), (int32_t)i);
        if (!res.second) {
            throw GGUFError(where + "duplicate token " + gguf_quote(v.text[i]) + " at ids " +
                            std::to_string(res.first->second) + " and " + std::to_string(i));
        }
    }

}

// Special token ids and the add_bos / add_eos / add_space_prefix flags.
void read_special_ids(const GGUFFile& f, Vocab& v, const std::string& where, const PreEntry& pre) {
    const int32_t n_vocab = (int32_t)v.text.size();
    const bool spm = v.model == Vocab::Model::SPM;
    v.bos = special_id(f, "tokenizer.ggml.bos_token_id", spm ? 1 : -1, n_vocab);
    v.eos = special_id(f, "tokenizer.ggml.eos_token_id", spm ? 2 : -1, n_vocab);
    v.unk = special_id(f, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1, n_vocab);
    v.pad = special_id(f, "tokenizer.ggml.padding_token_id", -1, n_vocab);
    v.eot = special_id(f, "tokenizer.ggml.eot_token_id", -1, n_vocab);
    v.eom = special_id(f, "tokenizer.ggml.eom_token_id", -1, n_vocab);
    v.add_bos = f.get_bool("tokenizer.ggml.add_bos_token", pre.add_bos);
    v.add_eos = f.get_bool("tokenizer.ggml.add_eos_token", false);
    v.add_space_prefix = spm && f.get_bool("tokenizer.ggml.add_space_prefix", true);
    if (v.add_bos && v.bos < 0) throw GGUFError(where + "tokenizer.ggml.add_bos_token is true but there is no BOS token");
    if (v.add_eos && v.eos < 0) throw GGUFError(where + "tokenizer.ggml.add_eos_token is true but there is no EOS token");

}

// End of generation, found by text as llama.cpp does; such tokens become control tokens.
void mark_end_of_generation(Vocab& v) {
    const int32_t n_vocab = (int32_t)v.text.size();
    const size_t n = v.text.size();
    v.eog.assign(n, 0);
    int32_t fim[3] = {-1, -1, -1};
    for (int32_t id = 0; id < n_vocab; id++) {
        const std::string& s = v.text[id];
        bool hit = false;
        if (v.eot < 0 && in_list(s, kEotTexts)) v.eot = id, hit = true;
        if (v.eom < 0 && s == "<|eom_id|>") v.eom = id, hit = true;
        for (int k = 0; k < 3; k++) {
            if (fim[k] < 0 && in_list(s, kFimEogTexts[k])) fim[k] = id, hit = true;
        }
        if (in_list(s, kEogTexts)) v.eog[id] = 1, hit = true;
        if (hit && v.type[id] == TOKEN_TYPE_NORMAL) v.type[id] = TOKEN_TYPE_CONTROL;
    }
    for (int32_t id : {fim[0], fim[1], fim[2], v.eos, v.eot, v.eom}) {
        if (id >= 0) v.eog[id] = 1;
    }
    // gpt-oss (OpenAI's harmony format): with <|return|> and <|call|> present, <|end|> only ends a message, not
    // generation; and the markers that frame its messages (<|start|>assistant<|channel|>final<|message|>...)
    // are rendered like text, as llama.cpp renders them, so that what the model wrote can be split into its
    // reasoning and its answer (optiml.engine.harmony) instead of losing the frame.
    {
        auto id_of = [&](const char* s) {
            auto it = v.text_to_id.find(s);
            return it == v.text_to_id.end() ? -1 : it->second;
        };
        int32_t ret = id_of("<|return|>"), call = id_of("<|call|>"), end = id_of("<|end|>");
        if (ret >= 0 && call >= 0 && end >= 0 && v.eog[ret] && v.eog[call] && v.eog[end] && end != v.eos) {
            v.eog[end] = 0;
            for (const char* marker : {"<|end|>", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"}) {
                const int32_t id = id_of(marker);
                if (id >= 0) v.type[id] = TOKEN_TYPE_USER_DEFINED;
            }
        }
    }

}

// Each token's bytes when decoded, and the token of each single byte.
void build_pieces(Vocab& v) {
    const int32_t n_vocab = (int32_t)v.text.size();
    const size_t n = v.text.size();
    const bool spm = v.model == Vocab::Model::SPM;
    v.piece.resize(n);
    std::fill(std::begin(v.byte_token), std::end(v.byte_token), -1);
    for (int32_t id = 0; id < n_vocab; id++) {
        const std::string& s = v.text[id];
        switch (v.type[id]) {
            case TOKEN_TYPE_CONTROL:
            case TOKEN_TYPE_UNKNOWN:
            case TOKEN_TYPE_USER_DEFINED:
                v.piece[id] = s;
                break;
            case TOKEN_TYPE_BYTE: {
                int b = parse_byte_token(s);
                if (b < 0) {
                    // A byte-typed token of another form (BPE vocabularies) is an ordinary token.
                    v.piece[id] = spm ? s : gpt2_decode(s);
                } else {
                    v.piece[id] = std::string(1, (char)b);
                    if (spm && v.byte_token[b] < 0) v.byte_token[b] = id;
                }
                break;
            }
            default:
                v.piece[id] = spm ? replace_all(s, "\xE2\x96\x81", " ") : gpt2_decode(s);
        }
    }
    if (spm) {
        // llama.cpp falls back to a token spelled as the raw character when <0xXX> is missing.
        for (int b = 0; b < 128; b++) {
            if (v.byte_token[b] >= 0) continue;
            auto it = v.text_to_id.find(std::string(1, (char)b));
            if (it != v.text_to_id.end()) v.byte_token[b] = it->second;
        }
    } else {
        for (int b = 0; b < 256; b++) {
            std::string s;
            unicode::append_utf8(s, gpt2_byte_to_codepoint((uint8_t)b));
            auto it = v.text_to_id.find(s);
            if (it != v.text_to_id.end()) v.byte_token[b] = it->second;
        }
    }

}

// A gpt2 tokenizer's merges, by the ids of their parts.
void read_merges(const GGUFFile& f, Vocab& v, const std::string& where) {
    const int32_t n_vocab = (int32_t)v.text.size();
    const GGUFValue* mv = f.find("tokenizer.ggml.merges");
    if (!mv || mv->type != GGUF_TYPE_ARRAY || mv->elem_type != GGUF_TYPE_STRING) {
        throw GGUFError(where + "tokenizer.ggml.merges is missing or not an array of strings (a gpt2 tokenizer needs it)");
    }
    v.merges.reserve(mv->strings.size());
    for (size_t i = 0; i < mv->strings.size(); i++) {
        std::string_view m = mv->strings[i];
        size_t sp = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
        if (sp == std::string_view::npos || sp + 1 >= m.size()) {
            throw GGUFError(where + "tokenizer.ggml.merges[" + std::to_string(i) + "] = " + gguf_quote(m) +
                            " is not two tokens separated by a space");
        }
        std::string_view a = m.substr(0, sp), b = m.substr(sp + 1);
        auto ia = v.text_to_id.find(a), ib = v.text_to_id.find(b);
        auto ir = v.text_to_id.find(std::string(a) + std::string(b));
        // A merge whose parts or result are not tokens can never produce a token: skip it.
        if (ia == v.text_to_id.end() || ib == v.text_to_id.end() || ir == v.text_to_id.end()) continue;
        uint64_t key = ((uint64_t)(uint32_t)ia->second << 32) | (uint32_t)ib->second;
        v.merges.emplace(key, Vocab::Merge{(int32_t)i, ir->second});  // the first (lowest rank) wins
    }
    if (v.ignore_merges) {
        for (int32_t id = 0; id < n_vocab; id++) {
            if (v.type[id] == TOKEN_TYPE_NORMAL) v.bytes_to_id.emplace(std::string_view(v.piece[id]), id);
        }
    }
}

// Special tokens matched in raw text: longest first per first byte. As llama.cpp's vocabulary sets them by the
// model's name (general.name): a Phi-3's special tokens, but <unk>, <s> and <|endoftext|>, take the whitespace
// after them (Phi-3's tokenizer_config says rstrip for its chat tokens).
void index_specials(Vocab& v, const std::string& model_name) {
    std::string name = model_name;
    for (char& c : name) c = (char)std::tolower((unsigned char)c);
    const bool phi3 = name.find("phi-3") != std::string::npos || name.find("phi3") != std::string::npos;
    const int32_t n_vocab = (int32_t)v.text.size();
    for (int32_t id = 0; id < n_vocab; id++) {
        uint8_t t = v.type[id];
        if (t != TOKEN_TYPE_CONTROL && t != TOKEN_TYPE_USER_DEFINED && t != TOKEN_TYPE_UNKNOWN) continue;
        const std::string& s = v.text[id];
        const bool rstrip = phi3 && s != "<unk>" && s != "<s>" && s != "<|endoftext|>";
        v.specials_by_byte[(uint8_t)s[0]].push_back({id, t == TOKEN_TYPE_USER_DEFINED, rstrip});
    }
    for (auto& list : v.specials_by_byte) {
        std::stable_sort(list.begin(), list.end(), [&](const Vocab::Special& a, const Vocab::Special& b) {
            return v.text[a.id].size() > v.text[b.id].size();
        });
    }
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const GGUFFile& f) {
    auto impl = std::make_unique<Impl>();
    Impl& v = *impl;
    const std::string where = f.path() + ": ";
    const PreEntry pre = read_model(f, v, where);
    read_tokens(f, v, where);
    read_special_ids(f, v, where, pre);
    mark_end_of_generation(v);
    build_pieces(v);
    if (v.model != Impl::Model::SPM) read_merges(f, v, where);
    index_specials(v, f.get_string("general.name", ""));
    return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

}  // namespace optiml
