// The byte tokenizer and prepare_data_bytes (see tokenizer.h). The output is streamed in chunks, so
// inputs larger than memory are fine; the header, which needs the token count, is computed from the
// input sizes up front and the count is checked again as the inputs are read.
#include "core/data/tokenizer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <mutex>
#include <thread>

#include "base/common.h"
#include "base/files.h"
#include "core/data/instruct.h"

namespace trainer {

std::vector<int32_t> byte_encode(const std::string& text) {
    std::vector<int32_t> ids(text.size());
    for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
}

std::string byte_decode(const std::vector<int32_t>& ids, int eos_token_id) {
    std::string text;
    text.reserve(ids.size());
    for (int32_t id : ids) {
        if (id >= 0 && id < 256) {
            text += static_cast<char>(static_cast<unsigned char>(id));
        } else if (id == eos_token_id) {
            text += "<|endoftext|>";
        } else {
            text += fmt::format("<|{}|>", id);
        }
    }
    return text;
}

std::string PrepareDataSummary::to_string() const {
    return fmt::format("wrote {} ({}, {}): {} documents, {} tokens, {} bytes", output, format, choice_name(dtype),
                       documents, tokens, bytes_written);
}

namespace {

// The output file while it is written: OUTPUT.tmp, removed unless commit() renamed it into place.
class TempOutput {
   public:
    explicit TempOutput(const std::string& output) : output_(output), tmp_(output + ".tmp") {
        file_ = std::fopen(tmp_.c_str(), "wb");
        if (file_ == nullptr) user_error("prepare data: cannot create {}: {}", tmp_, std::strerror(errno));
    }
    ~TempOutput() {
        if (file_ != nullptr) std::fclose(file_);
        if (!committed_) std::remove(tmp_.c_str());
    }
    TempOutput(const TempOutput&) = delete;
    TempOutput& operator=(const TempOutput&) = delete;

    void write(const void* data, size_t bytes) {
        if (bytes != 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
            user_error("prepare data: cannot write {}: {}", tmp_, std::strerror(errno));
        }
        written_ += static_cast<int64_t>(bytes);
    }

    // Flushes to disk and renames OUTPUT.tmp to OUTPUT.
    void commit() {
        if (std::fflush(file_) != 0 || ::fsync(fileno(file_)) != 0) {
            user_error("prepare data: cannot write {}: {}", tmp_, std::strerror(errno));
        }
        int rc = std::fclose(file_);
        file_ = nullptr;
        if (rc != 0) user_error("prepare data: cannot write {}: {}", tmp_, std::strerror(errno));
        if (std::rename(tmp_.c_str(), output_.c_str()) != 0) {
            user_error("prepare data: cannot rename {} to {}: {}", tmp_, output_, std::strerror(errno));
        }
        committed_ = true;
    }

    int64_t written() const { return written_; }

    // Overwrites bytes already written at `offset` (a header whose count is known only at the end).
    void rewrite(int64_t offset, const void* data, size_t bytes) {
        if (std::fseek(file_, static_cast<long>(offset), SEEK_SET) != 0 ||
            std::fwrite(data, 1, bytes, file_) != bytes || std::fseek(file_, 0, SEEK_END) != 0) {
            user_error("prepare data: cannot write {}: {}", tmp_, std::strerror(errno));
        }
    }

