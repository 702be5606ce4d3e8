// Token files, the dataset of fixed-length instances over them, and the order instances are read in.
//
// OLMo's data model (its DataConfig and the enums it uses), kept exactly so an OLMo user's data and
// expectations carry over:
//  * A token file is a flat array of token ids, documents concatenated with EOS. Three layouts are
//    read, told apart by the first bytes of the file:
//      - llm.c shard: int32[256] header {20240520, 1, token count, 0...}, then exactly `count` uint16
//        tokens. llm.c's own loader refuses any other file size, so do we: a shorter file is
//        "truncated", a longer one "has trailing bytes".
//      - .npy (starts with "\x93NUMPY", versions 1, 2 and 3): 'descr' '<u2' or '<u4', 'fortran_order'
//        False, 'shape' (n,) or (a, b) read flattened in C order; the data must be exactly
//        numel * itemsize bytes. The header's dtype is used; `memmap_dtype` does not apply.
//      - anything else: a raw array of `memmap_dtype` (OLMo's data.memmap_dtype) with no header; the
//        size must be a whole number of tokens.
//    A file holding zero tokens is refused in every layout (OLMo's np.memmap and llm.c both refuse).
//  * Files are mapped read-only (mmap, no copy); all reads are const and safe from many threads.
//  * Instances are consecutive max_sequence_length chunks of each file, the remainder of each file
//    dropped; the instance index is the global offset across the files in the order given.
//  * InstanceOrder: epoch e reads a permutation of all instances seeded by `seed + e`; each epoch
//    uses floor(N / G) * G of them so every global batch is whole; global batch `step` is positions
//    [step * G, (step + 1) * G) of the concatenated epoch orders. It depends on (seed, step) only,
//    never on the world size: rank r of W takes entries r, r + W, ... of the global batch.
//  * Label masks (OLMo's data.label_mask_paths): a file per token file, one byte a token (0 or 1), raw or .npy of
//    bool; a token whose byte is 0 is no target: the loss does not predict it, though the model reads it as input.
// Token ids are assumed little-endian, as numpy, llm.c and OLMo write them on every common machine.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"

namespace trainer {

// Bytes per token: 2 or 4.
int64_t token_dtype_size(TokenDtype dtype);

// How a token file is laid out (see the file comment).
enum class TokenFileFormat { kRaw, kNpy, kLlmc };

// "raw", "npy" or "llm.c".
const char* token_file_format_name(TokenFileFormat format);

// The magic number and header size of llm.c token shards (llm.c dev/data/data_common.py).
constexpr int32_t kLlmcMagic = 20240520;
constexpr int32_t kLlmcVersion = 1;
constexpr int64_t kLlmcHeaderInts = 256;
constexpr int64_t kLlmcHeaderBytes = kLlmcHeaderInts * 4;

// One token file mapped read-only. The layout is detected from the header on open; every problem
// with the file (missing, unreadable, a directory, empty, malformed header, size not matching) is a
// UserError naming the path. Move-only: it owns the mapping.
// With `label_mask`, a label mask file instead (OLMo's data.label_mask_paths): one byte a token, 0 or 1, raw (a
// boolean memmap as OLMo writes it) or .npy of bool or uint8; its "tokens" are those bytes.
class TokenFile {
   public:
    // Opens and maps `path`; `memmap_dtype` is the element type used when the file has no header.
    TokenFile(const std::string& path, TokenDtype memmap_dtype, bool label_mask = false);
    ~TokenFile();
    TokenFile(TokenFile&& other) noexcept;
    TokenFile& operator=(TokenFile&& other) noexcept;
    TokenFile(const TokenFile&) = delete;
    TokenFile& operator=(const TokenFile&) = delete;

