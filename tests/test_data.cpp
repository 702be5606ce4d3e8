// Tests of core/data and core/tokenizer: every token file layout (raw uint16/uint32, npy v1/v2/v3,
// llm.c shards), the instance dataset (remainder dropped, global index across files), every bad-file
// error (message names the file and the offending value), the instance order (a seeded
// permutation per epoch, world-size independent) and prepare_data_bytes round trips.
// Files are written under a fresh mkdtemp folder in /tmp, removed at the end of each test.
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/common.h"
#include "core/data/data.h"
#include "core/data/mixture.h"
#include "core/data/tokenizer.h"
#include "test_util.h"

using Catch::Matchers::Contains;
using trainer::InstanceOrder;
using trainer::Json;
using trainer::TokenDataset;
using trainer::TokenDtype;
using trainer::TokenFile;
using trainer::TokenFileFormat;
using trainer::UserError;

namespace {

using test_util::write_file;

// The little-endian bytes of `values` (the tests run on little-endian machines, as the reader).
template <typename T>
std::string bytes_of(const std::vector<T>& values) {
    std::string out(values.size() * sizeof(T), '\0');
    if (!values.empty()) std::memcpy(out.data(), values.data(), out.size());
    return out;
}

// An npy file as numpy writes it: magic, version, header length, the dict padded with spaces and a
// newline to a multiple of 64 bytes, then `data`.
std::string npy_file(const std::string& dict, const std::string& data, int major = 1) {
    size_t prefix = major == 1 ? 10 : 12;
    std::string header = dict;
    size_t total = prefix + header.size() + 1;
    header.append((64 - total % 64) % 64, ' ');
    header += '\n';
    std::string out = "\x93NUMPY";
    out += static_cast<char>(major);
    out += '\0';
    if (major == 1) {
        out += bytes_of(std::vector<uint16_t>{static_cast<uint16_t>(header.size())});
    } else {
        out += bytes_of(std::vector<uint32_t>{static_cast<uint32_t>(header.size())});
    }
    return out + header + data;
}

std::string npy_dict(const std::string& descr, const std::string& shape) {
    return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
}

// An llm.c shard: int32[256] header {magic, version, count}, then the uint16 tokens.
std::string llmc_file(const std::vector<uint16_t>& tokens, int32_t count, int32_t version = 1,
                      int32_t magic = trainer::kLlmcMagic) {
    std::vector<int32_t> header(256, 0);
    header[0] = magic;
    header[1] = version;
    header[2] = count;
    return bytes_of(header) + bytes_of(tokens);
}

std::vector<uint16_t> iota16(size_t n, uint16_t start) {
    std::vector<uint16_t> v(n);
    std::iota(v.begin(), v.end(), start);
    return v;
}

std::vector<uint32_t> all_tokens(const TokenFile& f) {
    std::vector<uint32_t> out(static_cast<size_t>(f.num_tokens()));
    f.read_tokens(0, f.num_tokens(), out.data());
    for (int64_t i = 0; i < f.num_tokens(); ++i) REQUIRE(f.token(i) == out[static_cast<size_t>(i)]);
    return out;
}

std::vector<int32_t> instance(const TokenDataset& ds, int64_t index) {
    std::vector<int32_t> out(static_cast<size_t>(ds.seq_len()));
    ds.read_instance(index, out.data());
    return out;
}

std::vector<int32_t> range32(int32_t begin, int32_t end) {
    std::vector<int32_t> v(static_cast<size_t>(end - begin));
    std::iota(v.begin(), v.end(), begin);
    return v;
}

}  // namespace

TEST_CASE("data: token dtype sizes") {
    CHECK(trainer::token_dtype_size(TokenDtype::kUint16) == 2);
    CHECK(trainer::token_dtype_size(TokenDtype::kUint32) == 4);
}

TEST_CASE("data: raw uint16 file") {
    test_util::TempDir dir;
    std::vector<uint16_t> tokens = {0, 1, 2, 50279, 65535, 7, 8};
    std::string path = dir.path("tokens.bin");
    write_file(path, bytes_of(tokens));
    TokenFile f(path, TokenDtype::kUint16);
    CHECK(f.format() == TokenFileFormat::kRaw);
    CHECK(std::string(f.format_name()) == "raw");
    CHECK(f.path() == path);
    CHECK(f.dtype() == TokenDtype::kUint16);
    REQUIRE(f.num_tokens() == 7);
    CHECK(all_tokens(f) == std::vector<uint32_t>(tokens.begin(), tokens.end()));
    CHECK(f.byte_offset(3) == 6);
}

TEST_CASE("data: raw uint32 file") {
    test_util::TempDir dir;
    std::vector<uint32_t> tokens = {0, 70000, 4000000000u, 5, 100000};
    std::string path = dir.path("tokens.bin");
    write_file(path, bytes_of(tokens));
    TokenFile f(path, TokenDtype::kUint32);
    CHECK(f.format() == TokenFileFormat::kRaw);
    REQUIRE(f.num_tokens() == 5);
    CHECK(all_tokens(f) == tokens);
    CHECK(f.byte_offset(2) == 8);
    // The same bytes read as uint16 are twice as many tokens: the dtype is the caller's.
    TokenFile g(path, TokenDtype::kUint16);
    CHECK(g.num_tokens() == 10);
    CHECK(g.token(2) == (70000u & 0xffff));
}