   private:
    std::string output_;
    std::string tmp_;
    std::FILE* file_ = nullptr;
    bool committed_ = false;
    int64_t written_ = 0;
};

// An npy version 1.0 header for a 1-D array of tokens.
std::string npy_header(TokenDtype dtype, int64_t n) {
    return trainer::npy_header(dtype == TokenDtype::kUint16 ? "<u2" : "<u4", {n});
}

// Appends `count` token ids to `out` as `dtype`, little-endian.
void append_tokens(const uint32_t* ids, size_t count, TokenDtype dtype, std::vector<unsigned char>& out) {
    for (size_t i = 0; i < count; ++i) {
        uint32_t id = ids[i];
        out.push_back(static_cast<unsigned char>(id & 0xff));
        out.push_back(static_cast<unsigned char>((id >> 8) & 0xff));
        if (dtype == TokenDtype::kUint32) {
            out.push_back(static_cast<unsigned char>((id >> 16) & 0xff));
            out.push_back(static_cast<unsigned char>(id >> 24));
        }
    }
}

// The arguments every tokenizer's data preparation checks first.
void check_prepare_args(const std::vector<std::string>& inputs, const std::string& output, TokenDtype dtype,
                        const std::string& format) {
    if (inputs.empty()) user_error("prepare data: no input files; expected at least one document");
    if (output.empty()) user_error("prepare data: empty output path");
    if (format != "raw" && format != "npy" && format != "llmc") {
        user_error("prepare data: format \"{}\"; expected raw, npy or llmc", format);
    }
    if (format == "llmc" && dtype != TokenDtype::kUint16) {
        user_error("prepare data: format llmc stores uint16 tokens; got dtype {}", choice_name(dtype));
    }
}

// The size of each input, each checked to be a readable regular file (named when not).
std::vector<int64_t> input_sizes(const std::vector<std::string>& inputs) {
    std::vector<int64_t> sizes;
    for (const std::string& input : inputs) {
        struct stat st;
        if (::stat(input.c_str(), &st) != 0) {
            user_error("prepare data: input file {}: cannot open: {}", input, std::strerror(errno));
        }
        if (!S_ISREG(st.st_mode)) {
            user_error("prepare data: input file {}: is {}; expected a document file", input,
                       S_ISDIR(st.st_mode) ? "a directory" : "not a regular file");
        }
        sizes.push_back(static_cast<int64_t>(st.st_size));
    }
    return sizes;
}

// The header of `format` for `tokens` tokens (empty for raw). Its size does not depend on the count (an npy
// header pads to 128 bytes for any count below 10^60), so a placeholder can be rewritten at the end.
std::string format_header(const std::string& format, TokenDtype dtype, int64_t tokens) {
    if (format == "npy") return npy_header(dtype, tokens);
    if (format != "llmc") return std::string();
    std::vector<int32_t> header(kLlmcHeaderInts, 0);
    header[0] = kLlmcMagic;
    header[1] = kLlmcVersion;
    header[2] = static_cast<int32_t>(tokens);
    return std::string(reinterpret_cast<const char*>(header.data()), header.size() * sizeof(int32_t));
}

// The whole of an input file, whose size was `size` when checked.
std::string read_document(const std::string& input, int64_t size) {
    std::string text = read_file(input, "prepare data: input file");
    if (static_cast<int64_t>(text.size()) != size) {
        user_error("prepare data: input file {}: changed while being read ({} bytes when checked)", input, size);
    }
    return text;
}

}  // namespace

void check_prepare_output(const std::vector<std::string>& inputs, const std::string& output, bool overwrite) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::exists(output, ec)) return;
    for (const std::string& in : inputs) {
        if (fs::equivalent(in, output, ec)) {
            user_error("prepare data: -o {} is also an input; write the token file elsewhere (its text would be lost)",
                       output);
        }
    }
    if (!overwrite)
        user_error("prepare data: {} already exists; pass --overwrite to replace it, or choose another -o", output);
}

