// safetensors reading (validated as the reference implementation validates) and F32 writing; see
// safetensors.h. Tensors are read one at a time with stdio, so peak memory is the floats returned
// plus one tensor's raw bytes.
#include "core/weights/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "base/common.h"
#include "base/config.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is read and written little-endian");

namespace trainer {

namespace {

// The reference implementation's limit on the JSON header (safetensors MAX_HEADER_SIZE).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Element size of a dtype this reader converts, 0 for any other.
int64_t dtype_size(const std::string& dtype) {
    if (dtype == "F32") return 4;
    if (dtype == "F64") return 8;
    if (dtype == "BF16" || dtype == "F16") return 2;
    return 0;
}

float bf16_to_float(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

float f16_to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h >> 15) << 31;
    uint32_t exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0) {
        // Zero or subnormal: mantissa * 2^-24, exact in float.
        float f = std::ldexp(static_cast<float>(mantissa), -24);
        return sign ? -f : f;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);  // inf or nan (payload kept)
    } else {
        bits = sign | ((exponent - 15 + 127) << 23) | (mantissa << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Closes a FILE* on scope exit.
struct FileCloser {
    std::FILE* f;
    ~FileCloser() {
        if (f != nullptr) std::fclose(f);
    }
};

// Reads exactly `bytes` at `offset` or throws a UserError naming `what`.
void read_at(std::FILE* f, const std::string& path, int64_t offset, void* out, size_t bytes, const std::string& what) {
    if (bytes == 0) return;
    if (::fseeko(f, static_cast<off_t>(offset), SEEK_SET) != 0 || std::fread(out, 1, bytes, f) != bytes) {
        user_error("safetensors file {}: cannot read {} ({} bytes at byte offset {}): {}", path, what, bytes, offset,
                   std::ferror(f) ? std::strerror(errno) : "unexpected end of file");
    }
}

// A non-negative JSON integer, or -1.
int64_t json_index(const nlohmann::json& v) {
    if (!v.is_number_unsigned()) return -1;
    uint64_t u = v.get<uint64_t>();
    return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? -1 : static_cast<int64_t>(u);
}

struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t numel = 1;
    int64_t begin = 0, end = 0;
};

}  // namespace

int64_t Tensor::numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

namespace {

// The tensors must tile the data section exactly (the reference's InvalidOffset and MetadataIncompleteBuffer
// checks).
void check_tiling(const std::string& path, const std::vector<Entry>& entries, int64_t data_size) {
    std::vector<const Entry*> by_offset;
    for (const Entry& e : entries) by_offset.push_back(&e);
    std::stable_sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    int64_t covered = 0;
    for (const Entry* e : by_offset) {
        if (e->begin != covered) {
            user_error(
                "safetensors file {}: tensor '{}' data_offsets [{}, {}] {} the previous tensor, which ends at {}", path,
                e->name, e->begin, e->end, e->begin > covered ? "leave a gap after" : "overlap", covered);
        }
        covered = e->end;
    }
    if (covered != data_size) {
        user_error("safetensors file {}: the tensors cover {} of the {} data bytes; expected all of them", path,
                   covered, data_size);
    }
}

}  // namespace

void require_finite(const std::map<std::string, Tensor>& tensors, const std::string& what) {
    for (const auto& [name, t] : tensors) {
        const auto bad = std::find_if(t.data.begin(), t.data.end(), [](float x) { return !std::isfinite(x); });
        if (bad != t.data.end()) {
            user_error("{}: tensor \"{}\" holds {} at element {}; the weights must be finite", what, name, *bad,
                       bad - t.data.begin());
        }
    }
}

