// Token files (llm.c shards, .npy, raw memmaps), the instance dataset over them and the instance order.
// See data.h for the formats and the rules; this file owns the parsing and the exact shuffle.
#include "core/data/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "base/common.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "token files are read as little-endian in place");

namespace trainer {

int64_t token_dtype_size(TokenDtype dtype) { return dtype == TokenDtype::kUint16 ? 2 : 4; }

const char* token_file_format_name(TokenFileFormat format) {
    switch (format) {
        case TokenFileFormat::kRaw:
            return "raw";
        case TokenFileFormat::kNpy:
            return "npy";
        case TokenFileFormat::kLlmc:
            return "llm.c";
    }
    return "unknown";
}

namespace {

// Little-endian loads from a possibly unaligned place in the mapping (npy data need not be aligned).
template <typename T>
T load(const unsigned char* p) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
}

// A Python literal from an npy header dict: the subset numpy writes (str, bool, None, int, tuple/list).
struct PyValue {
    enum class Kind { kString, kBool, kNone, kInt, kSequence };
    Kind kind = Kind::kNone;
    std::string str;  // kString
    bool boolean = false;
    int64_t integer = 0;
    std::vector<PyValue> items;  // kSequence
    std::string text;            // the literal as written, for messages
};

// Parses the npy header dict, e.g. "{'descr': '<u2', 'fortran_order': False, 'shape': (10,), }".
// Errors are UserErrors naming the file and the character offset in the header.
class NpyHeaderParser {
   public:
    NpyHeaderParser(const std::string& path, const std::string& text) : path_(path), text_(text) {}

    // The header without numpy's trailing padding, for messages.
    std::string shown() const { return text_.substr(0, text_.find_last_not_of(" \n") + 1); }

    std::vector<std::pair<std::string, PyValue>> parse_dict() {
        std::vector<std::pair<std::string, PyValue>> out;
        skip_space();
        expect('{');
        skip_space();
        while (peek() != '}') {
            PyValue key = parse_value();
            if (key.kind != PyValue::Kind::kString) fail(fmt::format("dict key {} is not a string", key.text));
            skip_space();
            expect(':');
            out.emplace_back(key.str, parse_value());
            skip_space();
            if (peek() == ',') {
                ++pos_;
                skip_space();
            } else if (peek() != '}') {
                fail("expected ',' or '}'");
            }
        }
        ++pos_;
        skip_space();
        if (pos_ != text_.size()) fail("unexpected text after the dict");
        return out;
    }

   private:
    char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }

    void skip_space() {
        while (pos_ < text_.size() &&
               (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' || text_[pos_] == '\r')) {
            ++pos_;
        }
    }

    void expect(char c) {
        if (peek() != c) fail(fmt::format("expected '{}'", c));
        ++pos_;
    }

    [[noreturn]] void fail(const std::string& what) const {
        user_error("data file {}: npy header {:?} at offset {}: {}", path_, shown(), pos_, what);
    }

    PyValue parse_value() {
        skip_space();
        size_t start = pos_;
        PyValue v;
        char c = peek();
        if (c == '\'' || c == '"') {
            ++pos_;
            while (pos_ < text_.size() && text_[pos_] != c) {
                if (text_[pos_] == '\\') fail("escapes in strings are not supported");
                v.str += text_[pos_++];
            }
            expect(c);
            v.kind = PyValue::Kind::kString;
        } else if (c == '(' || c == '[') {
            char close = c == '(' ? ')' : ']';
            ++pos_;
            skip_space();
            while (peek() != close) {
                v.items.push_back(parse_value());
                skip_space();
                if (peek() == ',') {
                    ++pos_;
                    skip_space();
                } else if (peek() != close) {
                    fail(fmt::format("expected ',' or '{}'", close));
                }
            }
            ++pos_;
            v.kind = PyValue::Kind::kSequence;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            bool negative = c == '-';
            if (negative) ++pos_;
            if (!(peek() >= '0' && peek() <= '9')) fail("expected a digit");
            uint64_t value = 0;
            while (peek() >= '0' && peek() <= '9') {
                value = value * 10 + static_cast<uint64_t>(peek() - '0');
                if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) fail("integer too large");
                ++pos_;
            }
            if (peek() == 'L') ++pos_;  // Python 2 long suffix, written by old numpy
            v.integer = negative ? -static_cast<int64_t>(value) : static_cast<int64_t>(value);
            v.kind = PyValue::Kind::kInt;
        } else if (text_.compare(pos_, 4, "True") == 0) {
            pos_ += 4;
            v.kind = PyValue::Kind::kBool;
            v.boolean = true;
        } else if (text_.compare(pos_, 5, "False") == 0) {
            pos_ += 5;
            v.kind = PyValue::Kind::kBool;
        } else if (text_.compare(pos_, 4, "None") == 0) {
            pos_ += 4;
            v.kind = PyValue::Kind::kNone;
        } else {
            fail("expected a Python literal");
        }
        v.text = text_.substr(start, pos_ - start);
        return v;
    }