TEST_CASE("data: npy files with header v1 v2 and v3") {
    test_util::TempDir dir;
    std::vector<uint16_t> t16 = {3, 1, 4, 1, 5, 9, 2, 6, 65535};
    std::vector<uint32_t> t32 = {2, 7, 1, 8, 2, 8, 1828459045u};

    SECTION("v1 u2") {
        std::string path = dir.path("a.npy");
        write_file(path, npy_file(npy_dict("<u2", "(9,)"), bytes_of(t16)));
        // The header's dtype wins over memmap_dtype.
        TokenFile f(path, TokenDtype::kUint32);
        CHECK(f.format() == TokenFileFormat::kNpy);
        CHECK(std::string(f.format_name()) == "npy");
        CHECK(f.dtype() == TokenDtype::kUint16);
        CHECK(f.byte_offset(0) == 128);  // numpy pads 10 + dict + newline to a multiple of 64
        CHECK(all_tokens(f) == std::vector<uint32_t>(t16.begin(), t16.end()));
    }
    SECTION("v1 u4") {
        std::string path = dir.path("b.npy");
        write_file(path, npy_file(npy_dict("<u4", "(7,)"), bytes_of(t32)));
        TokenFile f(path, TokenDtype::kUint16);
        CHECK(f.dtype() == TokenDtype::kUint32);
        CHECK(all_tokens(f) == t32);
    }
    SECTION("v2 two dimensional shape read flattened") {
        std::vector<uint16_t> grid = iota16(12, 100);
        std::string path = dir.path("c.npy");
        write_file(path,
                   npy_file("{\"descr\": \"<u2\", \"fortran_order\": False, \"shape\": (3, 4)}", bytes_of(grid), 2));
        TokenFile f(path, TokenDtype::kUint16);
        CHECK(f.byte_offset(0) == 128);  // numpy pads 10 + dict + newline to a multiple of 64
        CHECK(all_tokens(f) == std::vector<uint32_t>(grid.begin(), grid.end()));
    }
    SECTION("v3 with keys in another order and no padding") {
        std::string dict = "{'shape': (7,), 'fortran_order': False, 'descr': '<u4'}";
        std::string file = "\x93NUMPY";
        file += '\x03';
        file += '\0';
        file += bytes_of(std::vector<uint32_t>{static_cast<uint32_t>(dict.size())});
        std::string path = dir.path("d.npy");
        write_file(path, file + dict + bytes_of(t32));
        TokenFile f(path, TokenDtype::kUint16);
        CHECK(f.byte_offset(0) == static_cast<int64_t>(12 + dict.size()));
        CHECK(all_tokens(f) == t32);
    }
}

TEST_CASE("data: llmc shard") {
    test_util::TempDir dir;
    std::vector<uint16_t> tokens = iota16(300, 40000);
    std::string path = dir.path("shard.bin");
    write_file(path, llmc_file(tokens, 300));
    // llm.c shards are uint16 whatever memmap_dtype says.
    TokenFile f(path, TokenDtype::kUint32);
    CHECK(f.format() == TokenFileFormat::kLlmc);
    CHECK(std::string(f.format_name()) == "llm.c");
    CHECK(f.dtype() == TokenDtype::kUint16);
    CHECK(f.byte_offset(0) == 1024);
    CHECK(all_tokens(f) == std::vector<uint32_t>(tokens.begin(), tokens.end()));
}

TEST_CASE("data: the remainder of each file is dropped") {
    test_util::TempDir dir;
    write_file(dir.path("a.bin"), bytes_of(iota16(10, 0)));   // 2 instances of 4, tokens 8 and 9 dropped
    write_file(dir.path("b.bin"), bytes_of(iota16(7, 100)));  // 1 instance, tokens 104..106 dropped
    TokenDataset ds({dir.path("a.bin"), dir.path("b.bin")}, TokenDtype::kUint16, 4, 1000);
    REQUIRE(ds.num_instances() == 3);
    CHECK(ds.seq_len() == 4);
    CHECK(instance(ds, 0) == range32(0, 4));
    CHECK(instance(ds, 1) == range32(4, 8));
    CHECK(instance(ds, 2) == range32(100, 104));
}