std::map<std::string, Tensor> read_safetensors(const std::string& path, std::map<std::string, std::string>* metadata) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) user_error("safetensors file {}: cannot open: {}", path, std::strerror(errno));
    FileCloser closer{f};
    struct stat st;
    if (::fstat(fileno(f), &st) != 0) user_error("safetensors file {}: cannot stat: {}", path, std::strerror(errno));
    if (S_ISDIR(st.st_mode)) user_error("safetensors file {}: is a directory; expected a .safetensors file", path);
    auto file_size = static_cast<int64_t>(st.st_size);
    if (file_size < 8) {
        user_error("safetensors file {}: {} bytes is too short; the file starts with an 8-byte header length", path,
                   file_size);
    }
    uint64_t header_len = 0;
    read_at(f, path, 0, &header_len, 8, "the header length");
    if (header_len > static_cast<uint64_t>(file_size - 8)) {
        user_error("safetensors file {}: header length {} (bytes 0-7) runs past the end of the {}-byte file", path,
                   header_len, file_size);
    }
    if (header_len > kMaxHeaderBytes) {
        user_error("safetensors file {}: header length {} exceeds the format's limit of {} bytes", path, header_len,
                   kMaxHeaderBytes);
    }
    std::string header(static_cast<size_t>(header_len), '\0');
    read_at(f, path, 8, header.data(), header.size(), "the header");
    const int64_t data_start = 8 + static_cast<int64_t>(header_len);
    const int64_t data_size = file_size - data_start;

    const nlohmann::json j =
        parse_json(header, fmt::format("safetensors file {}: the {}-byte header", path, header_len));
    if (!j.is_object()) {
        user_error("safetensors file {}: header is a JSON {}; expected an object of tensors", path, j.type_name());
    }

    if (metadata != nullptr) metadata->clear();
    std::vector<Entry> entries;
    for (const auto& [name, v] : j.items()) {
        if (name == "__metadata__") {
            if (!v.is_object()) {
                user_error("safetensors file {}: __metadata__ is a JSON {}; expected an object of strings", path,
                           v.type_name());
            }
            for (const auto& [key, value] : v.items()) {
                if (!value.is_string()) {
                    user_error("safetensors file {}: __metadata__ key '{}' is {}; expected a string", path, key,
                               value.dump());
                }
                if (metadata != nullptr) (*metadata)[key] = value.get<std::string>();
            }
            continue;
        }
        if (!v.is_object()) {
            user_error("safetensors file {}: tensor '{}' is {}; expected an object with dtype, shape and data_offsets",
                       path, name, v.dump());
        }
        for (const char* key : {"dtype", "shape", "data_offsets"}) {
            if (!v.contains(key)) user_error("safetensors file {}: tensor '{}' has no '{}'", path, name, key);
        }
        Entry e;
        e.name = name;
        const auto& dtype = v["dtype"];
        if (!dtype.is_string()) {
            user_error("safetensors file {}: tensor '{}' dtype {}; expected a string", path, name, dtype.dump());
        }
        e.dtype = dtype.get<std::string>();
        int64_t elem = dtype_size(e.dtype);
        if (elem == 0) {
            user_error("safetensors file {}: tensor '{}' dtype {} is not supported; expected F32, F64, BF16 or F16",
                       path, name, e.dtype);
        }
        const auto& shape = v["shape"];
        if (!shape.is_array()) {
            user_error("safetensors file {}: tensor '{}' shape {}; expected a list of sizes", path, name, shape.dump());
        }
        for (const auto& d : shape) {
            int64_t size = json_index(d);
            if (size < 0) {
                user_error("safetensors file {}: tensor '{}' shape {}; expected non-negative integer sizes", path, name,
                           shape.dump());
            }
            if (size != 0 && e.numel > std::numeric_limits<int64_t>::max() / 8 / size) {
                user_error("safetensors file {}: tensor '{}' shape {} is too large", path, name, shape.dump());
            }
            e.numel *= size;
            e.shape.push_back(size);
        }
        const auto& offsets = v["data_offsets"];
        if (!offsets.is_array() || offsets.size() != 2 || json_index(offsets[0]) < 0 || json_index(offsets[1]) < 0 ||
            json_index(offsets[0]) > json_index(offsets[1])) {
            user_error("safetensors file {}: tensor '{}' data_offsets {}; expected [begin, end] with 0 <= begin <= end",
                       path, name, offsets.dump());
        }
        e.begin = json_index(offsets[0]);
        e.end = json_index(offsets[1]);
        if (e.end > data_size) {
            user_error("safetensors file {}: tensor '{}' data_offsets {} run past the {}-byte data section", path, name,
                       offsets.dump(), data_size);
        }
        if (e.end - e.begin != e.numel * elem) {
            user_error("safetensors file {}: tensor '{}' data_offsets {} span {} bytes; shape {} of {} needs {}", path,
                       name, offsets.dump(), e.end - e.begin, shape.dump(), e.dtype, e.numel * elem);
        }
        entries.push_back(std::move(e));
    }

    check_tiling(path, entries, data_size);

    std::map<std::string, Tensor> out;
    std::vector<unsigned char> raw;
    for (const Entry& e : entries) {
        Tensor t;
        t.shape = e.shape;
        t.data.resize(static_cast<size_t>(e.numel));
        auto bytes = static_cast<size_t>(e.end - e.begin);
        std::string what = fmt::format("tensor '{}'", e.name);
        if (e.dtype == "F32") {
            read_at(f, path, data_start + e.begin, t.data.data(), bytes, what);
        } else {
            raw.resize(bytes);
            read_at(f, path, data_start + e.begin, raw.data(), bytes, what);
            for (size_t i = 0; i < t.data.size(); ++i) {
                if (e.dtype == "F64") {
                    double d;
                    std::memcpy(&d, raw.data() + 8 * i, 8);
                    t.data[i] = static_cast<float>(d);
                } else {
                    uint16_t h;
                    std::memcpy(&h, raw.data() + 2 * i, 2);
                    t.data[i] = e.dtype == "BF16" ? bf16_to_float(h) : f16_to_float(h);
                }
            }
        }
        out.emplace(e.name, std::move(t));
    }
    return out;
}

