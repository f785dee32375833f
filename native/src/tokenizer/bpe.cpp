// Byte-level BPE (tokenizer.ggml.model = "gpt2"): pre-tokenize, then merge each piece's bytes by
// merge rank, lowest first, leftmost on ties (what HF tokenizers and llama.cpp do).
#include <algorithm>

#include "tokenizer/tokenizer_impl.h"

namespace optiml {

uint32_t gpt2_byte_to_codepoint(uint8_t b) {
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE) return b;
    // The remaining 68 bytes, in order, go to U+0100 and on.
    uint32_t n = 0;
    for (uint32_t c = 0; c < b; c++) {
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE)) n++;
    }
    return 0x100 + n;
}

int gpt2_codepoint_to_byte(uint32_t cp) {
    static const std::vector<int> table = [] {
        std::vector<int> t(0x200, -1);
        for (int b = 0; b < 256; b++) t[gpt2_byte_to_codepoint((uint8_t)b)] = b;
        return t;
    }();
    return cp < table.size() ? table[cp] : -1;
}

namespace {

struct Symbol {
    int32_t id;    // token of the bytes this symbol covers; -1 for a byte with no token
    int32_t prev;  // neighbours in the linked list, -1 at the ends
    int32_t next;
};

struct Bigram {
    int32_t rank;
    int32_t left;  // symbol positions
    int32_t right;
    int32_t left_id;  // ids when queued: a changed symbol makes the entry stale
    int32_t right_id;
    int32_t result;
    bool operator<(const Bigram& o) const {  // the heap pops the largest: lowest rank, then leftmost
        return rank != o.rank ? rank > o.rank : left > o.left;
    }
};

}  // namespace

void Tokenizer::Impl::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
    if (word.size() == 1) {
        int32_t id = byte_token[(uint8_t)word[0]];
        if (id >= 0) out.push_back(id);
        return;
    }
    if (ignore_merges) {
        auto it = bytes_to_id.find(word);
        if (it != bytes_to_id.end()) {
            out.push_back(it->second);
            return;
        }
    }
    // thread_local scratch: encode() is const and may run on several threads.
    thread_local std::vector<Symbol> sym;
    thread_local std::vector<Bigram> heap;  // a max-heap by Bigram::operator< (std::push_heap)
    sym.resize(word.size());
    for (size_t i = 0; i < word.size(); i++) {
        sym[i] = {byte_token[(uint8_t)word[i]], (int32_t)i - 1, i + 1 < word.size() ? (int32_t)i + 1 : -1};
    }
    heap.clear();
    auto try_add = [&](int32_t l, int32_t r) {
        if (l < 0 || r < 0 || sym[l].id < 0 || sym[r].id < 0) return;
        auto it = merges.find(((uint64_t)(uint32_t)sym[l].id << 32) | (uint32_t)sym[r].id);
        if (it == merges.end()) return;
        heap.push_back({it->second.rank, l, r, sym[l].id, sym[r].id, it->second.result});
        std::push_heap(heap.begin(), heap.end());
    };
    for (size_t i = 1; i < word.size(); i++) try_add((int32_t)i - 1, (int32_t)i);

    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end());
        Bigram b = heap.back();
        heap.pop_back();
        Symbol& l = sym[b.left];
        Symbol& r = sym[b.right];
        // Stale when either side was merged away or grew since the entry was queued.
        if (l.next != b.right || l.id != b.left_id || r.id != b.right_id) continue;
        l.id = b.result;
        l.next = r.next;
        if (r.next >= 0) sym[r.next].prev = b.left;
        r.id = -2;  // dead
        r.prev = r.next = -1;
        try_add(l.prev, b.left);
        try_add(b.left, l.next);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        if (sym[i].id >= 0) out.push_back(sym[i].id);
    }
}

void Tokenizer::Impl::encode_bpe(std::string_view fragment, std::vector<int32_t>& out) const {
    thread_local Pieces pieces;
    pretokenize(pre, fragment, pieces);
    for (const auto& p : pieces) bpe_word(fragment.substr(p.first, p.second - p.first), out);
}

}  // namespace optiml