TEST_CASE("data: the instance index runs across files in order") {
    test_util::TempDir dir;
    // raw (3 instances), a file shorter than one instance (none), npy (2), llm.c (1), raw uint32 files
    // are covered by the uint32 test: here one memmap_dtype for all raw files.
    write_file(dir.path("a.bin"), bytes_of(iota16(15, 0)));
    write_file(dir.path("short.bin"), bytes_of(iota16(3, 500)));
    write_file(
        dir.path("c.npy"),
        npy_file(npy_dict("<u4", "(11,)"),
                 bytes_of(std::vector<uint32_t>({1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007, 1008, 1009, 1010}))));
    write_file(dir.path("d.bin"), llmc_file(iota16(5, 2000), 5));
    TokenDataset ds({dir.path("a.bin"), dir.path("short.bin"), dir.path("c.npy"), dir.path("d.bin")},
                    TokenDtype::kUint16, 5, 4000);
    REQUIRE(ds.files().size() == 4);
    REQUIRE(ds.num_instances() == 6);
    CHECK(instance(ds, 0) == range32(0, 5));
    CHECK(instance(ds, 1) == range32(5, 10));
    CHECK(instance(ds, 2) == range32(10, 15));
    CHECK(instance(ds, 3) == range32(1000, 1005));
    CHECK(instance(ds, 4) == range32(1005, 1010));
    CHECK(instance(ds, 5) == range32(2000, 2005));
}

TEST_CASE("data: truncated or oversized llmc shards are refused") {
    test_util::TempDir dir;
    std::string path = dir.path("shard.bin");
    SECTION("fewer tokens than the header says") {
        write_file(path, llmc_file(iota16(50, 0), 100));
        REQUIRE_THROWS_AS(TokenFile(path, TokenDtype::kUint16), UserError);
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("truncated") &&
                                                                      Contains("100 tokens") && Contains("1124 bytes"));
    }
    SECTION("more tokens than the header says") {
        write_file(path, llmc_file(iota16(101, 0), 100));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("2 trailing bytes") && Contains("100 tokens"));
    }
    SECTION("the header itself cut short") {
        write_file(path, llmc_file({}, 100).substr(0, 500));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("truncated in its header") && Contains("500 bytes"));
    }
}

TEST_CASE("data: files that look like a format but are not valid are refused") {
    test_util::TempDir dir;
    std::string path = dir.path("bad.bin");
    SECTION("llmc magic with version 7") {
        write_file(path, llmc_file(iota16(10, 0), 10, 7));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("version 7") && Contains("expected 1"));
    }
    SECTION("llmc magic with a negative token count") {
        write_file(path, llmc_file(iota16(10, 0), -3));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("token count -3"));
    }
    SECTION("npy magic with a header that is not a dict") {
        write_file(path, npy_file("descr = u2", bytes_of(iota16(4, 0))));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("descr = u2"));
    }
    SECTION("npy magic with version 9") {
        std::string file = npy_file(npy_dict("<u2", "(4,)"), bytes_of(iota16(4, 0)));
        file[6] = 9;
        write_file(path, file);
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("version 9.0"));
    }
    SECTION("npy header length past the end of the file") {
        std::string file = npy_file(npy_dict("<u2", "(4,)"), "");
        file[8] = '\xff';
        file[9] = '\x7f';
        write_file(path, file);
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("header length 32767") && Contains("past the end"));
    }
}

TEST_CASE("data: npy files with a wrong header are refused") {
    test_util::TempDir dir;
    std::string path = dir.path("bad.npy");
    std::string data = bytes_of(std::vector<uint32_t>{1, 2, 3, 4});
    SECTION("int32 descr") {
        write_file(path, npy_file(npy_dict("<i4", "(4,)"), data));
        REQUIRE_THROWS_AS(TokenFile(path, TokenDtype::kUint16), UserError);
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("'<i4'") && Contains("'<u2'") && Contains("'<u4'"));
    }
    SECTION("big-endian descr") {
        write_file(path, npy_file(npy_dict(">u2", "(8,)"), data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("'>u2'"));
    }
    SECTION("uint8 descr") {
        write_file(path, npy_file(npy_dict("|u1", "(16,)"), data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("'|u1'"));
    }
    SECTION("fortran order") {
        write_file(path, npy_file("{'descr': '<u4', 'fortran_order': True, 'shape': (2, 2), }", data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("fortran_order True") && Contains("False"));
    }
    SECTION("three dimensional shape") {
        write_file(path, npy_file(npy_dict("<u4", "(1, 2, 2)"), data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("(1, 2, 2)"));
    }
    SECTION("scalar shape") {
        write_file(path, npy_file(npy_dict("<u4", "()"), data.substr(0, 4)));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("shape ()"));
    }
    SECTION("data shorter than the shape") {
        write_file(path, npy_file(npy_dict("<u4", "(5,)"), data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("(5,)") &&
                                                                      Contains("needs 20 data bytes") &&
                                                                      Contains("has 16"));
    }
    SECTION("data longer than the shape") {
        write_file(path, npy_file(npy_dict("<u4", "(3,)"), data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("needs 12 data bytes"));
    }
    SECTION("no shape key") {
        write_file(path, npy_file("{'descr': '<u4', 'fortran_order': False}", data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("no 'shape'"));
    }
    SECTION("unknown key") {
        write_file(path, npy_file("{'descr': '<u4', 'fortran_order': False, 'shape': (4,), 'extra': 1}", data));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("'extra'"));
    }
    SECTION("no tokens") {
        write_file(path, npy_file(npy_dict("<u4", "(0,)"), ""));
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("no tokens"));
    }
}

TEST_CASE("data: raw files that are not a whole number of tokens are refused") {
    test_util::TempDir dir;
    std::string path = dir.path("odd.bin");
    write_file(path, std::string(1001, 'x'));
    REQUIRE_THROWS_AS(TokenFile(path, TokenDtype::kUint16), UserError);
    REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                        Contains(path) && Contains("1001 bytes is not a whole number of uint16 tokens (2 bytes each)"));
    write_file(path, std::string(6, 'x'));
    REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint32),
                        Contains(path) && Contains("6 bytes is not a whole number of uint32 tokens (4 bytes each)"));
}