void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const std::map<std::string, std::string>& metadata) {
    // The header keeps the tensors in the order given (ordered_json), metadata first.
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata.empty()) {
        nlohmann::ordered_json meta = nlohmann::ordered_json::object();
        for (const auto& [key, value] : metadata) meta[key] = value;
        header["__metadata__"] = meta;
    }
    std::set<std::string> names;
    std::vector<size_t> bytes;
    int64_t offset = 0;
    for (const TensorRef& t : tensors) {
        TRAINER_CHECK(t.name != "__metadata__", "tensor name __metadata__ writing {}", path);
        TRAINER_CHECK(names.insert(t.name).second, "duplicate tensor name '{}' writing {}", t.name, path);
        int64_t numel = 1;
        for (int64_t d : t.shape) {
            TRAINER_CHECK(d >= 0, "tensor '{}' has a negative size writing {}", t.name, path);
            numel *= d;
        }
        TRAINER_CHECK(numel == 0 || t.data != nullptr, "tensor '{}' has no data writing {}", t.name, path);
        bytes.push_back(static_cast<size_t>(numel) * sizeof(float));
        header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + numel * 4}}};
        offset += numel * 4;
    }
    std::string text;
    try {
        text = header.dump();
    } catch (const nlohmann::json::exception& e) {
        user_error("safetensors file {}: cannot encode the header (tensor names and metadata must be UTF-8): {}", path,
                   e.what());
    }
    text.append((8 - text.size() % 8) % 8, ' ');
    uint64_t header_len = text.size();

    std::string tmp = path + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) user_error("safetensors file {}: cannot create: {}", tmp, std::strerror(errno));
    bool ok = std::fwrite(&header_len, 8, 1, f) == 1 && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    for (size_t i = 0; ok && i < tensors.size(); ++i) {
        ok = bytes[i] == 0 || std::fwrite(tensors[i].data, 1, bytes[i], f) == bytes[i];
    }
    ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
    int err = errno;
    if (std::fclose(f) != 0 && ok) {
        ok = false;
        err = errno;
    }
    if (!ok) {
        std::remove(tmp.c_str());
        user_error("safetensors file {}: cannot write: {}", tmp, std::strerror(err));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        err = errno;
        std::remove(tmp.c_str());
        user_error("safetensors file {}: cannot rename {} into place: {}", path, tmp, std::strerror(err));
    }
}

}  // namespace trainer
