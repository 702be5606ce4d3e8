// Tests of core/safetensors: an F32 round trip (order, metadata, padding, scalars and empty
// tensors), reading BF16/F16/F64 files built byte by byte, and every malformed-file error (the
// message names the file and the offending value). Files live under a fresh mkdtemp folder in /tmp.
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/common.h"
#include "core/weights/safetensors.h"
#include "test_util.h"

using Catch::Matchers::Contains;
using trainer::UserError;

namespace {

using test_util::write_file;

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

template <typename T>
std::string bytes_of(const std::vector<T>& values) {
    std::string out(values.size() * sizeof(T), '\0');
    if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
    return out;
}

// A safetensors file from its JSON header text (not padded) and data section.
std::string safetensors_file(const std::string& header, const std::string& data) {
    return bytes_of(std::vector<uint64_t>{header.size()}) + header + data;
}

}  // namespace

TEST_CASE("safetensors: F32 round trip keeps order metadata and shapes") {
    test_util::TempDir dir;
    std::string path = dir.path("model.safetensors");
    std::vector<float> z = {1.5f, -2.25f, 3.0f, 1e-30f, -0.0f, std::numeric_limits<float>::max()};
    float scalar = 42.0f;
    std::vector<float> a = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f};
    std::vector<trainer::TensorRef> tensors = {
        {"z.weight", {2, 3}, z.data()},
        {"scalar", {}, &scalar},
        {"empty", {0, 4}, nullptr},
        {"a.bias", {5}, a.data()},
    };
    std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "1200"}};
    trainer::write_safetensors(path, tensors, meta);
    CHECK_FALSE(std::filesystem::exists(path + ".tmp"));

    // Layout: header length, header padded with spaces to a multiple of 8, then the data in the
    // order given.
    std::string raw = read_file(path);
    uint64_t n = 0;
    std::memcpy(&n, raw.data(), 8);
    CHECK(n % 8 == 0);
    REQUIRE(raw.size() == 8 + n + 4 * (6 + 1 + 0 + 5));
    std::string header = raw.substr(8, n);
    CHECK(header.find_last_not_of(' ') < header.size());
    auto j = nlohmann::ordered_json::parse(header);
    std::vector<std::string> keys;
    for (const auto& item : j.items()) keys.push_back(item.key());
    CHECK(keys == std::vector<std::string>{"__metadata__", "z.weight", "scalar", "empty", "a.bias"});
    CHECK(j["z.weight"]["data_offsets"].dump() == "[0,24]");
    CHECK(j["scalar"]["data_offsets"].dump() == "[24,28]");
    CHECK(j["empty"]["data_offsets"].dump() == "[28,28]");
    CHECK(j["a.bias"]["data_offsets"].dump() == "[28,48]");
    CHECK(j["a.bias"]["dtype"] == "F32");
    CHECK(std::memcmp(raw.data() + 8 + n, z.data(), 24) == 0);

    std::map<std::string, std::string> meta_back = {{"stale", "entry"}};
    auto back = trainer::read_safetensors(path, &meta_back);
    CHECK(meta_back == meta);
    REQUIRE(back.size() == 4);
    CHECK(back["z.weight"].shape == std::vector<int64_t>{2, 3});
    CHECK(back["z.weight"].data == z);
    CHECK(std::signbit(back["z.weight"].data[4]));
    CHECK(back["scalar"].shape.empty());
    CHECK(back["scalar"].numel() == 1);
    CHECK(back["scalar"].data == std::vector<float>{42.0f});
    CHECK(back["empty"].shape == std::vector<int64_t>{0, 4});
    CHECK(back["empty"].data.empty());
    CHECK(back["a.bias"].data == a);

    // No metadata: no __metadata__ key; overwriting an existing file is fine.
    trainer::write_safetensors(path, {{"x", {1}, &scalar}}, {});
    raw = read_file(path);
    CHECK(raw.find("__metadata__") == std::string::npos);
    auto only = trainer::read_safetensors(path, &meta_back);
    CHECK(meta_back.empty());
    CHECK(only.size() == 1);
    CHECK(only["x"].data == std::vector<float>{42.0f});
}