TEST_CASE("data: a token id at or above the vocabulary size names the file and offset") {
    test_util::TempDir dir;
    SECTION("raw uint32") {
        std::string path = dir.path("big.bin");
        write_file(path, bytes_of(std::vector<uint32_t>{1, 2, 3, 4, 5, 70000, 7, 8}));
        TokenDataset ds({path}, TokenDtype::kUint32, 4, 50304);
        CHECK(instance(ds, 0) == range32(1, 5));
        std::vector<int32_t> out(4);
        REQUIRE_THROWS_AS(ds.read_instance(1, out.data()), UserError);
        REQUIRE_THROWS_WITH(ds.read_instance(1, out.data()),
                            Contains(path) && Contains("token id 70000") && Contains("token offset 5") &&
                                Contains("byte offset 20") && Contains("model.vocab_size 50304"));
    }
    SECTION("npy uint16 offsets count the header") {
        std::string path = dir.path("big.npy");
        write_file(path, npy_file(npy_dict("<u2", "(4,)"), bytes_of(std::vector<uint16_t>{1, 2, 257, 3})));
        TokenDataset ds({path}, TokenDtype::kUint16, 4, 257);
        std::vector<int32_t> out(4);
        REQUIRE_THROWS_WITH(ds.read_instance(0, out.data()),
                            Contains(path) && Contains("token id 257") && Contains("token offset 2") &&
                                Contains("byte offset 132") && Contains("model.vocab_size 257"));
    }
}

TEST_CASE("data: missing empty and directory paths are refused") {
    test_util::TempDir dir;
    SECTION("missing") {
        std::string path = dir.path("nope.bin");
        REQUIRE_THROWS_AS(TokenFile(path, TokenDtype::kUint16), UserError);
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16),
                            Contains(path) && Contains("No such file or directory"));
        REQUIRE_THROWS_WITH(TokenDataset({path}, TokenDtype::kUint16, 4, 100), Contains(path));
    }
    SECTION("empty") {
        std::string path = dir.path("empty.bin");
        write_file(path, "");
        REQUIRE_THROWS_WITH(TokenFile(path, TokenDtype::kUint16), Contains(path) && Contains("empty (0 bytes)"));
    }
    SECTION("directory") {
        REQUIRE_THROWS_WITH(TokenFile(dir.path(), TokenDtype::kUint16),
                            Contains(dir.path()) && Contains("is a directory"));
    }
    SECTION("no paths") {
        REQUIRE_THROWS_WITH(TokenDataset({}, TokenDtype::kUint16, 4, 100), Contains("data.paths") && Contains("empty"));
    }
}

TEST_CASE("data: a dataset with zero instances is refused") {
    test_util::TempDir dir;
    write_file(dir.path("a.bin"), bytes_of(iota16(255, 0)));
    write_file(dir.path("b.bin"), bytes_of(iota16(100, 0)));
    REQUIRE_THROWS_AS(TokenDataset({dir.path("a.bin"), dir.path("b.bin")}, TokenDtype::kUint16, 256, 50304), UserError);
    REQUIRE_THROWS_WITH(TokenDataset({dir.path("a.bin"), dir.path("b.bin")}, TokenDtype::kUint16, 256, 50304),
                        Contains("data.paths: no file holds a full instance of max_sequence_length=256 tokens") &&
                            Contains(dir.path("a.bin")) && Contains("255 tokens"));
    REQUIRE_THROWS_WITH(TokenDataset({dir.path("a.bin")}, TokenDtype::kUint16, 0, 50304),
                        Contains("max_sequence_length") && Contains("0"));
}

TEST_CASE("data: instance order is a permutation") {
    const int64_t n = 103, g = 10;
    InstanceOrder order(n, g, 6198, true);
    REQUIRE(order.batches_per_epoch() == 10);
    std::vector<int64_t> batch, epoch;
    for (int64_t step = 0; step < order.batches_per_epoch(); ++step) {
        order.global_batch(step, batch);
        REQUIRE(batch.size() == static_cast<size_t>(g));
        epoch.insert(epoch.end(), batch.begin(), batch.end());
    }
    std::set<int64_t> distinct(epoch.begin(), epoch.end());
    CHECK(distinct.size() == 100);
    CHECK(*distinct.begin() >= 0);
    CHECK(*distinct.rbegin() < n);
    // The epoch order is the first 100 entries of the full permutation of 103.
    std::vector<int64_t> perm;
    InstanceOrder::permutation(n, 6198, perm);
    CHECK(std::vector<int64_t>(perm.begin(), perm.begin() + 100) == epoch);
    std::vector<int64_t> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> identity(static_cast<size_t>(n));
    std::iota(identity.begin(), identity.end(), 0);
    CHECK(sorted == identity);
    CHECK(perm != identity);
}

