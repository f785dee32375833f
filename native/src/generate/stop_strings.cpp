// Stop strings for streamed generation (see optiml/stop_strings.h).
#include "optiml/stop_strings.h"

#include <algorithm>

#include "optiml/common.h"

namespace optiml {

namespace {

// Bytes in the UTF-8 sequence that `lead` starts; 0 for a continuation byte (10xxxxxx); 1 for ASCII
// and for bytes that cannot start a sequence (treated as single units so invalid text is not held).
int utf8_seq_len(unsigned char lead) {
    if (lead < 0x80) return 1;
    if ((lead & 0xC0) == 0x80) return 0;
    if ((lead & 0xE0) == 0xC0) return 2;
    if ((lead & 0xF0) == 0xE0) return 3;
    if ((lead & 0xF8) == 0xF0) return 4;
    return 1;
}

}  // namespace

size_t utf8_safe_end(std::string_view text, size_t end) {
    end = std::min(end, text.size());
    // Look back at most 3 bytes for the lead byte of the sequence that `end` may cut.
    for (size_t k = 1; k <= 4 && k <= end; k++) {
        const int len = utf8_seq_len((unsigned char)text[end - k]);
        if (len == 0) continue;                 // continuation byte: keep looking for the lead
        return (size_t)len > k ? end - k : end;  // the sequence needs more bytes than end leaves it
    }
    return end;  // no lead byte close enough: not valid UTF-8, nothing to protect
}

StopMatch find_stop(std::string_view text, const std::vector<std::string>& stops, size_t from) {
    if (from > text.size())
        throw ArgumentError(format("from (%zu) is past the end of the text (%zu bytes)", from, text.size()));
    for (size_t i = 0; i < stops.size(); i++)
        if (stops[i].empty()) throw ArgumentError(format("stop string %zu is empty", i));

    StopMatch m;
    for (size_t i = 0; i < stops.size(); i++) {
        const size_t pos = text.find(stops[i], from);
        if (pos != std::string_view::npos && (m.pos < 0 || (int64_t)pos < m.pos)) {
            m.pos = (int64_t)pos;
            m.which = (int32_t)i;
        }
    }
    if (m.pos >= 0) return m;

    // No match: hold back the longest tail that is a proper prefix of some stop (a full stop would have
    // matched). Tails that start before `from` cannot be a stop's start (the caller held them back).
    size_t hold = 0;
    const size_t avail = text.size() - from;
    for (const std::string& s : stops) {
        for (size_t h = std::min(s.size() - 1, avail); h > hold; h--) {
            if (text.compare(text.size() - h, h, s, 0, h) == 0) {
                hold = h;
                break;
            }
        }
    }
    // Then never emit half a character: move the cut back to a code point boundary.
    m.hold_back = text.size() - utf8_safe_end(text, text.size() - hold);
    return m;
}

}  // namespace optiml
