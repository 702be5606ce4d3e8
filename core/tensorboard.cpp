// TensorBoard event files (see tensorboard.h). The record framing is TFRecord's; the messages are
// tensorflow.Event (wall_time = 1 double, step = 2 int64, file_version = 3 string, summary = 5 Summary),
// tensorflow.Summary (value = 1, repeated) and Summary.Value (tag = 1 string, simple_value = 2 float), encoded here
// field by field in the protocol buffer wire format.
#include "core/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <utility>

#include "base/common.h"
#include "base/files.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

namespace {

constexpr uint32_t kCastagnoli = 0x82F63B78u;  // the CRC-32C polynomial, bit-reversed

std::array<uint32_t, 256> crc_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kCastagnoli : c >> 1;
        t[i] = c;
    }
    return t;
}

// TFRecord's masked CRC: a CRC of data that holds CRCs is itself poorly spread, so it is rotated and offset.
uint32_t masked_crc(const void* data, size_t size) {
    const uint32_t c = crc32c(data, size);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protocol buffer wire format: wire types 0 (varint), 1 (64-bit), 2 (length-delimited), 5 (32-bit).
void put_varint(std::string& out, uint64_t v) {
    while (v >= 0x80) {
        out.push_back(static_cast<char>((v & 0x7f) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, int field, int wire) { put_varint(out, (static_cast<uint64_t>(field) << 3) | wire); }
template <typename T>
void put_fixed(std::string& out, int field, T v) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "fixed fields are 32 or 64 bits");
    put_key(out, field, sizeof(T) == 8 ? 1 : 5);
    char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));  // little-endian on every target this builds for
    out.append(bytes, sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
    put_key(out, field, 2);
    put_varint(out, bytes.size());
    out += bytes;
}

std::string event(double wall_time, long step) {
    std::string e;
    put_fixed(e, 1, wall_time);
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
    return e;
}

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A reader of one message's fields (its own copy of the bytes); a malformed message is a UserError naming `where`.
class Fields {
   public:
    Fields(std::string bytes, std::string where)
        : bytes_(std::move(bytes)), p_(bytes_.data()), end_(p_ + bytes_.size()), where_(std::move(where)) {}
    bool next() {
        if (p_ == end_) return false;
        const uint64_t key = varint();
        field_ = static_cast<int>(key >> 3), wire_ = static_cast<int>(key & 7);
        return true;
    }
    int field() const { return field_; }
    int wire() const { return wire_; }
    uint64_t varint() {
        uint64_t v = 0;
        for (int shift = 0; shift < 64; shift += 7) {
            need(1);
            const auto b = static_cast<unsigned char>(*p_++);
            v |= static_cast<uint64_t>(b & 0x7f) << shift;
            if (!(b & 0x80)) return v;
        }
        user_error("{}: a varint runs past 10 bytes", where_);
    }
    template <typename T>
    T fixed() {
        need(sizeof(T));
        T v;
        std::memcpy(&v, p_, sizeof(T));
        p_ += sizeof(T);
        return v;
    }
    std::string bytes() {
        const uint64_t n = varint();
        need(n);
        std::string s(p_, n);
        p_ += n;
        return s;
    }
    void skip() {
        switch (wire_) {
            case 0:
                varint();
                return;
            case 1:
                fixed<uint64_t>();
                return;
            case 2:
                bytes();
                return;
            case 5:
                fixed<uint32_t>();
                return;
            default:
                user_error("{}: field {} has wire type {}, which no message here uses", where_, field_, wire_);
        }
    }
    void expect(int wire) {
        if (wire_ != wire) user_error("{}: field {} has wire type {}, expected {}", where_, field_, wire_, wire);
    }

   private:
    void need(uint64_t n) {
        if (static_cast<uint64_t>(end_ - p_) < n) user_error("{}: the message ends inside field {}", where_, field_);
    }
    std::string bytes_;
    const char* p_;
    const char* end_;
    std::string where_;
    int field_ = 0, wire_ = 0;
};

void flatten(const std::string& prefix, const Json& v, std::vector<std::pair<std::string, double>>& out) {
    if (v.is_number()) {
        out.emplace_back(prefix, v.get<double>());
    } else if (v.is_object()) {
        for (const auto& [key, item] : v.items()) flatten(prefix.empty() ? key : prefix + "/" + key, item, out);
    } else if (v.is_array()) {
        for (size_t i = 0; i < v.size(); ++i) flatten(prefix + "/" + std::to_string(i), v[i], out);
    }
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
    static const std::array<uint32_t, 256> table = crc_table();
    uint32_t c = 0xffffffffu;
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xffu] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

std::vector<std::pair<std::string, double>> scalars_of(const Json& record) {
    std::vector<std::pair<std::string, double>> out;
    for (const auto& [key, item] : record.items()) {
        if (key != "step") flatten(key, item, out);
    }
    return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec || ::access(dir.c_str(), W_OK) != 0) {
        user_error("tensorboard_dir {}: cannot be created or written ({})", dir,
                   ec ? ec.message() : std::strerror(errno ? errno : EACCES));
    }
    const std::string host = host_name().empty() ? "localhost" : host_name();
    path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, static_cast<long>(now_seconds()), host, ::getpid());
}