TEST_CASE("data: instance order depends on the seed") {
    InstanceOrder a(1000, 8, 1, true), b(1000, 8, 1, true), c(1000, 8, 2, true);
    std::vector<int64_t> ba, bb, bc;
    bool differs = false;
    for (int64_t step : {0, 5, 124, 125, 400}) {
        a.global_batch(step, ba);
        b.global_batch(step, bb);
        c.global_batch(step, bc);
        CHECK(ba == bb);
        differs = differs || ba != bc;
    }
    CHECK(differs);
}

TEST_CASE("data: instance order is pinned across platforms") {
    // splitmix64 + Fisher-Yates as documented in data.h; a change here changes every run's data order.
    std::vector<int64_t> perm;
    InstanceOrder::permutation(10, 42, perm);
    CHECK(perm == std::vector<int64_t>{0, 9, 5, 8, 6, 4, 7, 2, 1, 3});
    InstanceOrder::permutation(1, 42, perm);
    CHECK(perm == std::vector<int64_t>{0});
    InstanceOrder::permutation(0, 42, perm);
    CHECK(perm.empty());
}

TEST_CASE("data: instance order epochs concatenate with seed plus epoch") {
    const int64_t n = 37, g = 6;  // 6 batches per epoch, 1 instance dropped per epoch
    const uint64_t seed = 12345;
    InstanceOrder order(n, g, seed, true);
    REQUIRE(order.batches_per_epoch() == 6);
    std::vector<int64_t> batch, perm;
    for (int64_t epoch : {0, 1, 2, 7}) {
        InstanceOrder::permutation(n, seed + static_cast<uint64_t>(epoch), perm);
        for (int64_t k = 0; k < 6; ++k) {
            order.global_batch(epoch * 6 + k, batch);
            CHECK(batch == std::vector<int64_t>(perm.begin() + k * g, perm.begin() + (k + 1) * g));
        }
    }
    // Back to an earlier epoch (the cache is recomputed) and a run seeded one higher.
    std::vector<int64_t> again;
    order.global_batch(6, batch);
    InstanceOrder next(n, g, seed + 1, true);
    next.global_batch(0, again);
    CHECK(batch == again);
    order.global_batch(0, batch);
    InstanceOrder::permutation(n, seed, perm);
    CHECK(batch == std::vector<int64_t>(perm.begin(), perm.begin() + g));
}

TEST_CASE("data: instance order without shuffle is the identity") {
    InstanceOrder order(23, 5, 99, false);
    REQUIRE(order.batches_per_epoch() == 4);
    std::vector<int64_t> batch;
    order.global_batch(0, batch);
    CHECK(batch == std::vector<int64_t>{0, 1, 2, 3, 4});
    order.global_batch(3, batch);
    CHECK(batch == std::vector<int64_t>{15, 16, 17, 18, 19});
    order.global_batch(5, batch);  // epoch 1 starts again at 0; 20..22 are dropped
    CHECK(batch == std::vector<int64_t>{5, 6, 7, 8, 9});
}

TEST_CASE("data: rank slices cover the global batch for any world size") {
    InstanceOrder order(500, 12, 7, true);
    std::vector<int64_t> global, slice;
    for (int64_t step : {0, 3, 41, 42}) {
        order.global_batch(step, global);
        for (int world : {1, 2, 3}) {
            std::vector<int64_t> rebuilt(global.size(), -1);
            for (int rank = 0; rank < world; ++rank) {
                InstanceOrder::rank_slice(global, rank, world, slice);
                REQUIRE(slice.size() == global.size() / static_cast<size_t>(world));
                for (size_t i = 0; i < slice.size(); ++i) {
                    rebuilt[static_cast<size_t>(rank) + i * static_cast<size_t>(world)] = slice[i];
                }
            }
            CHECK(rebuilt == global);
        }
    }
    InstanceOrder::rank_slice({10, 11, 12, 13, 14}, 1, 2, slice);
    CHECK(slice == std::vector<int64_t>{11, 13});
}

TEST_CASE("data: a 0.7 0.3 mixture draws within 1% of its ratios over 1000 instances and every prefix") {
    using trainer::MixtureOrder;
    // Source "web" holds instances [0, 500), "code" [500, 800).
    const MixtureOrder order({{"web", 0, 500, 0.7}, {"code", 500, 300, 0.3}}, 10, 3, true);
    std::vector<int64_t> batch;
    int64_t web = 0, code = 0;
    std::set<int64_t> web_seen, code_seen;
    for (int64_t step = 0; step < 100; ++step) {
        order.global_batch(step, batch);
        REQUIRE(batch.size() == 10);
        for (int64_t i : batch) {
            REQUIRE(i >= 0);
            REQUIRE(i < 800);
            if (i < 500) {
                ++web, web_seen.insert(i);
            } else {
                ++code, code_seen.insert(i);
            }
        }
        const double n = static_cast<double>(web + code);
        CAPTURE(step, web, code);
        CHECK(std::fabs(static_cast<double>(web) - 0.7 * n) <= 1.0);  // every prefix: within one instance
        CHECK(web == order.draws(0, (step + 1) * 10));
    }
    CHECK(web == 700);
    CHECK(code == 300);
    // "web" read 700 draws of 500 instances: each once in its first epoch, then 200 of its second; "code" 300 of
    // 300, each once.
    CHECK(web_seen.size() == 500);
    CHECK(code_seen.size() == 300);
}