TEST_CASE("safetensors: reads BF16 F16 and F64 tensors as float") {
    test_util::TempDir dir;
    std::string path = dir.path("mixed.safetensors");
    // bf16: 1.0, -2.5, 0.0078125 (2^-7), 3.140625 (pi rounded to bf16)
    std::vector<uint16_t> bf16 = {0x3f80, 0xc020, 0x3c00, 0x4049};
    // f16: 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal), +inf, -0.0
    std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x8000};
    std::vector<double> f64 = {0.1, -3.0};
    std::string data = bytes_of(bf16) + bytes_of(f16) + bytes_of(f64);
    std::string header = R"({"__metadata__":{"format":"pt"},)"
                         R"("w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
                         R"("h":{"dtype":"F16","shape":[6],"data_offsets":[8,20]},)"
                         R"("d":{"dtype":"F64","shape":[2,1],"data_offsets":[20,36]}})";
    write_file(path, safetensors_file(header, data));
    auto t = trainer::read_safetensors(path);
    REQUIRE(t.size() == 3);
    CHECK(t["w"].shape == std::vector<int64_t>{2, 2});
    CHECK(t["w"].data == std::vector<float>{1.0f, -2.5f, 0.0078125f, 3.140625f});
    REQUIRE(t["h"].data.size() == 6);
    CHECK(t["h"].data[0] == 1.0f);
    CHECK(t["h"].data[1] == -2.0f);
    CHECK(t["h"].data[2] == 65504.0f);
    CHECK(t["h"].data[3] == std::ldexp(1.0f, -24));
    CHECK(std::isinf(t["h"].data[4]));
    CHECK(t["h"].data[4] > 0);
    CHECK(t["h"].data[5] == 0.0f);
    CHECK(std::signbit(t["h"].data[5]));
    CHECK(t["d"].shape == std::vector<int64_t>{2, 1});
    CHECK(t["d"].data == std::vector<float>{0.1f, -3.0f});
}

TEST_CASE("safetensors: malformed files are refused naming the file and value") {
    test_util::TempDir dir;
    std::string path = dir.path("bad.safetensors");
    std::string data8 = bytes_of(std::vector<float>{1.0f, 2.0f});
    auto expect_error = [&](const std::string& bytes, const std::string& what) {
        write_file(path, bytes);
        REQUIRE_THROWS_AS(trainer::read_safetensors(path), UserError);
        REQUIRE_THROWS_WITH(trainer::read_safetensors(path), Contains(path) && Contains(what));
    };
    SECTION("missing file") {
        std::string missing = dir.path("missing.safetensors");
        REQUIRE_THROWS_WITH(trainer::read_safetensors(missing), Contains(missing) && Contains("No such file"));
    }
    SECTION("shorter than the header length") { expect_error("abcd", "4 bytes is too short"); }
    SECTION("empty file") { expect_error("", "0 bytes is too short"); }
    SECTION("header length past the end") {
        expect_error(bytes_of(std::vector<uint64_t>{1000}) + "{}", "header length 1000");
    }
    SECTION("huge header length") {
        expect_error(bytes_of(std::vector<uint64_t>{0xffffffffffffull}) + "{}", "header length 281474976710655");
    }
    SECTION("header not JSON") { expect_error(safetensors_file("{\"a\": [1, 2", ""), "not valid JSON"); }
    SECTION("header not an object") { expect_error(safetensors_file("[1, 2]", ""), "array"); }
    SECTION("entry without dtype") {
        expect_error(safetensors_file(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", data8),
                     "tensor 'w' has no 'dtype'");
    }
    SECTION("entry without shape") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", data8),
                     "tensor 'w' has no 'shape'");
    }
    SECTION("entry without data offsets") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[2]}})", data8),
                     "tensor 'w' has no 'data_offsets'");
    }
    SECTION("entry not an object") { expect_error(safetensors_file(R"({"w":[1,2]})", data8), "tensor 'w' is [1,2]"); }
    SECTION("unsupported dtype") {
        expect_error(safetensors_file(R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", data8),
                     "tensor 'ids' dtype I64 is not supported");
    }
    SECTION("negative shape") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
                     "shape [-2]");
    }
    SECTION("offsets out of the data section") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8),
                     "data_offsets [0,16] run past the 8-byte data section");
    }
    SECTION("offsets reversed") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", data8),
                     "data_offsets [8,0]");
    }
    SECTION("size not matching the shape") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
                     "span 8 bytes; shape [3] of F32 needs 12");
    }
    SECTION("bf16 size not matching the shape") {
        expect_error(safetensors_file(R"({"w":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})", data8),
                     "shape [2] of BF16 needs 4");
    }
    SECTION("gap between tensors") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8),
                     "tensor 'w' data_offsets [4, 8] leave a gap");
    }
    SECTION("overlapping tensors") {
        expect_error(safetensors_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                      data8),
                     "overlap");
    }
    SECTION("data not all covered") {
        expect_error(safetensors_file(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8),
                     "cover 4 of the 8 data bytes");
    }
    SECTION("metadata value not a string") {
        expect_error(safetensors_file(R"({"__metadata__":{"step":12}})", ""), "__metadata__ key 'step' is 12");
    }
}

TEST_CASE("safetensors: writing to a missing folder names the path") {
    test_util::TempDir dir;
    std::string path = dir.path("no/such/dir/model.safetensors");
    float x = 1.0f;
    REQUIRE_THROWS_AS(trainer::write_safetensors(path, {{"x", {1}, &x}}, {}), UserError);
    REQUIRE_THROWS_WITH(trainer::write_safetensors(path, {{"x", {1}, &x}}, {}),
                        Contains(path) && Contains("No such file"));
}