    const std::string& path_;
    const std::string& text_;
    size_t pos_ = 0;
};

}  // namespace

TokenFile::TokenFile(const std::string& path, TokenDtype memmap_dtype, bool label_mask)
    : path_(path), mask_(label_mask), kind_(label_mask ? "label mask file" : "data file"), dtype_(memmap_dtype) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) user_error("{} {}: cannot open: {}", kind_, path, std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        user_error("{} {}: cannot stat: {}", kind_, path, std::strerror(err));
    }
    if (S_ISDIR(st.st_mode)) {
        ::close(fd);
        user_error("{} {}: is a directory; expected a plain file (no directories or globs)", kind_, path);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        user_error("{} {}: is not a regular file; expected a plain file", kind_, path);
    }
    if (st.st_size == 0) {
        ::close(fd);
        user_error("{} {}: is empty (0 bytes); expected tokens", kind_, path);
    }
    void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    ::close(fd);
    if (p == MAP_FAILED) user_error("{} {}: cannot mmap: {}", kind_, path, std::strerror(map_errno));
    map_ = static_cast<const unsigned char*>(p);
    map_size_ = static_cast<int64_t>(st.st_size);
    try {
        static const char kNpyMagic[] = "\x93NUMPY";
        if (!mask_ && map_size_ >= 4 && load<int32_t>(map_) == kLlmcMagic) {
            read_llmc_header();
        } else if (map_size_ >= 6 && std::memcmp(map_, kNpyMagic, 6) == 0) {
            read_npy_header();
        } else {
            read_raw();
        }
    } catch (...) {
        close_mapping();
        throw;
    }
}

// An llm.c shard. The size rule is llm.c's own (dataloader.h): exactly header + count uint16s.
void TokenFile::read_llmc_header() {
    format_ = TokenFileFormat::kLlmc;
    dtype_ = TokenDtype::kUint16;
    if (map_size_ < kLlmcHeaderBytes) {
        user_error("{} {}: llm.c shard (magic {}) truncated in its header: {} bytes; the header alone is {}", kind_,
                   path_, kLlmcMagic, map_size_, kLlmcHeaderBytes);
    }
    int32_t version = load<int32_t>(map_ + 4);
    if (version != kLlmcVersion) {
        user_error("{} {}: llm.c shard header version {} (byte offset 4); expected {}", kind_, path_, version,
                   kLlmcVersion);
    }
    int32_t count = load<int32_t>(map_ + 8);
    if (count <= 0) {
        user_error("{} {}: llm.c shard header token count {} (byte offset 8); expected > 0", kind_, path_, count);
    }
    int64_t expected = kLlmcHeaderBytes + 2 * static_cast<int64_t>(count);
    if (map_size_ < expected) {
        user_error(
            "{} {}: llm.c shard truncated: header says {} tokens ({} bytes with the header) but "
            "the file has {} bytes",
            kind_, path_, count, expected, map_size_);
    }
    if (map_size_ > expected) {
        user_error(
            "{} {}: llm.c shard has {} trailing bytes: header says {} tokens ({} bytes with the "
            "header) but the file has {} bytes",
            kind_, path_, map_size_ - expected, count, expected, map_size_);
    }
    data_offset_ = kLlmcHeaderBytes;
    num_tokens_ = count;
}

