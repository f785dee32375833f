// SentencePiece BPE (tokenizer.ggml.model = "llama"), as llama.cpp's llm_tokenizer_spm: spaces
// become U+2581, then adjacent symbols (UTF-8 characters at first) merge whenever their
// concatenation is a token, highest score first, leftmost on ties. A character that never became a
// token falls back to its bytes (<0xXX> tokens), or to the unknown token without them.
#include <algorithm>
#include <queue>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace optiml {

namespace {

struct Symbol {
    uint32_t offset;  // bytes of the escaped text
    uint32_t len;     // 0 once merged into its left neighbour
    int32_t prev;
    int32_t next;
};

struct Bigram {
    float score;
    int32_t left;
    int32_t right;
    uint32_t len;  // the merged length when queued: a different length means the entry is stale
    bool operator<(const Bigram& o) const {
        return score != o.score ? score < o.score : left > o.left;
    }
};

}  // namespace

void Tokenizer::Impl::encode_spm(std::string_view fragment, std::vector<int32_t>& out) const {
    static const std::string_view kSpace = "\xE2\x96\x81";
    std::string text;
    text.reserve(fragment.size() + 8);
    for (char c : fragment) {
        if (c == ' ') text += kSpace;
        else text += c;
    }
    if (text.empty()) return;

    std::vector<Symbol> sym;
    sym.reserve(text.size());
    for (size_t off = 0; off < text.size();) {
        // A character's length as its first byte says, whatever follows (llama.cpp's unicode_len_utf8): text
        // that is not UTF-8 splits into the same symbols as there, and a symbol no token spells becomes its
        // bytes. (A stray continuation byte is one byte; a lead byte takes the next bytes with it.)
        static constexpr uint8_t kLenByHighBits[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
        const size_t n = std::min<size_t>(kLenByHighBits[(uint8_t)text[off] >> 4], text.size() - off);
        sym.push_back({(uint32_t)off, (uint32_t)n, (int32_t)sym.size() - 1, -1});
        off += n;
    }
    for (size_t i = 0; i + 1 < sym.size(); i++) sym[i].next = (int32_t)i + 1;

    std::priority_queue<Bigram> queue;
    auto try_add = [&](int32_t l, int32_t r) {
        if (l < 0 || r < 0) return;
        std::string_view s(text.data() + sym[l].offset, sym[l].len + sym[r].len);
        auto it = text_to_id.find(s);
        if (it == text_to_id.end()) return;
        queue.push({score[it->second], l, r, (uint32_t)s.size()});
    };
    for (size_t i = 1; i < sym.size(); i++) try_add((int32_t)i - 1, (int32_t)i);

    while (!queue.empty()) {
        Bigram b = queue.top();
        queue.pop();
        Symbol& l = sym[b.left];
        Symbol& r = sym[b.right];
        if (l.len == 0 || r.len == 0 || l.next != b.right || l.len + r.len != b.len) continue;
        l.len += r.len;
        r.len = 0;
        l.next = r.next;
        if (r.next >= 0) sym[r.next].prev = b.left;
        try_add(l.prev, b.left);
        try_add(b.left, l.next);
    }

    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        std::string_view s(text.data() + sym[i].offset, sym[i].len);
        auto it = text_to_id.find(s);
        if (it != text_to_id.end()) {
            out.push_back(it->second);
            continue;
        }
        bool have_bytes = true;
        for (char c : s) have_bytes = have_bytes && byte_token[(uint8_t)c] >= 0;
        if (have_bytes) {
            for (char c : s) out.push_back(byte_token[(uint8_t)c]);
        } else if (unk >= 0) {
            out.push_back(unk);
        }
    }
}

}  // namespace optiml