PrepareDataSummary prepare_data_bytes(const std::vector<std::string>& inputs, const std::string& output,
                                      TokenDtype dtype, const std::string& format, int eos_token_id) {
    check_prepare_args(inputs, output, dtype, format);
    int64_t max_id = dtype == TokenDtype::kUint16 ? 65535 : std::numeric_limits<uint32_t>::max();
    if (eos_token_id < 256 || eos_token_id > max_id) {
        user_error("prepare data: eos_token_id {}; expected 256 to {} (ids 0..255 are the bytes, and it must fit {})",
                   eos_token_id, max_id, choice_name(dtype));
    }

    // Every input is checked before anything is written.
    const std::vector<int64_t> sizes = input_sizes(inputs);
    int64_t tokens = 0;
    for (int64_t size : sizes) tokens += size + 1;
    if (format == "llmc" && tokens > std::numeric_limits<int32_t>::max()) {
        user_error(
            "prepare data: {} tokens; an llm.c shard holds at most {} (its count is an int32); split the "
            "inputs over several outputs",
            tokens, std::numeric_limits<int32_t>::max());
    }

    TempOutput out(output);
    const std::string header = format_header(format, dtype, tokens);
    out.write(header.data(), header.size());

    constexpr size_t kChunk = size_t{1} << 20;
    std::vector<unsigned char> in_buf(kChunk);
    std::vector<uint32_t> ids(kChunk);
    std::vector<unsigned char> out_buf;
    out_buf.reserve(kChunk * 4);
    for (size_t d = 0; d < inputs.size(); ++d) {
        const std::string& input = inputs[d];
        std::FILE* in = std::fopen(input.c_str(), "rb");
        if (in == nullptr) user_error("prepare data: input file {}: cannot open: {}", input, std::strerror(errno));
        int64_t read_total = 0;
        for (;;) {
            size_t n = std::fread(in_buf.data(), 1, kChunk, in);
            if (n == 0) break;
            for (size_t i = 0; i < n; ++i) ids[i] = in_buf[i];
            out_buf.clear();
            append_tokens(ids.data(), n, dtype, out_buf);
            read_total += static_cast<int64_t>(n);
            if (read_total > sizes[d]) break;
            out.write(out_buf.data(), out_buf.size());
        }
        bool failed = std::ferror(in) != 0;
        int read_errno = errno;
        std::fclose(in);
        if (failed) user_error("prepare data: input file {}: cannot read: {}", input, std::strerror(read_errno));
        if (read_total != sizes[d]) {
            user_error("prepare data: input file {}: changed while being read ({} bytes, {} when checked)", input,
                       read_total, sizes[d]);
        }
        uint32_t eos = static_cast<uint32_t>(eos_token_id);
        out_buf.clear();
        append_tokens(&eos, 1, dtype, out_buf);
        out.write(out_buf.data(), out_buf.size());
    }
    out.commit();

    return PrepareDataSummary{static_cast<int64_t>(inputs.size()), tokens, out.written(), output, format, dtype};
}