TEST_CASE("data: a mixture's draws rise with the run and add up for any ratios") {
    using trainer::MixtureOrder;
    std::mt19937 rng(5);
    for (int trial = 0; trial < 20; ++trial) {
        std::vector<double> w(2 + trial % 4);
        double sum = 0.0;
        for (double& x : w) sum += (x = std::uniform_real_distribution<double>(0.01, 1.0)(rng));
        std::vector<trainer::MixtureSource> sources;
        for (size_t k = 0; k < w.size(); ++k) sources.push_back({"s" + std::to_string(k), 0, 7, w[k] / sum});
        const MixtureOrder order(sources, 4, 0, true);
        std::vector<int64_t> prev(w.size(), 0);
        for (int64_t n = 1; n <= 3000; ++n) {
            int64_t total = 0;
            for (size_t k = 0; k < w.size(); ++k) {
                const int64_t d = order.draws(k, n);
                CAPTURE(trial, n, k);
                REQUIRE(d >= prev[k]);
                REQUIRE(d <= prev[k] + 1);
                // Each level's rounding adds at most half an instance to what the later sources share: source k
                // is within (k + 1) / 2 instances of its ratio (mixture.h).
                REQUIRE(std::fabs(static_cast<double>(d) - w[k] / sum * static_cast<double>(n)) <=
                        0.5 * static_cast<double>(k + 1) + 1e-9);
                prev[k] = d, total += d;
            }
            REQUIRE(total == n);
        }
    }
}

TEST_CASE("data: a mixture's global batch is a function of the seed and the step alone") {
    using trainer::MixtureOrder;
    const std::vector<trainer::MixtureSource> sources = {{"a", 0, 40, 0.5}, {"b", 40, 13, 0.25}, {"c", 53, 9, 0.25}};
    const MixtureOrder walked(sources, 8, 11, true);
    std::vector<int64_t> batch, fresh_batch;
    for (int64_t step = 0; step < 60; ++step) walked.global_batch(step, batch);
    const MixtureOrder fresh(sources, 8, 11, true);
    fresh.global_batch(59, fresh_batch);
    CHECK(fresh_batch == batch);
    const MixtureOrder other_seed(sources, 8, 12, true);
    other_seed.global_batch(59, fresh_batch);
    CHECK(fresh_batch != batch);
    const MixtureOrder in_order(sources, 8, 11, false);
    in_order.global_batch(0, batch);  // unshuffled: each source's first draws in file order, sources in order
    CHECK(batch == std::vector<int64_t>{0, 1, 2, 3, 40, 41, 53, 54});
    REQUIRE_THROWS_WITH(walked.check_repetition(60, {1.0, 100.0, 100.0}),
                        Contains("data.sources[0] (a)") && Contains("draws 240 instances") &&
                            Contains("the 40 it holds") && Contains("max_repetition_ratio 1"));
    CHECK_NOTHROW(walked.check_repetition(60, {6.0, 10.0, 14.0}));
}

TEST_CASE("data: fewer instances than a global batch are refused") {
    REQUIRE_THROWS_AS(InstanceOrder(5, 8, 0, true), UserError);
    REQUIRE_THROWS_WITH(InstanceOrder(5, 8, 0, true), Contains("5 instances") && Contains("global_train_batch_size=8"));
    REQUIRE_THROWS_WITH(InstanceOrder(5, 0, 0, true), Contains("global_train_batch_size") && Contains("0"));
    InstanceOrder exact(8, 8, 0, true);
    CHECK(exact.batches_per_epoch() == 1);
}

TEST_CASE("data: byte tokenizer encode and decode") {
    std::string text = "hi\n\xff";
    std::vector<int32_t> ids = trainer::byte_encode(text);
    CHECK(ids == std::vector<int32_t>{'h', 'i', '\n', 255});
    ids.push_back(trainer::kByteEosTokenId);
    ids.push_back(300);
    CHECK(trainer::byte_decode(ids) == text + "<|endoftext|><|300|>");
}

