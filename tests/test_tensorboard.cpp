// TensorBoard event files: the CRC-32C of TFRecord framing, a written file read back (and refused when a byte is
// changed or the file is cut), and a 2-rank run whose event file holds every number of every step record of its
// metrics file. TensorBoard's own reader is tests/tensorboard_check.sh (skipped where Python's tensorboard package is
// not installed).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "base/common.h"
#include "core/tensorboard.h"
#include "test_util.h"

using namespace trainer;
using Catch::Matchers::Contains;
using test_util::TempDir;

namespace {

std::vector<std::string> event_files(const std::string& dir) {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(e.path().string());
    }
    return files;
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C of the standard check string") {
    const std::string s = "123456789";
    CHECK(crc32c(s.data(), s.size()) == 0xE3069283u);
    CHECK(crc32c("", 0) == 0u);
    const std::string zeros(32, '\0');  // RFC 3720's vector: 32 bytes of zeros
    CHECK(crc32c(zeros.data(), zeros.size()) == 0x8A9136AAu);
}

TEST_CASE("tensorboard: a written file reads back and a changed byte or a cut is refused") {
    TempDir dir;
    std::string path;
    {
        TensorBoardWriter w(dir.path("tb"));
        w.write(1, {{"loss", 3.25}, {"lr", 1e-3}});
        w.write(2, {{"loss", 2.5}, {"peak_memory_bytes_per_rank/1/activations", 123456.0}});
        path = w.path();
    }
    const std::vector<TensorBoardScalar> s = read_tensorboard_scalars(path);
    REQUIRE(s.size() == 4);
    CHECK(s[0].step == 1);
    CHECK(s[0].tag == "loss");
    CHECK(s[0].value == 3.25f);
    CHECK(s[1].value == 1e-3f);
    CHECK(s[3].tag == "peak_memory_bytes_per_rank/1/activations");
    CHECK(s[3].value == 123456.0f);
    CHECK(s[3].wall_time > 1.7e9);

    std::string bytes = test_util::read_file(path);
    const size_t tag_at = bytes.find("loss");
    REQUIRE(tag_at != std::string::npos);
    std::string changed = bytes;
    changed[tag_at] = 'L';
    { std::ofstream(path, std::ios::binary | std::ios::trunc) << changed; }
    REQUIRE_THROWS_WITH(read_tensorboard_scalars(path), Contains(path) && Contains("fail their checksum"));
    { std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes.substr(0, bytes.size() - 3); }
    REQUIRE_THROWS_WITH(read_tensorboard_scalars(path), Contains("is cut short"));
}

TEST_CASE("tensorboard: a folder that cannot be made is refused before the run") {
    TempDir dir;
    { std::ofstream(dir.path("file")) << "x"; }
    const test_util::RunResult r =
        test_util::run_trainer({"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"),
                                "--max-duration", "2", "--tensorboard-dir", dir.path("file") + "/tb"});
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Contains("tensorboard_dir " + dir.path("file") + "/tb"));
}

TEST_CASE("tensorboard: a full disk stops the run with the reason and the file ends with a whole event") {
    TempDir dir;
    const std::string tb = dir.path("tb");
    // A 16 KiB file system of its own (root): the events of a few steps fill it.
    const test_util::SmallDisk disk(tb, 16 << 10);
    if (!disk.mounted()) {
        WARN("skipped: a small tmpfs cannot be mounted here (not root, or no mount permission)");
        return;
    }
    const test_util::RunResult r =
        test_util::run_trainer({"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"),
                                "--max-duration", "200", "--threads", "1", "--tensorboard-dir", tb});
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Contains("tensorboard_dir: an event could not be written to " + tb) &&
                          Contains("No space left on device"));
    // What is there reads back to its end: every event whole.
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(tb)) files.push_back(e.path().string());
    REQUIRE(files.size() == 1);
    const auto scalars = read_tensorboard_scalars(files[0]);
    CHECK_FALSE(scalars.empty());
}

TEST_CASE("tensorboard: a 2-rank run's event file holds every number of every step record") {
    TempDir dir;
    const std::string val =
        "[{\"label\": \"val\", \"data\": {\"paths\": [\"" + test_util::fixture("gpt2_tiny_tokens.u16") + "\"]}}]";
    const test_util::RunResult r = test_util::launch(
        2, {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--threads", "1",
            "--strategy", "fsdp", "--max-duration", "6", "--metrics-file", dir.path("m.jsonl"), "--tensorboard-dir",
            dir.path("tb"), "--set", "eval_interval=3", "--set", "evaluators=" + val});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const std::vector<std::string> files = event_files(dir.path("tb"));
    REQUIRE(files.size() == 1);  // rank 0 alone writes
    std::map<std::pair<long, std::string>, float> events;
    for (const TensorBoardScalar& s : read_tensorboard_scalars(files[0])) events[{s.step, s.tag}] = s.value;
    const std::vector<Json> rows = test_util::read_metrics(dir.path("m.jsonl"));
    REQUIRE(rows.size() == 6);
    size_t checked = 0;
    std::set<std::string> tags;
    for (const Json& row : rows) {
        const long step = row["step"];
        for (const auto& [tag, value] : scalars_of(row)) {
            CAPTURE(step, tag, value);
            const auto it = events.find({step, tag});
            REQUIRE(it != events.end());
            CHECK(it->second == static_cast<float>(value));
            tags.insert(tag);
            ++checked;
        }
    }
    CHECK(checked == events.size());  // and nothing else
    for (const char* tag :
         {"loss", "lr", "grad_norm", "tokens_per_second_per_device", "mfu", "step_time_ms", "val_loss",
          "peak_memory_bytes_per_rank/0/activations", "peak_memory_bytes_per_rank/1/parameters"}) {
        CAPTURE(tag);
        CHECK(tags.count(tag) == 1);
    }
}
