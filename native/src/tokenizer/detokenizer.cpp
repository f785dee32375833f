// Streaming detokenization: token pieces may end inside a UTF-8 sequence (byte tokens, or BPE
// tokens of part of an emoji); hold those bytes back until the sequence completes.
#include "optiml/tokenizer.h"
#include "tokenizer/unicode.h"

namespace optiml {

namespace {

// For an ill-formed position: how many bytes form the longest prefix of some valid sequence
// (at least 1), and whether that prefix simply ran into the end of the buffer.
size_t ill_formed_prefix(const uint8_t* p, size_t n, bool* truncated) {
    *truncated = false;
    uint8_t b = p[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) need = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;  // no surrogates
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
    } else {
        return 1;
    }
    for (size_t j = 1; j < need; j++) {
        if (j >= n) {
            *truncated = true;
            return j;
        }
        uint8_t c = p[j];
        bool ok = j == 1 ? (c >= lo && c <= hi) : (c >= 0x80 && c <= 0xBF);
        if (!ok) return j;
    }
    return need;  // not reached for input valid_utf8_len rejected
}

}  // namespace

void utf8_drain(std::string& bytes, std::string& out, bool final) {
    const uint8_t* p = (const uint8_t*)bytes.data();
    size_t n = bytes.size(), i = 0;
    while (i < n) {
        size_t len = unicode::valid_utf8_len((const char*)p + i, n - i);
        if (len) {
            out.append((const char*)p + i, len);
            i += len;
            continue;
        }
        bool truncated;
        size_t k = ill_formed_prefix(p + i, n - i, &truncated);
        if (truncated && !final) break;  // may still complete with the next token
        out += "\xEF\xBF\xBD";  // U+FFFD
        i += k;
    }
    bytes.erase(0, i);
}

Detokenizer::Detokenizer(const Tokenizer& tok, bool render_special) : tok_(tok), render_special_(render_special) {}

std::string Detokenizer::push(int32_t id) {
    std::string piece = tok_.token_to_piece(id, render_special_);
    if (at_start_ && !piece.empty()) {
        // Same as Tokenizer::decode: drop the space SentencePiece encoding put in front.
        if (tok_.add_space_prefix() && piece[0] == ' ') piece.erase(0, 1);
        at_start_ = false;
    }
    pending_ += piece;
    std::string out;
    utf8_drain(pending_, out, false);
    return out;
}

std::string Detokenizer::flush() {
    std::string out;
    utf8_drain(pending_, out, true);
    at_start_ = true;
    return out;
}

void Detokenizer::reset() {
    pending_.clear();
    at_start_ = true;
}

}  // namespace optiml