    // Number of tokens in the file (> 0).
    int64_t num_tokens() const { return num_tokens_; }
    // Token `i`, 0 <= i < num_tokens() (checked: an index outside is a bug in the caller).
    uint32_t token(int64_t i) const;
    // Copies tokens [begin, begin + count) into `out` (range checked as token()).
    void read_tokens(int64_t begin, int64_t count, uint32_t* out) const;
    // The path as given.
    const std::string& path() const { return path_; }
    // The detected layout, and its name for messages.
    TokenFileFormat format() const { return format_; }
    const char* format_name() const { return token_file_format_name(format_); }
    // The element type of the tokens (from the header for npy and llm.c files).
    TokenDtype dtype() const { return dtype_; }
    // Byte offset of token `i` in the file (for messages).
    int64_t byte_offset(int64_t i) const { return data_offset_ + i * element_size(); }
    // A label mask file's: bytes [begin, begin + count) into `out` (range checked as token()).
    void read_mask(int64_t begin, int64_t count, uint8_t* out) const;
    // Whether any of a mask file's first `count` bytes is nonzero (it stops at the first: a mask that marks
    // anything is read only up to that byte).
    bool mask_marks_any(int64_t count) const;

   private:
    int64_t element_size() const { return mask_ ? 1 : token_dtype_size(dtype_); }
    void close_mapping();
    // The header and size of each format, setting format_, dtype_, data_offset_ and num_tokens_.
    void read_llmc_header();
    void read_npy_header();
    void read_raw();

    std::string path_;
    bool mask_ = false;
    const char* kind_ = "data file";  // how messages name it: "data file" or "label mask file"
    TokenFileFormat format_ = TokenFileFormat::kRaw;
    TokenDtype dtype_ = TokenDtype::kUint16;
    const unsigned char* map_ = nullptr;  // the whole file, PROT_READ
    int64_t map_size_ = 0;                // file size in bytes
    int64_t data_offset_ = 0;             // bytes before token 0 (the header)
    int64_t num_tokens_ = 0;
};

// The training instances: consecutive seq_len-token chunks of each file, the remainder of each file
// dropped, indexed globally across the files in order. read_instance is const and thread-safe.
class TokenDataset {
   public:
    // Opens every path (plain files: no globs, no directories). UserError when `paths` is empty,
    // when seq_len or vocab_size is not positive, on any bad file, or when no file holds a full
    // instance; `paths_key` is the config key named in those messages (an evaluator's differs).
    // Token ids are checked against vocab_size as instances are read, not here, so opening a
    // multi-GB dataset costs nothing.
    // label_mask_paths: empty (every target in the loss), or one per path (an empty string: that file's targets
    // all in the loss), each a label mask file of as many entries as its token file has tokens, else a UserError
    // naming `masks_key`.
    TokenDataset(std::vector<std::string> paths, TokenDtype memmap_dtype, int64_t seq_len, int64_t vocab_size,
                 const std::string& paths_key = "data.paths", const std::vector<std::string>& label_mask_paths = {},
                 const std::string& masks_key = "data.label_mask_paths");

    // Total instances across all files (> 0).
    int64_t num_instances() const { return num_instances_; }
    // Tokens per instance (max_sequence_length).
    int64_t seq_len() const { return seq_len_; }
    // The token files, in the order given.
    const std::vector<TokenFile>& files() const { return files_; }
    // The first global instance index of file `f`; first_instance(files().size()) is num_instances().
    int64_t first_instance(size_t f) const { return first_instance_.at(f); }
    // Copies the seq_len tokens of instance `index` (0 <= index < num_instances(), checked) into
    // `out`. A token id >= vocab_size is a UserError naming the file, the token and byte offset, the
    // id and the vocabulary size.
    void read_instance(int64_t index, int32_t* out) const;
    // Whether any file has a label mask.
    bool has_label_masks() const { return has_masks_; }
    // The seq_len mask values of instance `index` into `out`: 1 where the token is a target in the loss (a label
    // mask's true, or every token of a file without one). A value other than 0 or 1 is a UserError naming the file
    // and its byte offset.
    void read_label_mask(int64_t index, uint8_t* out) const;