// A .npy array of uint16 or uint32 ids, one or two dimensions, C order.
void TokenFile::read_npy_header() {
    format_ = TokenFileFormat::kNpy;
    if (map_size_ < 10) user_error("{} {}: npy file truncated in its header ({} bytes)", kind_, path_, map_size_);
    int major = map_[6], minor = map_[7];
    int64_t header_len = 0, header_start = 0;
    if (major == 1) {
        header_len = load<uint16_t>(map_ + 8);
        header_start = 10;
    } else if (major == 2 || major == 3) {
        if (map_size_ < 12) {
            user_error("{} {}: npy file truncated in its header ({} bytes)", kind_, path_, map_size_);
        }
        header_len = load<uint32_t>(map_ + 8);
        header_start = 12;
    } else {
        user_error("{} {}: npy format version {}.{} (byte offset 6); expected 1.0, 2.0 or 3.0", kind_, path_, major,
                   minor);
    }
    if (header_start + header_len > map_size_) {
        user_error("{} {}: npy header length {} runs past the end of the file ({} bytes)", kind_, path_, header_len,
                   map_size_);
    }
    std::string header(reinterpret_cast<const char*>(map_ + header_start), static_cast<size_t>(header_len));
    NpyHeaderParser parser(path_, header);
    auto entries = parser.parse_dict();
    const PyValue* descr = nullptr;
    const PyValue* fortran = nullptr;
    const PyValue* shape = nullptr;
    for (const auto& [key, value] : entries) {
        if (key == "descr") {
            descr = &value;
        } else if (key == "fortran_order") {
            fortran = &value;
        } else if (key == "shape") {
            shape = &value;
        } else {
            user_error("{} {}: npy header has an unknown key '{}'; expected descr, fortran_order, shape", kind_, path_,
                       key);
        }
    }
    for (auto [name, value] :
         {std::pair<const char*, const PyValue*>{"descr", descr}, {"fortran_order", fortran}, {"shape", shape}}) {
        if (value == nullptr) user_error("{} {}: npy header {:?} has no '{}'", kind_, path_, parser.shown(), name);
    }
    const bool byte_descr =
        descr->kind == PyValue::Kind::kString && (descr->str == "|b1" || descr->str == "|u1" || descr->str == "<u1");
    if (mask_) {
        if (!byte_descr) {
            user_error("{} {}: npy descr {}; expected '|b1' (bool) or '|u1' (uint8), one byte a token", kind_, path_,
                       descr->text);
        }
    } else if (descr->kind == PyValue::Kind::kString && descr->str == "<u2") {
        dtype_ = TokenDtype::kUint16;
    } else if (descr->kind == PyValue::Kind::kString && descr->str == "<u4") {
        dtype_ = TokenDtype::kUint32;
    } else {
        user_error("{} {}: npy descr {}; expected '<u2' (uint16) or '<u4' (uint32) token ids", kind_, path_,
                   descr->text);
    }
    if (fortran->kind != PyValue::Kind::kBool || fortran->boolean) {
        user_error("{} {}: npy fortran_order {}; expected False (C order)", kind_, path_, fortran->text);
    }
    bool shape_ok = shape->kind == PyValue::Kind::kSequence && (shape->items.size() == 1 || shape->items.size() == 2) &&
                    std::all_of(shape->items.begin(), shape->items.end(),
                                [](const PyValue& d) { return d.kind == PyValue::Kind::kInt && d.integer >= 0; });
    if (!shape_ok) user_error("{} {}: npy shape {}; expected (n,) or (a, b)", kind_, path_, shape->text);
    int64_t numel = shape->items[0].integer;
    if (shape->items.size() == 2) {
        int64_t b = shape->items[1].integer;
        if (b != 0 && numel > std::numeric_limits<int64_t>::max() / 8 / b) {
            user_error("{} {}: npy shape {} is too large", kind_, path_, shape->text);
        }
        numel *= b;
    }
    if (numel > std::numeric_limits<int64_t>::max() / 8) {
        user_error("{} {}: npy shape {} is too large", kind_, path_, shape->text);
    }
    data_offset_ = header_start + header_len;
    int64_t data_bytes = map_size_ - data_offset_;
    int64_t expected = numel * element_size();
    if (data_bytes != expected) {
        user_error(
            "{} {}: npy shape {} of {} needs {} data bytes but the file has {} after its {}-byte "
            "header",
            kind_, path_, shape->text, descr->text, expected, data_bytes, data_offset_);
    }
    if (numel == 0) user_error("{} {}: npy shape {} holds no tokens", kind_, path_, shape->text);
    num_tokens_ = numel;
}