PrepareDataSummary prepare_data_bpe(const std::vector<std::string>& inputs, const std::string& output, TokenDtype dtype,
                                    const std::string& format, int eos_token_id, const BpeTokenizer& tokenizer,
                                    int threads) {
    check_prepare_args(inputs, output, dtype, format);
    const int64_t max_id = dtype == TokenDtype::kUint16 ? 65535 : std::numeric_limits<uint32_t>::max();
    if (tokenizer.vocab_size() - 1 > max_id) {
        user_error("prepare data: {} token ids reach {}, which {} cannot hold; use --dtype uint32{}", tokenizer.name(),
                   tokenizer.vocab_size() - 1, choice_name(dtype),
                   format == "llmc" ? " and --format raw or npy (llm.c shards hold uint16)" : "");
    }
    if (eos_token_id < 0 || eos_token_id > max_id) {
        user_error("prepare data: eos_token_id {}; expected 0 to {} (it must fit {})", eos_token_id, max_id,
                   choice_name(dtype));
    }
    const std::vector<int64_t> sizes = input_sizes(inputs);
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

    TempOutput out(output);
    const std::string placeholder = format_header(format, dtype, 0);
    out.write(placeholder.data(), placeholder.size());
    // Worker threads take the next document (up to `window` ahead of the writer, which bounds memory); this
    // thread writes them in input order as each is done. The first failure stops the workers.
    const size_t count = inputs.size(), window = static_cast<size_t>(threads) * 8;
    std::vector<std::vector<int32_t>> ids(count);
    std::vector<std::exception_ptr> errors(count);
    std::vector<char> done(count, 0);
    std::mutex mu;
    std::condition_variable cv;
    size_t next = 0, written = 0;
    bool stop = false;
    auto work = [&] {
        for (;;) {
            size_t k;
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return stop || next >= count || next < written + window; });
                if (stop || next >= count) return;
                k = next++;
            }
            std::vector<int32_t> doc;
            std::exception_ptr error;
            try {
                doc = tokenizer.encode(read_document(inputs[k], sizes[k]), "prepare data: input file " + inputs[k]);
            } catch (...) {
                error = std::current_exception();
            }
            std::lock_guard<std::mutex> lock(mu);
            ids[k] = std::move(doc);
            errors[k] = error;
            done[k] = 1;
            cv.notify_all();
        }
    };
    std::vector<std::thread> pool;
    for (int t = 0; t < std::min<int>(threads, static_cast<int>(count)); ++t) pool.emplace_back(work);
    auto stop_workers = [&] {
        {
            std::lock_guard<std::mutex> lock(mu);
            stop = true;
        }
        cv.notify_all();
        for (auto& t : pool) t.join();
        pool.clear();
    };
    int64_t tokens = 0;
    std::vector<unsigned char> out_buf;
    try {
        for (size_t k = 0; k < count; ++k) {
            std::vector<int32_t> doc;
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return done[k] != 0; });
                if (errors[k]) std::rethrow_exception(errors[k]);
                doc = std::move(ids[k]);
                written = k + 1;
            }
            cv.notify_all();
            doc.push_back(eos_token_id);
            out_buf.clear();
            append_tokens(reinterpret_cast<const uint32_t*>(doc.data()), doc.size(), dtype, out_buf);
            out.write(out_buf.data(), out_buf.size());
            tokens += static_cast<int64_t>(doc.size());
        }
    } catch (...) {
        stop_workers();
        throw;
    }
    stop_workers();
    if (format == "llmc" && tokens > std::numeric_limits<int32_t>::max()) {
        user_error(
            "prepare data: {} tokens; an llm.c shard holds at most {} (its count is an int32); split the inputs "
            "over several outputs",
            tokens, std::numeric_limits<int32_t>::max());
    }
    const std::string header = format_header(format, dtype, tokens);
    out.rewrite(0, header.data(), header.size());
    out.commit();

    return PrepareDataSummary{static_cast<int64_t>(inputs.size()), tokens, out.written(), output, format, dtype};
}

