// Hand-written equivalents of the pre-tokenizer regexes (see pretokenize.h). Work is done on code
// points; a piece is a range of code point indices until the very end, where it becomes bytes.
#include "tokenizer/pretokenize.h"

#include <algorithm>

#include "tokenizer/unicode.h"

namespace optiml {

namespace {

using namespace unicode;

using Span = std::pair<uint32_t, uint32_t>;  // code point indices [first, second)

struct Text {
    std::vector<uint32_t> cp;
    std::vector<uint16_t> fl;  // flags per code point
};

constexpr uint16_t WS = FLAG_WHITESPACE, L = FLAG_LETTER, N = FLAG_NUMBER;
// gpt-4o's two letter classes; they overlap: modifier and other letters and marks are in both.
constexpr uint16_t UPPER = FLAG_LU | FLAG_LT | FLAG_LM | FLAG_LO | FLAG_MARK;  // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
constexpr uint16_t LOWER = FLAG_LL | FLAG_LM | FLAG_LO | FLAG_MARK;            // [\p{Ll}\p{Lm}\p{Lo}\p{M}]

// A run of whitespace starting at p: its length, and (for LLAMA3) the end of its last \r or \n.
size_t whitespace_run(const Text& t, size_t p, size_t end, size_t* last_newline_end) {
    size_t q = p;
    *last_newline_end = 0;
    while (q < end && (t.fl[q] & WS)) {
        if (t.cp[q] == '\r' || t.cp[q] == '\n') *last_newline_end = q + 1;
        q++;
    }
    return q - p;
}

// How 's 't 're 've 'm 'll 'd are matched: as written (GPT-2); in either case, A-Z only (llama3, as
// llama.cpp does); or with Unicode case folding as a regex's (?i:...) does, where U+017F (long s)
// is an s too (gpt-4o).
enum class Case { EXACT, ASCII, FOLD };

// Length of 's 't 're 've 'm 'll 'd at p, else 0.
size_t contraction(const Text& t, size_t p, size_t end, Case how) {
    if (p >= end || t.cp[p] != '\'' || p + 1 >= end) return 0;
    auto low = [&](size_t i) -> uint32_t {
        uint32_t c = t.cp[i];
        if (how != Case::EXACT && c >= 'A' && c <= 'Z') return c + 32;
        return (how == Case::FOLD && c == 0x17F) ? 's' : c;
    };
    uint32_t a = low(p + 1);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (p + 2 >= end) return 0;
    uint32_t b = low(p + 2);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(const Text& t, Span s, std::vector<Span>& out) {
    size_t p = s.first, end = s.second;
    while (p < end) {
        size_t q;
        if ((q = contraction(t, p, end, Case::EXACT))) {
            out.push_back({(uint32_t)p, (uint32_t)(p + q)});
            p += q;
            continue;
        }
        // An optional leading space joins a run of letters, numbers or other symbols.
        size_t first = (t.cp[p] == ' ' && p + 1 < end) ? p + 1 : p;
        uint16_t f = t.fl[first];
        if (!(f & WS)) {
            uint16_t cls = (f & L) ? L : (f & N) ? N : 0;
            q = first + 1;
            if (cls) {
                while (q < end && (t.fl[q] & cls)) q++;
            } else {
                while (q < end && !(t.fl[q] & (WS | L | N))) q++;
            }
            out.push_back({(uint32_t)p, (uint32_t)q});
            p = q;
            continue;
        }
        size_t nl;
        size_t n = whitespace_run(t, p, end, &nl);
        // \s+(?!\S): a run followed by a non-space leaves its last character to the next match.
        if (n > 1 && p + n < end) n--;
        out.push_back({(uint32_t)p, (uint32_t)(p + n)});
        p += n;
    }
}

// The alternatives llama3 and gpt-4o share after their letter ones, at p: \p{N}{1,max_digits}|
//  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ , with [\r\n/]* instead of [\r\n]* when `slash`.
// Returns the end of the match.
size_t numbers_symbols_spaces(const Text& t, size_t p, size_t end, size_t max_digits, bool slash) {
    size_t q;
    if (t.fl[p] & N) {
        q = p + 1;
        while (q < end && q - p < max_digits && (t.fl[q] & N)) q++;
        return q;
    }
    size_t first = (t.cp[p] == ' ' && p + 1 < end) ? p + 1 : p;
    if (!(t.fl[first] & (WS | L | N))) {
        q = first + 1;
        while (q < end && !(t.fl[q] & (WS | L | N))) q++;
        while (q < end && (t.cp[q] == '\r' || t.cp[q] == '\n' || (slash && t.cp[q] == '/'))) q++;
        return q;
    }
    size_t nl;
    size_t n = whitespace_run(t, p, end, &nl);
    if (nl) return nl;  // \s*[\r\n]+ : up to the last line break of the run
    if (n > 1 && p + n < end) n--;  // \s+(?!\S)
    return p + std::max<size_t>(n, 1);  // n == 0 is not reachable: every character matches some alternative
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
void split_llama3(const Text& t, Span s, size_t max_digits, std::vector<Span>& out) {
    size_t p = s.first, end = s.second;
    while (p < end) {
        size_t q;
        uint32_t c = t.cp[p];
        uint16_t f = t.fl[p];
        if ((q = contraction(t, p, end, Case::ASCII))) {
            q += p;
        } else if (!(c == '\r' || c == '\n' || (f & N)) && ((f & L) || (p + 1 < end && (t.fl[p + 1] & L)))) {
            // [^\r\n\p{L}\p{N}]?\p{L}+ : one character of anything else may lead a run of letters.
            q = p + 1;
            while (q < end && (t.fl[q] & L)) q++;
        } else {
            q = numbers_symbols_spaces(t, p, end, max_digits, false);
        }
        out.push_back({(uint32_t)p, (uint32_t)q});
        p = q;
    }
}

// gpt-4o's first word alternative without its leading character and contraction, from s:
// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+ . The end of the match; s when none.
// The greedy UPPER* takes the whole run. When a LOWER follows, LOWER+ takes the run of those; when
// not, UPPER* gives characters back until the one it gave back last is also a LOWER (the classes
// overlap) and the match ends after it: "ABCd" is one match, "東京" too, "AB" none.
size_t upper_lower(const Text& t, size_t s, size_t end) {
    size_t e = s;
    while (e < end && (t.fl[e] & UPPER)) e++;
    if (e < end && (t.fl[e] & LOWER)) {
        while (e < end && (t.fl[e] & LOWER)) e++;
        return e;
    }
    while (e > s && !(t.fl[e - 1] & LOWER)) e--;
    return e;
}

// The second one: [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]* (nothing to give back).
size_t upper_run_lower(const Text& t, size_t s, size_t end) {
    size_t e = s;
    while (e < end && (t.fl[e] & UPPER)) e++;
    if (e == s) return s;
    while (e < end && (t.fl[e] & LOWER)) e++;
    return e;
}

// [^\r\n\p{L}\p{N}]?<word> at p: with the leading character first, then without it (a mark is
// both a possible leading character and part of a word). The end of the word; 0 when none.
template <typename Word>
size_t led_word(const Text& t, size_t p, size_t end, Word word) {
    const uint32_t c = t.cp[p];
    if (!(c == '\r' || c == '\n' || (t.fl[p] & (L | N)))) {
        size_t e = word(t, p + 1, end);
        if (e > p + 1) return e;
    }
    size_t e = word(t, p, end);
    return e > p ? e : 0;
}

// GPT4O (pretokenize.h). llama.cpp runs this regex through std::regex, which has no \p{Lu}..., as
//   [^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|...)?|...
// where every letter but a-z counts as uppercase, every letter but A-Z as lowercase, and marks are
// not part of words. Both split alike where no mark and no cased letter outside ASCII is involved;
// elsewhere this follows the regex, as HF tokenizers and tiktoken do: "ΓειαΣου" -> "Γεια" "Σου"
// (llama.cpp: one piece), "e" + U+0301 stays one word (llama.cpp: "e", then the mark).
void split_gpt4o(const Text& t, Span s, std::vector<Span>& out) {
    size_t p = s.first, end = s.second;
    while (p < end) {
        size_t q = led_word(t, p, end, upper_lower);
        if (!q) q = led_word(t, p, end, upper_run_lower);
        if (q) {
            q += contraction(t, q, end, Case::FOLD);
        } else {
            q = numbers_symbols_spaces(t, p, end, 3, true);
        }
        out.push_back({(uint32_t)p, (uint32_t)q});
        p = q;
    }
}

// A regex that is a character class: its matches (runs, or single characters when `single`) and
// the text between them all become pieces, as llama.cpp keeps unmatched text.
template <typename Pred>
void split_class(const Text& t, Span s, Pred pred, bool single, std::vector<Span>& out) {
    size_t p = s.first, end = s.second, gap = p;
    while (p < end) {
        if (!pred(t, p)) {
            p++;
            continue;
        }
        if (gap < p) out.push_back({(uint32_t)gap, (uint32_t)p});
        size_t q = p + 1;
        if (!single) {
            while (q < end && pred(t, q)) q++;
        }
        out.push_back({(uint32_t)p, (uint32_t)q});
        p = gap = q;
    }
    if (gap < end) out.push_back({(uint32_t)gap, (uint32_t)end});
}

// [0-9][0-9][0-9]: ASCII digits in threes from the left, leftovers stay as text between.
void split_digit_triples(const Text& t, Span s, std::vector<Span>& out) {
    size_t p = s.first, end = s.second, gap = p;
    auto digit = [&](size_t i) { return i < end && t.cp[i] >= '0' && t.cp[i] <= '9'; };
    while (p < end) {
        if (digit(p) && digit(p + 1) && digit(p + 2)) {
            if (gap < p) out.push_back({(uint32_t)gap, (uint32_t)p});
            out.push_back({(uint32_t)p, (uint32_t)(p + 3)});
            p = gap = p + 3;
        } else {
            p++;
        }
    }
    if (gap < end) out.push_back({(uint32_t)gap, (uint32_t)end});
}

bool is_number(const Text& t, size_t i) { return t.fl[i] & N; }

template <bool Backtick>
bool is_default_punct(const Text& t, size_t i) {
    uint32_t c = t.cp[i];
    return (t.fl[i] & FLAG_PUNCT) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
           c == '~' || c == '|' || (Backtick && c == '`');
}

// Applies one stage to every current piece.
template <typename F>
void stage(std::vector<Span>& spans, std::vector<Span>& tmp, F f) {
    tmp.clear();
    for (const Span& s : spans) f(s, tmp);
    spans.swap(tmp);
}

}  // namespace

void pretokenize(PreTokenizer kind, std::string_view text, Pieces& out) {
    out.clear();
    if (text.empty()) return;
    Text t;
    std::vector<uint32_t> offsets;
    decode_all(text, t.cp, offsets);
    t.fl.resize(t.cp.size());
    for (size_t i = 0; i < t.cp.size(); i++) t.fl[i] = flags(t.cp[i]);

    std::vector<Span> spans{{0u, (uint32_t)t.cp.size()}}, tmp;
    auto gpt2 = [&](Span s, std::vector<Span>& o) { split_gpt2(t, s, o); };
    switch (kind) {
        case PreTokenizer::GPT2:
            stage(spans, tmp, gpt2);
            break;
        case PreTokenizer::DIGITS_GPT2:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_class(t, s, is_number, true, o); });
            stage(spans, tmp, gpt2);
            break;
        case PreTokenizer::LLAMA3:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_llama3(t, s, 3, o); });
            break;
        case PreTokenizer::QWEN2:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_llama3(t, s, 1, o); });
            break;
        case PreTokenizer::GPT4O:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_gpt4o(t, s, o); });
            break;
        case PreTokenizer::DEFAULT:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_class(t, s, is_default_punct<false>, false, o); });
            stage(spans, tmp, gpt2);
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_class(t, s, is_number, false, o); });
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_digit_triples(t, s, o); });
            break;
        case PreTokenizer::FALCON:
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_class(t, s, is_default_punct<true>, false, o); });
            stage(spans, tmp, gpt2);
            stage(spans, tmp, [&](Span s, std::vector<Span>& o) { split_digit_triples(t, s, o); });
            break;
    }
    out.reserve(spans.size());
    for (const Span& s : spans) out.push_back({offsets[s.first], offsets[s.second]});
}

}  // namespace optiml