// OLMo's raw memmap: ids of data.memmap_dtype, nothing else.
void TokenFile::read_raw() {
    format_ = TokenFileFormat::kRaw;
    int64_t size = element_size();
    if (map_size_ % size != 0) {
        user_error(
            "{} {}: {} bytes is not a whole number of {} tokens ({} bytes each); set "
            "data.memmap_dtype to the file's token type",
            kind_, path_, map_size_, choice_name(dtype_), size);
    }
    data_offset_ = 0;
    num_tokens_ = map_size_ / size;
}

TokenFile::~TokenFile() { close_mapping(); }

TokenFile::TokenFile(TokenFile&& other) noexcept
    : path_(std::move(other.path_)),
      mask_(other.mask_),
      kind_(other.kind_),
      format_(other.format_),
      dtype_(other.dtype_),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      data_offset_(other.data_offset_),
      num_tokens_(std::exchange(other.num_tokens_, 0)) {}

TokenFile& TokenFile::operator=(TokenFile&& other) noexcept {
    if (this != &other) {
        close_mapping();
        path_ = std::move(other.path_);
        mask_ = other.mask_;
        kind_ = other.kind_;
        format_ = other.format_;
        dtype_ = other.dtype_;
        map_ = std::exchange(other.map_, nullptr);
        map_size_ = std::exchange(other.map_size_, 0);
        data_offset_ = other.data_offset_;
        num_tokens_ = std::exchange(other.num_tokens_, 0);
    }
    return *this;
}

void TokenFile::close_mapping() {
    if (map_ != nullptr) {
        ::munmap(const_cast<unsigned char*>(map_), static_cast<size_t>(map_size_));
        map_ = nullptr;
    }
}

uint32_t TokenFile::token(int64_t i) const {
    TRAINER_CHECK(i >= 0 && i < num_tokens_, "token {} of {} in {}", i, num_tokens_, path_);
    const unsigned char* p = map_ + data_offset_;
    if (mask_) return p[i];
    return dtype_ == TokenDtype::kUint16 ? load<uint16_t>(p + 2 * i) : load<uint32_t>(p + 4 * i);
}

void TokenFile::read_mask(int64_t begin, int64_t count, uint8_t* out) const {
    TRAINER_CHECK(mask_, "read_mask of the token file {}", path_);
    TRAINER_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "mask bytes [{}, {}) of {} in {}", begin,
                  begin + count, num_tokens_, path_);
    std::memcpy(out, map_ + data_offset_ + begin, static_cast<size_t>(count));
}

bool TokenFile::mask_marks_any(int64_t count) const {
    TRAINER_CHECK(mask_ && count >= 0 && count <= num_tokens_, "mask_marks_any({}) of {}", count, path_);
    const unsigned char* p = map_ + data_offset_;
    return std::find_if(p, p + count, [](unsigned char b) { return b != 0; }) != p + count;
}

void TokenFile::read_tokens(int64_t begin, int64_t count, uint32_t* out) const {
    TRAINER_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "tokens [{}, {}) of {} in {}", begin,
                  begin + count, num_tokens_, path_);
    const unsigned char* p = map_ + data_offset_;
    if (dtype_ == TokenDtype::kUint16) {
        for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(p + 2 * (begin + i));
    } else {
        std::memcpy(out, p + 4 * begin, static_cast<size_t>(count) * 4);
    }
}

