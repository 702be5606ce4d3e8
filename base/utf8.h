// UTF-8 validity, shared by the readers that take user text (the BPE tokenizers, OLMo's YAML configs).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace trainer {

// The byte offset of the first invalid UTF-8 sequence of `s` (overlong forms, surrogates and code points
// above U+10FFFF are invalid), or npos.
inline size_t invalid_utf8_offset(std::string_view s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const size_t n = s.size();
    for (size_t i = 0; i < n;) {
        const unsigned char c = p[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        int len = 0;
        uint32_t cp = 0, min = 0;
        if ((c & 0xE0) == 0xC0)
            len = 2, cp = c & 0x1F, min = 0x80;
        else if ((c & 0xF0) == 0xE0)
            len = 3, cp = c & 0x0F, min = 0x800;
        else if ((c & 0xF8) == 0xF0)
            len = 4, cp = c & 0x07, min = 0x10000;
        else
            return i;
        if (i + len > n) return i;
        for (int k = 1; k < len; ++k) {
            if ((p[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
        i += len;
    }
    return std::string_view::npos;
}

// `s` with each byte that starts no valid UTF-8 sequence replaced by U+FFFD (text a byte-level model wrote, for
// JSON, which holds only UTF-8).
inline std::string valid_utf8(std::string_view s) {
    std::string out;
    while (!s.empty()) {
        const size_t bad = invalid_utf8_offset(s);
        out.append(s.substr(0, bad));
        if (bad == std::string_view::npos) break;
        out += "\xEF\xBF\xBD";
        s.remove_prefix(bad + 1);
    }
    return out;
}

}  // namespace trainer
