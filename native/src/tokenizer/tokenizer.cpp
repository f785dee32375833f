// Tokenizer::encode (special tokens first, then the model on the text between them), decode and
// the accessors.
#include <cstring>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace optiml {

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

void Tokenizer::check_id(int32_t id) const {
    if (id < 0 || id >= n_vocab()) {
        throw ArgumentError("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                            std::to_string(n_vocab()) + ")");
    }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
    const Impl& v = *impl_;
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 4);
    if (add_special && v.add_bos) out.push_back(v.bos);

    // SentencePiece puts a space in front of the text at the start and after each special token,
    // as llama.cpp does.
    bool after_special = true;
    auto plain = [&](std::string_view s) {
        if (s.empty()) return;
        if (v.model == Impl::Model::BPE) {
            std::string fixed;  // (bytes that are not UTF-8 read as llama.cpp reads them)
            v.encode_bpe(unicode::bpe_input_text(s, fixed) ? std::string_view(fixed) : s, out);
        } else if (v.add_space_prefix && after_special) {
            v.encode_spm(std::string(" ").append(s), out);
        } else {
            v.encode_spm(s, out);
        }
        after_special = false;
    };

    // Leftmost-longest match of special tokens (HF tokenizers' added-token matching).
    size_t start = 0;
    for (size_t i = 0; i < text.size();) {
        const auto& cands = v.specials_by_byte[(uint8_t)text[i]];
        const Impl::Special* hit = nullptr;
        for (const Impl::Special& c : cands) {
            if (!c.always && !parse_special) continue;
            const std::string& t = v.text[c.id];
            if (t.size() <= text.size() - i && std::memcmp(text.data() + i, t.data(), t.size()) == 0) {
                hit = &c;
                break;
            }
        }
        if (!hit) {
            i++;
            continue;
        }
        plain(text.substr(start, i - start));
        out.push_back(hit->id);
        after_special = true;
        i += v.text[hit->id].size();
        if (hit->rstrip)  // (C's isspace, as llama.cpp strips)
            while (i < text.size() && (text[i] == ' ' || (text[i] >= '\t' && text[i] <= '\r'))) i++;
        start = i;
    }
    plain(text.substr(start));

    if (add_special && v.add_eos) out.push_back(v.eos);
    return out;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
    std::vector<std::string> out;
    if (impl_->model != Impl::Model::BPE) {
        if (!text.empty()) out.emplace_back(text);
        return out;
    }
    std::string fixed;
    if (unicode::bpe_input_text(text, fixed)) text = fixed;
    Pieces pieces;
    pretokenize(impl_->pre, text, pieces);
    for (const auto& p : pieces) out.emplace_back(text.substr(p.first, p.second - p.first));
    return out;
}

std::string Tokenizer::token_to_piece(int32_t id, bool render_special) const {
    check_id(id);
    uint8_t t = impl_->type[id];
    if (!render_special && (t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_UNKNOWN)) return std::string();
    return impl_->piece[id];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool render_special) const {
    for (int32_t id : ids) check_id(id);
    std::string out;
    bool strip = impl_->add_space_prefix;  // the space SentencePiece encoding put in front
    for (int32_t id : ids) {
        uint8_t t = impl_->type[id];
        if (!render_special && (t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_UNKNOWN)) continue;
        const std::string& p = impl_->piece[id];
        if (strip && !p.empty()) {
            out.append(p, p[0] == ' ' ? 1 : 0, std::string::npos);
            strip = false;
        } else {
            out += p;
        }
    }
    return out;
}

int32_t Tokenizer::n_vocab() const { return (int32_t)impl_->text.size(); }
int32_t Tokenizer::bos_id() const { return impl_->bos; }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::eot_id() const { return impl_->eot; }
int32_t Tokenizer::unk_id() const { return impl_->unk; }
int32_t Tokenizer::pad_id() const { return impl_->pad; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
bool Tokenizer::add_eos() const { return impl_->add_eos; }
bool Tokenizer::add_space_prefix() const { return impl_->add_space_prefix; }

bool Tokenizer::is_eog(int32_t id) const {
    return id >= 0 && id < n_vocab() && impl_->eog[id];
}

std::vector<int32_t> Tokenizer::eog_ids() const {
    std::vector<int32_t> out;
    for (int32_t id = 0; id < n_vocab(); id++) {
        if (impl_->eog[id]) out.push_back(id);
    }
    return out;
}

bool Tokenizer::is_control(int32_t id) const {
    return id >= 0 && id < n_vocab() && impl_->type[id] == TOKEN_TYPE_CONTROL;
}

TokenType Tokenizer::token_type(int32_t id) const {
    check_id(id);
    return (TokenType)impl_->type[id];
}

float Tokenizer::token_score(int32_t id) const {
    check_id(id);
    return impl_->score[id];
}

const std::string& Tokenizer::token_text(int32_t id) const {
    check_id(id);
    return impl_->text[id];
}

int32_t Tokenizer::token_id(std::string_view text) const {
    auto it = impl_->text_to_id.find(text);
    return it == impl_->text_to_id.end() ? -1 : it->second;
}

std::string Tokenizer::model_name() const { return impl_->model_name; }
std::string Tokenizer::pre_name() const { return impl_->pre_name; }

}  // namespace optiml