TokenDataset::TokenDataset(std::vector<std::string> paths, TokenDtype memmap_dtype, int64_t seq_len, int64_t vocab_size,
                           const std::string& paths_key, const std::vector<std::string>& label_mask_paths,
                           const std::string& masks_key)
    : seq_len_(seq_len), vocab_size_(vocab_size) {
    if (paths.empty()) user_error("config {}: empty; expected at least one token file", paths_key);
    if (seq_len < 1) user_error("config model.max_sequence_length: {}; expected >= 1", seq_len);
    // Ids are handed out as int32, so every id below vocab_size must fit.
    if (vocab_size < 1 || vocab_size > int64_t{1} << 31) {
        user_error("config model.vocab_size: {}; expected 1 to 2147483648", vocab_size);
    }
    if (!label_mask_paths.empty() && label_mask_paths.size() != paths.size()) {
        user_error("config {}: {} files for the {} token files of {}; expected one label mask a token file", masks_key,
                   label_mask_paths.size(), paths.size(), paths_key);
    }
    files_.reserve(paths.size());
    first_instance_.push_back(0);
    for (size_t i = 0; i < paths.size(); ++i) {
        files_.emplace_back(paths[i], memmap_dtype);
        num_instances_ += files_.back().num_tokens() / seq_len;
        first_instance_.push_back(num_instances_);
        masks_.emplace_back();
        if (i < label_mask_paths.size() && !label_mask_paths[i].empty()) {
            masks_.back().emplace(label_mask_paths[i], memmap_dtype, true);
            if (masks_.back()->num_tokens() != files_.back().num_tokens()) {
                user_error(
                    "config {}[{}]: the label mask file {} has {} entries and its token file {} has {} tokens; "
                    "expected one a token",
                    masks_key, i, label_mask_paths[i], masks_.back()->num_tokens(), paths[i],
                    files_.back().num_tokens());
            }
            const int64_t in_instances = files_.back().num_tokens() / seq_len * seq_len;
            if (in_instances > 0 && !masks_.back()->mask_marks_any(in_instances)) {
                user_error(
                    "config {}[{}]: the label mask file {} marks no token of {}'s instances for the loss (every "
                    "byte 0): nothing of it would be in the loss; check the mask (1: in the loss), or leave the file "
                    "out",
                    masks_key, i, label_mask_paths[i], paths[i]);
            }
            has_masks_ = true;
        }
    }
    if (num_instances_ == 0) {
        const TokenFile* longest = &files_[0];
        for (const TokenFile& f : files_) {
            if (f.num_tokens() > longest->num_tokens()) longest = &f;
        }
        user_error(
            "config {}: no file holds a full instance of max_sequence_length={} tokens (the longest, {}, "
            "has {} tokens)",
            paths_key, seq_len, longest->path(), longest->num_tokens());
    }
}

std::pair<size_t, int64_t> TokenDataset::locate(int64_t index) const {
    TRAINER_CHECK(index >= 0 && index < num_instances_, "instance {} of {}", index, num_instances_);
    // The file holding `index`: the last one whose first instance is <= index (files with no
    // instance have equal neighbours and are skipped by upper_bound).
    auto it = std::upper_bound(first_instance_.begin(), first_instance_.end(), index);
    const size_t f = static_cast<size_t>(it - first_instance_.begin()) - 1;
    return {f, (index - first_instance_[f]) * seq_len_};
}

void TokenDataset::read_instance(int64_t index, int32_t* out) const {
    const auto [f, begin] = locate(index);
    const TokenFile& file = files_[f];
    for (int64_t i = 0; i < seq_len_; ++i) {
        uint32_t id = file.token(begin + i);
        if (static_cast<int64_t>(id) >= vocab_size_) {
            user_error("data file {}: token id {} at token offset {} (byte offset {}) is >= model.vocab_size {}",
                       file.path(), id, begin + i, file.byte_offset(begin + i), vocab_size_);
        }
        out[i] = static_cast<int32_t>(id);
    }
}

void TokenDataset::read_label_mask(int64_t index, uint8_t* out) const {
    const auto [f, begin] = locate(index);
    if (!masks_[f]) {
        std::fill_n(out, seq_len_, uint8_t{1});
        return;
    }
    const TokenFile& mask = *masks_[f];
    mask.read_mask(begin, seq_len_, out);
    for (int64_t i = 0; i < seq_len_; ++i) {
        if (out[i] > 1) {
            user_error("label mask file {}: value {} at token offset {} (byte offset {}); expected 0 or 1 (a boolean)",
                       mask.path(), out[i], begin + i, mask.byte_offset(begin + i));
        }
    }
}

InstanceOrder::InstanceOrder(int64_t num_instances, int64_t global_batch_size, uint64_t seed, bool shuffle)
    : num_instances_(num_instances), global_batch_size_(global_batch_size), seed_(seed), shuffle_(shuffle) {
    if (global_batch_size < 1) user_error("config global_train_batch_size: {}; expected >= 1", global_batch_size);
    if (num_instances < global_batch_size) {
        user_error(
            "data: {} instances is fewer than global_train_batch_size={}; an epoch needs at least one full "
            "global batch (more data, or a smaller batch or max_sequence_length)",
            num_instances, global_batch_size);
    }
    batches_per_epoch_ = num_instances / global_batch_size;
}

