// Stop strings for streamed generation.
//
// The generation loop keeps the text produced so far (UTF-8 bytes; tokens may end mid code point). After
// each token it asks find_stop():
//  * a stop string occurs: emit text[0 .. pos) and stop;
//  * otherwise emit everything except the last `hold_back` bytes, which might be the start of a stop
//    string (or an incomplete UTF-8 sequence) and may only go out once later bytes settle the question.
// Everything works on bytes. For valid UTF-8 text and stops the emitted part always ends on a code point
// boundary, so streaming never splits a character.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace optiml {

struct StopMatch {
    int64_t pos = -1;      // byte offset of the earliest stop occurrence, -1 if none
    int32_t which = -1;    // index in `stops` of that stop (the first listed one if several start at pos)
    size_t hold_back = 0;  // when pos < 0: trailing bytes not yet safe to emit; 0 when a stop matched
};

// Searches text[from ..) for the stops (bytes). `from` lets a caller skip text already emitted: the
// hold-back guarantees that no stop can start there. Throws ArgumentError for an empty stop string or
// from > text.size().
StopMatch find_stop(std::string_view text, const std::vector<std::string>& stops, size_t from = 0);

// The largest end <= `end` such that text[0 .. end) does not stop inside a multi-byte UTF-8 sequence
// (an incomplete sequence at the end is cut off; invalid bytes are left alone).
size_t utf8_safe_end(std::string_view text, size_t end);

}  // namespace optiml