std::string prepare_instruct_data(const std::vector<std::string>& inputs, const std::string& output, TokenDtype dtype,
                                  const std::string& format, int eos_token_id,
                                  const std::function<std::vector<int32_t>(const std::string&)>& encode,
                                  const InstructOptions& options) {
    check_prepare_args(inputs, output, dtype, format);
    if (options.seq_len == 0) {
        user_error(
            "prepare-data --instruct: --seq-len is required: the model's max_sequence_length, the tokens of an "
            "instance");
    }
    if (options.seq_len < 2) {
        user_error("prepare-data --instruct --seq-len {}: expected the model's max_sequence_length (>= 2)",
                   options.seq_len);
    }
    const int64_t max_id = dtype == TokenDtype::kUint16 ? 65535 : std::numeric_limits<uint32_t>::max();
    const int pad = options.pad_id < 0 ? eos_token_id : options.pad_id;
    if (pad > max_id || eos_token_id > max_id) {
        user_error("prepare data: the EOS id {} or pad id {} does not fit {}", eos_token_id, pad, choice_name(dtype));
    }
    const ChatTemplate chat = chat_template_named(options.chat_template);
    const std::vector<int64_t> sizes = input_sizes(inputs);
    std::vector<InstructExample> examples;
    for (size_t f = 0; f < inputs.size(); ++f) {
        const std::string text = read_document(inputs[f], sizes[f]);
        size_t begin = 0;
        for (long line = 1; begin < text.size(); ++line) {
            size_t end = text.find('\n', begin);
            if (end == std::string::npos) end = text.size();
            const std::string record = text.substr(begin, end - begin);
            begin = end + 1;
            if (record.find_first_not_of(" \t\r") == std::string::npos) continue;
            examples.push_back(render_instruct_record(record, chat, encode, eos_token_id, options.train_on_prompt,
                                                      fmt::format("prepare data: {} line {}", inputs[f], line)));
            for (const int32_t id : examples.back().ids) {
                if (id < 0 || id > max_id) {
                    user_error("prepare data: {} line {}: token id {} does not fit {}", inputs[f], line, id,
                               choice_name(dtype));
                }
            }
        }
    }
    if (examples.empty()) user_error("prepare data: the inputs hold no record (JSONL: one JSON object a line)");
    const InstructLayout laid = lay_out_examples(examples, options.seq_len, options.pack, pad);
    if (laid.tokens_in_loss == 0) {
        // The training would be refused on this mask (it marks nothing); say why here, before anything is written.
        user_error(
            "prepare data: no token of the {} examples is in the loss: {} of them lost every answer token to the "
            "cut at --seq-len {}; a longer --seq-len keeps their answers",
            laid.examples, laid.emptied, options.seq_len);
    }
    const std::string mask_path = output + ".mask";
    TempOutput tokens_out(output), mask_out(mask_path);
    const int64_t n = static_cast<int64_t>(laid.tokens.size());
    if (format == "llmc" && n > std::numeric_limits<int32_t>::max()) {
        user_error("prepare data: {} tokens; an llm.c shard holds at most {}", n, std::numeric_limits<int32_t>::max());
    }
    const std::string header = format_header(format, dtype, n);
    tokens_out.write(header.data(), header.size());
    std::vector<unsigned char> bytes;
    std::vector<uint32_t> ids(laid.tokens.begin(), laid.tokens.end());
    append_tokens(ids.data(), ids.size(), dtype, bytes);
    tokens_out.write(bytes.data(), bytes.size());
    mask_out.write(laid.mask.data(), laid.mask.size());
    mask_out.commit();
    tokens_out.commit();
    return fmt::format(
        "wrote {} ({}, {}) and its label mask {}: {} examples in {} instances of {} tokens ({}), {:.1f}% of the "
        "instances' tokens examples', {} tokens marked for the loss{}",
        output, format, choice_name(dtype), mask_path, laid.examples, laid.instances, options.seq_len,
        options.pack ? "packed" : "one an instance, padded", 100.0 * laid.efficiency(), laid.tokens_in_loss,
        laid.truncated > 0 ? fmt::format("; {} longer than an instance {} cut to it ({} of them left with nothing in "
                                         "the loss: a longer --seq-len keeps their answers)",
                                         laid.truncated == 1 ? "1 example" : fmt::format("{} examples", laid.truncated),
                                         laid.truncated == 1 ? "was" : "were", laid.emptied)
                           : std::string());
}

std::vector<int32_t> parse_token_ids(const std::string& text, const std::string& what) {
    std::vector<int32_t> ids;
    std::string number;
    auto flush = [&] {
        if (number.empty()) return;
        size_t used = 0;
        long v = -1;
        try {
            v = std::stol(number, &used);
        } catch (const std::exception&) {
        }
        if (used != number.size() || v < 0 || v > INT32_MAX) user_error("{}: \"{}\" is not a token id", what, number);
        ids.push_back(static_cast<int32_t>(v));
        number.clear();
    };
    for (char c : text) {
        if (std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '[' || c == ']')
            flush();
        else
            number += c;
    }
    flush();
    return ids;
}

}  // namespace trainer