void InstanceOrder::permutation(int64_t n, uint64_t seed, std::vector<int64_t>& out) {
    TRAINER_CHECK(n >= 0, "permutation of {} elements", n);
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    SplitMix64 rng(seed);
    for (int64_t i = n - 1; i > 0; --i) {
        auto j = static_cast<int64_t>(rng.uniform(static_cast<uint64_t>(i) + 1));
        std::swap(out[static_cast<size_t>(i)], out[static_cast<size_t>(j)]);
    }
}

void InstanceOrder::global_batch(int64_t step, std::vector<int64_t>& out) const {
    TRAINER_CHECK(step >= 0, "global batch of step {}", step);
    int64_t epoch = step / batches_per_epoch_;
    int64_t begin = (step % batches_per_epoch_) * global_batch_size_;
    out.resize(static_cast<size_t>(global_batch_size_));
    if (!shuffle_) {
        for (int64_t i = 0; i < global_batch_size_; ++i) out[static_cast<size_t>(i)] = begin + i;
        return;
    }
    if (epoch != cached_epoch_) {
        permutation(num_instances_, seed_ + static_cast<uint64_t>(epoch), order_);
        cached_epoch_ = epoch;
    }
    std::copy(order_.begin() + begin, order_.begin() + begin + global_batch_size_, out.begin());
}

void InstanceOrder::rank_slice(const std::vector<int64_t>& global, int rank, int world, std::vector<int64_t>& out) {
    TRAINER_CHECK(world >= 1 && rank >= 0 && rank < world, "rank {} of world {}", rank, world);
    out.clear();
    for (size_t i = static_cast<size_t>(rank); i < global.size(); i += static_cast<size_t>(world)) {
        out.push_back(global[i]);
    }
}

std::string npy_header(const char* descr, const std::vector<int64_t>& shape) {
    std::string dims = fmt::format("{}", fmt::join(shape, ", "));
    if (shape.size() == 1) dims += ',';  // (n,) for one dimension, (a, b) for more
    std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
    size_t total = 10 + dict.size() + 1;
    dict.append((64 - total % 64) % 64, ' ');
    dict += '\n';
    std::string header = "\x93NUMPY";
    header += '\x01';
    header += '\x00';
    auto len = static_cast<uint16_t>(dict.size());
    header += static_cast<char>(len & 0xff);
    header += static_cast<char>(len >> 8);
    return header + dict;
}

bool repetitive_instance(const int32_t* tokens, int n, const InstanceFilter& filter) {
    const int64_t len = n;
    const int64_t max_period = std::min<int64_t>(filter.max_period, len / 3);
    for (int64_t p = std::max(1, filter.min_period); p <= max_period; ++p) {
        const int64_t rows = (len + (p - len % p)) / p;  // numpy pads p - len % p: a whole row when p divides len
        const auto at = [&](int64_t i) -> int64_t { return i < len ? tokens[i] : -1; };
        // Token c of row r equals the same token of the row before (row 0: of the last row, as np.roll).
        const auto equal = [&](int64_t r, int64_t c) {
            const int64_t prev = r == 0 ? rows - 1 : r - 1;
            return at(r * p + c) == at(prev * p + c);
        };
        const auto whole = [&](int64_t r) {
            for (int64_t c = 0; c < p; ++c) {
                if (!equal(r, c)) return false;
            }
            return true;
        };
        int64_t r = 0;
        while (r < rows) {
            if (!whole(r)) {
                ++r;
                continue;
            }
            const int64_t start_row = r;
            while (r + 1 < rows && whole(r + 1)) ++r;
            const int64_t end_row = r++;
            // The equal tokens that end the row before the run (Python's index -1 is the last row) and start
            // the row after it (never past the last row: it holds padding no token equals).
            const int64_t before = start_row == 0 ? rows - 1 : start_row - 1;
            int64_t trailing = 0;
            while (trailing < p && equal(before, p - 1 - trailing)) ++trailing;
            const int64_t start_offset = trailing > 0 && trailing < p ? trailing : 0;
            int64_t leading = 0;
            if (end_row + 1 < rows) {
                while (leading < p && equal(end_row + 1, leading)) ++leading;
            }
            const int64_t start = (start_row - 1) * p - start_offset, end = (end_row + 1) * p + leading;
            const int64_t span = end - start;
            const int64_t times = span >= 0 ? span / p : -((-span + p - 1) / p);  // Python's floor division
            if (times > 2 && times >= filter.max_count) return true;
        }
    }
    return false;
}

}  // namespace trainer