TEST_CASE("data: prepare data bytes round trip in every format") {
    test_util::TempDir dir;
    std::vector<std::string> docs = {"hello", "", std::string("world\n\xff\x00!", 9)};
    std::vector<std::string> inputs;
    for (size_t i = 0; i < docs.size(); ++i) {
        inputs.push_back(dir.path("doc" + std::to_string(i) + ".txt"));
        write_file(inputs.back(), docs[i]);
    }
    std::vector<int32_t> expected;
    for (const std::string& d : docs) {
        for (int32_t id : trainer::byte_encode(d)) expected.push_back(id);
        expected.push_back(trainer::kByteEosTokenId);
    }
    struct Case {
        std::string format;
        TokenDtype dtype;
        TokenFileFormat detected;
    };
    for (const Case& c : {Case{"raw", TokenDtype::kUint16, TokenFileFormat::kRaw},
                          Case{"raw", TokenDtype::kUint32, TokenFileFormat::kRaw},
                          Case{"npy", TokenDtype::kUint16, TokenFileFormat::kNpy},
                          Case{"npy", TokenDtype::kUint32, TokenFileFormat::kNpy},
                          Case{"llmc", TokenDtype::kUint16, TokenFileFormat::kLlmc}}) {
        INFO("format " << c.format << " dtype " << trainer::choice_name(c.dtype));
        std::string out = dir.path("out." + c.format + "." + trainer::choice_name(c.dtype));
        write_file(out, "stale output from an earlier run");
        trainer::PrepareDataSummary s = trainer::prepare_data_bytes(inputs, out, c.dtype, c.format, 256);
        CHECK(s.documents == 3);
        CHECK(s.tokens == static_cast<int64_t>(expected.size()));
        CHECK(s.bytes_written == static_cast<int64_t>(std::filesystem::file_size(out)));
        CHECK_THAT(s.to_string(), Contains(out) && Contains("3 documents") && Contains("17 tokens"));
        CHECK_FALSE(std::filesystem::exists(out + ".tmp"));
        // Read back with the other dtype as memmap_dtype where the file has a header.
        TokenDtype memmap = c.detected == TokenFileFormat::kRaw
                                ? c.dtype
                                : (c.dtype == TokenDtype::kUint16 ? TokenDtype::kUint32 : TokenDtype::kUint16);
        TokenFile f(out, memmap);
        CHECK(f.format() == c.detected);
        CHECK(f.dtype() == c.dtype);
        std::vector<uint32_t> got = all_tokens(f);
        std::vector<int32_t> ids(got.begin(), got.end());
        CHECK(ids == expected);
        CHECK(trainer::byte_decode(ids) == "hello<|endoftext|><|endoftext|>" + docs[2] + "<|endoftext|>");
        if (c.detected == TokenFileFormat::kNpy) CHECK(f.byte_offset(0) % 64 == 0);
        // And as a dataset: instances of 5 tokens, the remainder (2) dropped.
        TokenDataset ds({out}, memmap, 5, trainer::kByteVocabSize);
        CHECK(ds.num_instances() == 3);
        CHECK(instance(ds, 2) == std::vector<int32_t>(expected.begin() + 10, expected.begin() + 15));
    }
    // Another EOS id.
    std::string out = dir.path("olmo_eos.bin");
    trainer::prepare_data_bytes({inputs[0]}, out, TokenDtype::kUint16, "raw", 50279);
    TokenFile f(out, TokenDtype::kUint16);
    CHECK(all_tokens(f) == std::vector<uint32_t>{'h', 'e', 'l', 'l', 'o', 50279});
}

TEST_CASE("data: prepare data refuses bad input and leaves no output") {
    test_util::TempDir dir;
    std::string doc = dir.path("doc.txt");
    write_file(doc, "abc");
    std::string out = dir.path("out.bin");
    SECTION("missing input") {
        std::string missing = dir.path("missing.txt");
        REQUIRE_THROWS_AS(trainer::prepare_data_bytes({doc, missing}, out, TokenDtype::kUint16, "raw", 256), UserError);
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc, missing}, out, TokenDtype::kUint16, "raw", 256),
                            Contains(missing) && Contains("No such file"));
        CHECK_FALSE(std::filesystem::exists(out));
        CHECK_FALSE(std::filesystem::exists(out + ".tmp"));
    }
    SECTION("directory input") {
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({dir.path()}, out, TokenDtype::kUint16, "raw", 256),
                            Contains(dir.path()) && Contains("directory"));
    }
    SECTION("no inputs") {
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({}, out, TokenDtype::kUint16, "raw", 256),
                            Contains("no input files"));
    }
    SECTION("llmc needs uint16") {
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc}, out, TokenDtype::kUint32, "llmc", 256),
                            Contains("llmc") && Contains("uint32"));
        CHECK_FALSE(std::filesystem::exists(out));
    }
    SECTION("unknown format") {
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc}, out, TokenDtype::kUint16, "parquet", 256),
                            Contains("parquet") && Contains("raw, npy or llmc"));
    }
    SECTION("eos id that is a byte or does not fit") {
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc}, out, TokenDtype::kUint16, "raw", 255),
                            Contains("eos_token_id 255"));
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc}, out, TokenDtype::kUint16, "raw", 70000),
                            Contains("eos_token_id 70000") && Contains("uint16"));
    }
    SECTION("output folder missing") {
        std::string bad = dir.path("no/such/folder/out.bin");
        REQUIRE_THROWS_WITH(trainer::prepare_data_bytes({doc}, bad, TokenDtype::kUint16, "raw", 256),
                            Contains(bad) && Contains("No such file"));
    }
}