TensorBoardWriter::~TensorBoardWriter() {
    if (f_) std::fclose(f_);
}

void TensorBoardWriter::record(const std::string& bytes) {
    // uint64 length, uint32 masked CRC of the length's 8 bytes, the bytes, uint32 masked CRC of the bytes (all
    // little-endian).
    std::string r(12, '\0');
    const uint64_t n = bytes.size();
    std::memcpy(r.data(), &n, 8);
    const uint32_t len_crc = masked_crc(r.data(), 8), crc = masked_crc(bytes.data(), bytes.size());
    std::memcpy(r.data() + 8, &len_crc, 4);
    r += bytes;
    r.append(reinterpret_cast<const char*>(&crc), 4);
    // Written and flushed whole, or not at all: a full disk stops the run (as it stops the metrics file) and leaves
    // the file ending with the last whole record, which TensorBoard reads to the end.
    if (const int e = append_whole(f_, r)) {
        user_error(
            "tensorboard_dir: an event could not be written to {} ({}); the run stops here, its checkpoints as "
            "they were",
            path_, std::strerror(e));
    }
}

void TensorBoardWriter::write(long step, const std::vector<std::pair<std::string, double>>& values) {
    const double wall = now_seconds();
    if (!f_) {
        f_ = std::fopen(path_.c_str(), "wb");
        if (!f_) user_error("tensorboard_dir: cannot create {} ({})", path_, std::strerror(errno));
        std::string version = event(wall, 0);
        put_bytes(version, 3, "brain.Event:2");
        record(version);
    }
    std::string summary;
    for (const auto& [tag, value] : values) {
        std::string v;
        put_bytes(v, 1, tag);
        put_fixed(v, 2, static_cast<float>(value));
        put_bytes(summary, 1, v);
    }
    std::string e = event(wall, step);
    put_bytes(e, 5, summary);
    record(e);
}

std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) user_error("{}: cannot be read ({})", path, std::strerror(errno));
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<TensorBoardScalar> out;
    size_t at = 0;
    while (at < data.size()) {
        const std::string where = fmt::format("{}: the record at byte {}", path, at);
        if (data.size() - at < 12) user_error("{} is cut short", where);
        uint64_t n = 0;
        uint32_t len_crc = 0, crc = 0;
        std::memcpy(&n, data.data() + at, 8);
        std::memcpy(&len_crc, data.data() + at + 8, 4);
        if (len_crc != masked_crc(data.data() + at, 8)) user_error("{}: its length fails its checksum", where);
        if (data.size() - at - 12 < n + 4) user_error("{} is cut short", where);
        const std::string bytes = data.substr(at + 12, n);
        std::memcpy(&crc, data.data() + at + 12 + n, 4);
        if (crc != masked_crc(bytes.data(), bytes.size())) user_error("{}: its data fail their checksum", where);
        at += 12 + n + 4;
        Fields e(bytes, where);
        double wall = 0.0;
        long step = 0;
        std::vector<std::pair<std::string, float>> values;
        while (e.next()) {
            if (e.field() == 1) {
                e.expect(1), wall = e.fixed<double>();
            } else if (e.field() == 2) {
                e.expect(0), step = static_cast<long>(e.varint());
            } else if (e.field() == 3) {
                e.expect(2);
                const std::string version = e.bytes();
                if (version != "brain.Event:2")
                    user_error("{}: file_version {}, expected brain.Event:2", where, version);
            } else if (e.field() == 5) {
                e.expect(2);
                Fields s(e.bytes(), where + " (its summary)");
                while (s.next()) {
                    if (s.field() != 1) {
                        s.skip();
                        continue;
                    }
                    s.expect(2);
                    Fields v(s.bytes(), where + " (a summary value)");
                    std::string tag;
                    float value = 0.0f;
                    bool simple = false;
                    while (v.next()) {
                        if (v.field() == 1) {
                            v.expect(2), tag = v.bytes();
                        } else if (v.field() == 2) {
                            v.expect(5), value = v.fixed<float>(), simple = true;
                        } else {
                            v.skip();
                        }
                    }
                    if (simple) values.emplace_back(tag, value);
                }
            } else {
                e.skip();
            }
        }
        for (const auto& [tag, value] : values) out.push_back({step, wall, tag, value});
    }
    return out;
}

}  // namespace trainer
