// The byte tokenizer and prepare_data_bytes (see tokenizer.h). The output is streamed in chunks, so
// inputs larger than memory are fine; the header, which needs the token count, is computed from the
// input sizes up front and the count is checked again as the inputs are read.
#include "core/tokenizer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "base/common.h"

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
    return fmt::format("wrote {} ({}, {}): {} documents, {} tokens, {} bytes", output, format, token_dtype_name(dtype),
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

   private:
    std::string output_;
    std::string tmp_;
    std::FILE* file_ = nullptr;
    bool committed_ = false;
    int64_t written_ = 0;
};

// An npy version 1.0 header for a 1-D little-endian array, padded as numpy pads it: spaces, then a
// newline, so that the data starts at a multiple of 64 bytes.
std::string npy_header(TokenDtype dtype, int64_t n) {
    std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({},), }}",
                                   dtype == TokenDtype::kUint16 ? "<u2" : "<u4", n);
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

}  // namespace

PrepareDataSummary prepare_data_bytes(const std::vector<std::string>& inputs, const std::string& output,
                                      TokenDtype dtype, const std::string& format, int eos_token_id) {
    if (inputs.empty()) user_error("prepare data: no input files; expected at least one document");
    if (output.empty()) user_error("prepare data: empty output path");
    if (format != "raw" && format != "npy" && format != "llmc") {
        user_error("prepare data: format \"{}\"; expected raw, npy or llmc", format);
    }
    if (format == "llmc" && dtype != TokenDtype::kUint16) {
        user_error("prepare data: format llmc stores uint16 tokens; got dtype {}", token_dtype_name(dtype));
    }
    int64_t max_id = dtype == TokenDtype::kUint16 ? 65535 : std::numeric_limits<uint32_t>::max();
    if (eos_token_id < 256 || eos_token_id > max_id) {
        user_error("prepare data: eos_token_id {}; expected 256 to {} (ids 0..255 are the bytes, and it must fit {})",
                   eos_token_id, max_id, token_dtype_name(dtype));
    }

    // Every input is checked before anything is written.
    std::vector<int64_t> sizes;
    int64_t tokens = 0;
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
        tokens += static_cast<int64_t>(st.st_size) + 1;
    }
    if (format == "llmc" && tokens > std::numeric_limits<int32_t>::max()) {
        user_error(
            "prepare data: {} tokens; an llm.c shard holds at most {} (its count is an int32); split the "
            "inputs over several outputs",
            tokens, std::numeric_limits<int32_t>::max());
    }

    TempOutput out(output);
    if (format == "npy") {
        std::string header = npy_header(dtype, tokens);
        out.write(header.data(), header.size());
    } else if (format == "llmc") {
        std::vector<int32_t> header(kLlmcHeaderInts, 0);
        header[0] = kLlmcMagic;
        header[1] = kLlmcVersion;
        header[2] = static_cast<int32_t>(tokens);
        out.write(header.data(), header.size() * sizeof(int32_t));
    }

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

    PrepareDataSummary summary;
    summary.documents = static_cast<int64_t>(inputs.size());
    summary.tokens = tokens;
    summary.bytes_written = out.written();
    summary.output = output;
    summary.format = format;
    summary.dtype = dtype;
    return summary;
}

}  // namespace trainer