// OLMo's instance filter on hand-made instances (the detection was also compared with OLMo's own
// find_periodic_sequences on 3,600 random instances with planted repeats: no difference).
TEST_CASE("data: the instance filter masks what repeats a short sequence max_count times or more") {
    using trainer::InstanceFilter;
    using trainer::repetitive_instance;
    std::mt19937 rng(7);
    const auto noise = [&](int n) {
        std::vector<int32_t> t(n);
        for (int32_t& x : t) x = static_cast<int32_t>(rng() % 50000);  // repeats by chance are negligible
        return t;
    };
    // `count` copies of a motif of `period` distinct tokens written at `at` into random tokens.
    const auto planted = [&](int n, int period, int count, int at) {
        std::vector<int32_t> t = noise(n);
        for (int i = 0; i < period * count; ++i) t[at + i] = 60000 + i % period;
        return t;
    };
    const InstanceFilter olmo2;  // OLMo's defaults: periods 1..13, 32 repeats
    const int n = 2048;
    CHECK_FALSE(repetitive_instance(noise(n).data(), n, olmo2));
    for (int period : {1, 2, 5, 13}) {
        CAPTURE(period);
        for (int at : {0, 17, n - period * 40}) {  // at the start, inside, and ending the instance
            CAPTURE(at);
            CHECK(repetitive_instance(planted(n, period, 40, at).data(), n, olmo2));
            CHECK(repetitive_instance(planted(n, period, 32, at).data(), n, olmo2));
            CHECK_FALSE(repetitive_instance(planted(n, period, 20, at).data(), n, olmo2));
        }
    }
    // A motif longer than repetition_max_period is not looked for; a wider filter finds it.
    CHECK_FALSE(repetitive_instance(planted(n, 14, 40, 100).data(), n, olmo2));
    InstanceFilter wide = olmo2;
    wide.max_period = 14;
    CHECK(repetitive_instance(planted(n, 14, 40, 100).data(), n, wide));
    // Periods above a third of the instance are not looked for.
    CHECK_FALSE(repetitive_instance(planted(12, 2, 6, 0).data(), 12, InstanceFilter{1, 13, 7}));
    CHECK(repetitive_instance(planted(12, 2, 6, 0).data(), 12, InstanceFilter{1, 13, 6}));
}

TEST_CASE("data: a mixture trains on 2 ranks and resumes on 1 with the same stream and counts by source") {
    test_util::TempDir dir;
    const std::string sources =
        R"([{"source_name": "web", "target_ratio": 0.7, "max_repetition_ratio": 2, "paths": [")" +
        test_util::fixture("olmo_tiny_tokens.u16") +
        R"("]}, {"source_name": "code", "target_ratio": 0.3, "paths": [")" +
        test_util::fixture("gpt2_tiny_tokens.u16") + R"("]}])";
    const auto args = [&](const std::string& run) {
        return std::vector<std::string>{"--config",       "configs/tiny.json",
                                        "--threads",      "1",
                                        "--max-duration", "8",
                                        "--set",          "data.paths=null",
                                        "--set",          "data.sources=" + sources,
                                        "--set",          "save_interval=4",
                                        "--save-folder",  dir.path(run),
                                        "--metrics-file", dir.path(run + ".jsonl")};
    };
    std::vector<std::string> two = args("two");
    two.insert(two.end(), {"--strategy", "ddp"});
    const test_util::RunResult r2 = test_util::launch(2, two);
    INFO(r2.out << r2.err);
    REQUIRE(r2.exit_code == 0);
    std::vector<std::string> one = args("one");
    one.insert(one.end(), {"--load-path", dir.path("two") + "/step4"});
    const test_util::RunResult r1 = test_util::run_trainer(one);
    INFO(r1.out << r1.err);
    REQUIRE(r1.exit_code == 0);
    const auto ref = test_util::read_metrics(dir.path("two.jsonl"));
    const auto got = test_util::read_metrics(dir.path("one.jsonl"));
    REQUIRE(ref.size() == 8);
    test_util::check_losses(ref, got, 4);
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i]["tokens_by_source"] == ref[4 + i]["tokens_by_source"]);
    // 64 instances of 65 tokens: 45 of web and 19 of code (0.7 x 64 = 44.8).
    CHECK(ref.back()["tokens_by_source"] == Json{{"web", 45 * 65}, {"code", 19 * 65}});
    // Without the repeats allowed, web's 45 draws of its 41 instances are refused before step 1.
    std::vector<std::string> strict = args("strict");
    strict.back() = dir.path("strict.jsonl");
    for (std::string& a : strict) {
        const std::string allow = R"("max_repetition_ratio": 2, )";
        if (const size_t at = a.find(allow); at != std::string::npos) a.erase(at, allow.size());
    }
    const test_util::RunResult refused = test_util::run_trainer(strict);
    CHECK(refused.exit_code != 0);
    CHECK_THAT(refused.err, Contains("data.sources[0] (web): the run of 8 steps draws 45 instances of it, 1.10 times "
                                     "the 41 it holds, above its max_repetition_ratio 1"));
}