   private:
    // The file holding instance `index` and the instance's first token in it.
    std::pair<size_t, int64_t> locate(int64_t index) const;
    std::vector<TokenFile> files_;
    std::vector<std::optional<TokenFile>> masks_;  // files_[i]'s label mask, where it has one
    bool has_masks_ = false;
    std::vector<int64_t> first_instance_;  // first global instance index of each file; size files + 1
    int64_t seq_len_ = 0;
    int64_t vocab_size_ = 0;
    int64_t num_instances_ = 0;
};

// splitmix64 (Steele, Lea and Flood 2014; the reference is Vigna's public-domain splitmix64.c).
class SplitMix64 {
   public:
    explicit SplitMix64(uint64_t state) : state_(state) {}
    uint64_t next() {
        uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    // Exactly uniform in [0, k), k >= 1: reject the 2^64 mod k lowest draws so the rest is a whole
    // number of copies of [0, k).
    uint64_t uniform(uint64_t k) {
        uint64_t threshold = (0 - k) % k;
        for (;;) {
            uint64_t r = next();
            if (r >= threshold) return r % k;
        }
    }

   private:
    uint64_t state_;
};

// Which instances make up each global batch: a function of (seed, step) alone, never of the world size.
class BatchOrder {
   public:
    virtual ~BatchOrder() = default;
    // The global_train_batch_size instance indices of global batch `step` (0-based) into `out`.
    virtual void global_batch(int64_t step, std::vector<int64_t>& out) const = 0;
};

// Which instances make up each global batch. Not thread-safe: global_batch caches the current
// epoch's permutation (8 bytes per instance) and recomputes it only when the epoch changes.
//
// The shuffle is specified exactly, so the order is the same on every platform and compiler:
// epoch e uses splitmix64 (Steele, Lea and Flood 2014) with its state set to seed + e; Fisher-Yates
// from the back: for i = n-1 down to 1, j = uniform(i + 1), swap(order[i], order[j]) starting from
// the identity; uniform(k) draws r = next() until r >= (2^64 - k) mod k and returns r mod k, which
// is exactly uniform (std::shuffle and std::uniform_int_distribution are implementation-defined).
class InstanceOrder : public BatchOrder {
   public:
    // UserError when global_batch_size < 1 or num_instances < global_batch_size (both named).
    InstanceOrder(int64_t num_instances, int64_t global_batch_size, uint64_t seed, bool shuffle);

    // Whole global batches per epoch: floor(num_instances / global_batch_size).
    int64_t batches_per_epoch() const { return batches_per_epoch_; }
    int64_t num_instances() const { return num_instances_; }
    int64_t global_batch_size() const { return global_batch_size_; }
    // The global_batch_size instance indices of global batch `step` (0-based, any epoch) into `out`.
    void global_batch(int64_t step, std::vector<int64_t>& out) const override;
    // Entries rank, rank + world, ... of `global` (rank r's share, as OLMo's indices[r::world]).
    static void rank_slice(const std::vector<int64_t>& global, int rank, int world, std::vector<int64_t>& out);
    // The shuffled order of [0, n) for `seed` (the epoch order is permutation(n, seed + e)).
    static void permutation(int64_t n, uint64_t seed, std::vector<int64_t>& out);

   private:
    int64_t num_instances_ = 0;
    int64_t global_batch_size_ = 0;
    int64_t batches_per_epoch_ = 0;
    uint64_t seed_ = 0;
    bool shuffle_ = true;
    mutable int64_t cached_epoch_ = -1;
    mutable std::vector<int64_t> order_;  // the cached epoch's order (only when shuffling)
};

// An npy version 1.0 header for a C-order array of `shape` with numpy's type string `descr` ("<u2", "<f4"),
// padded as numpy pads it: spaces, then a newline, so that the data starts at a multiple of 64 bytes.
std::string npy_header(const char* descr, const std::vector<int64_t>& shape);

// OLMo's instance filter (data.instance_filter): an instance holding a run of `max_count` or more repeats of
// a sequence of min_period..max_period tokens is masked out of the loss. The detection is OLMo's
// find_periodic_sequences over the instance's L tokens, reproduced exactly: for each period p up to L / 3,
// the tokens (padded with -1 to whole rows of p; a whole row of padding where p divides L) are cut into
// rows, each token compared with the one p before it (the first row with the last, as numpy's roll
// wraps), and each run of whole equal rows, widened by the equal tokens at the end of the row before and
// the start of the row after, is a repetition of (end - start) / p times, counted when above 2.
// Whether OLMo's filter masks the instance of n tokens.
bool repetitive_instance(const int32_t* tokens, int n, const InstanceFilter& filter);

}  // namespace trainer
