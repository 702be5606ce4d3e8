// Asynchronous checkpoints (save_async, core/weights/async_save.h): the files equal the synchronous path's byte
// for byte, training goes on while a checkpoint is written, a kill during the background write leaves the
// previous checkpoint the newest complete one, a write that fails stops every rank with its error and keeps the
// previous checkpoints, and a stop signal waits for the write in flight before it saves its own step.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "core/weights/checkpoint.h"
#include "test_util.h"

using Catch::Matchers::Contains;
namespace fs = std::filesystem;
using Args = std::vector<std::string>;

namespace {

Args tiny(const std::string& folder, long steps, const Args& extra) {
    return test_util::tiny_saving(folder, steps, extra);
}
Args launched(int nproc, const Args& args) { return test_util::launch_args(nproc, args); }

// The save folder's temporary folders (saves not yet published, or interrupted).
std::vector<std::string> temporary_folders(const std::string& folder) {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(folder, ec)) {
        const std::string name = e.path().filename().string();
        if (name.find(".tmp-") != std::string::npos) out.push_back(e.path().string());
    }
    return out;
}

// The newest step a metrics file records (0 before the first), read while the run writes it.
long newest_step(const std::string& metrics) {
    long step = 0;
    for (const auto& r : test_util::read_metrics(metrics)) step = std::max(step, r.value("step", 0L));
    return step;
}

// Starts the trainer with `args` (`env` set, its output in `log`), waits until `metrics` records step `step`, runs
// `before_signal` while it trains on, sends SIGTERM and returns its exit code.
int stop_after_step(const Args& args, const std::string& metrics, const std::string& log, long step,
                    const std::vector<std::string>& env, const std::function<void()>& before_signal) {
    Args argv = {test_util::trainer_binary()};
    argv.insert(argv.end(), args.begin(), args.end());
    const pid_t pid = test_util::start_logged(argv, log, env);
    REQUIRE(pid > 0);
    const bool past = test_util::wait_until([&] { return newest_step(metrics) >= step; }, 60);
    if (!past) ::kill(pid, SIGKILL);
    REQUIRE(past);
    before_signal();
    REQUIRE(::kill(pid, SIGTERM) == 0);
    return test_util::wait_exit_code(pid);
}

// The sizes of a tiny.json checkpoint's files with save_safetensors, measured by saving one.
struct CheckpointBytes {
    long shards = 0, safetensors = 0, metadata = 0;
    long total() const { return shards + safetensors + metadata; }
};
CheckpointBytes tiny_checkpoint_bytes() {
    test_util::TempDir dir;
    const auto r = test_util::run_trainer(
        tiny(dir.path("ck"), 2, {"--set", "save_interval=2", "--set", "save_safetensors=true", "--threads", "1"}));
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const std::string step = dir.path("ck/step2/");
    CheckpointBytes b;
    b.shards = static_cast<long>(fs::file_size(step + "rank0.bin"));
    b.safetensors = static_cast<long>(fs::file_size(step + "model.safetensors"));
    b.metadata = static_cast<long>(fs::file_size(step + "metadata.json"));
    return b;
}

// Every complete checkpoint in `folder` holds its model.safetensors.
bool every_checkpoint_has_safetensors(const std::string& folder) {
    for (const long step : trainer::checkpoint_steps(folder)) {
        if (!fs::exists(folder + "/step" + std::to_string(step) + "/model.safetensors")) return false;
    }
    return true;
}

}  // namespace

TEST_CASE(
    "async save: a disk that holds keep + 1 checkpoints suffices for every save of a run including its last and a stop "
    "signal's") {
    test_util::TempDir dir;
    const CheckpointBytes bytes = tiny_checkpoint_bytes();
    // save_num_checkpoints_to_keep 1: room for two checkpoints and half of a third.
    const long room = 2 * bytes.total() + bytes.total() / 2;
    const Args keep = {"--set", "save_interval=4",       "--set",     "save_num_checkpoints_to_keep=1",
                       "--set", "save_safetensors=true", "--threads", "1"};
    {
        // The run's end: background saves at steps 4 and 8, then step 10's written at once.
        const std::string disk_at = dir.path("end");
        const test_util::SmallDisk disk(disk_at, room);
        if (!disk.mounted()) {
            WARN("skipped: a small tmpfs cannot be mounted here (not root, or no mount permission)");
            return;
        }
        const std::string folder = disk_at + "/ck";
        const auto r = test_util::run_trainer(tiny(folder, 10, keep));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.out, Contains("saved checkpoint " + folder + "/step8 (written in the background)") &&
                              Contains("saved checkpoint " + folder + "/step10\n"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{10});
        CHECK(every_checkpoint_has_safetensors(folder));
        CHECK(temporary_folders(folder).empty());
    }
    {
        // A stop signal: step 8's write is held 3 s, so step 12's save waits for it and the signal comes then; the
        // ranks stop after step 13, whose checkpoint is written at once beside step 12's background one.
        const std::string disk_at = dir.path("stop");
        const test_util::SmallDisk disk(disk_at, room);
        REQUIRE(disk.mounted());
        const std::string folder = disk_at + "/ck", metrics = dir.path("stop.jsonl"), log = dir.path("stop.txt");
        Args train = tiny(folder, 100000, keep);
        train.insert(train.end(), {"--metrics-file", metrics});
        const int code = stop_after_step(train, metrics, log, 11, {"TRAINER_DEBUG_SAVE_DELAY=8:3000"}, [] {
            std::this_thread::sleep_for(std::chrono::milliseconds(500));  // step 12 waits for step 8's write
        });
        const std::string text = test_util::read_file(log);
        INFO(text);
        CHECK(code == 128 + SIGTERM);
        const long stopped = newest_step(metrics);
        CHECK(stopped % 4 != 0);  // its checkpoint was written at once, not in the background
        CHECK_THAT(text, Contains("stopped by SIGTERM after step " + std::to_string(stopped) +
                                  " of 100000: checkpoint " + folder + "/step" + std::to_string(stopped)));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{stopped});
        CHECK(every_checkpoint_has_safetensors(folder));
        CHECK(temporary_folders(folder).empty());
    }
}

TEST_CASE("async save: an error at a step after a save still publishes the checkpoint being written") {
    test_util::TempDir dir;
    // Step 4's write is held 1.5 s; the gradients of step 5 are NaN on rank 0, which stops every rank there, while
    // step 4's files are still being written. One process, and FULL_SHARD on 2 ranks (two shard files).
    for (const int nproc : {1, 2}) {
        CAPTURE(nproc);
        const std::string folder = dir.path("ck" + std::to_string(nproc));
        const Args train = tiny(folder, 20, {"--set", "save_interval=2", "--strategy", "fsdp", "--threads", "1"});
        const auto r = test_util::run_trainer(nproc == 1 ? train : launched(nproc, train),
                                              {"TRAINER_DEBUG_SAVE_DELAY=4:1500", "TRAINER_DEBUG_NAN_GRADIENT=0:5"});
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("step 5"));
        CHECK_THAT(r.out, Contains("saved checkpoint " + folder +
                                   "/step4 (written in the background; the error that ends the run came after its "
                                   "step)"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2, 4});
        CHECK(temporary_folders(folder).empty());
        // It is whole: a resume from it verifies every file and trains on.
        const auto resumed =
            test_util::run_trainer(tiny(dir.path("resumed" + std::to_string(nproc)), 6,
                                        {"--load-path", folder + "/step4", "--strategy", "fsdp", "--threads", "1"}));
        INFO(resumed.out << resumed.err);
        CHECK(resumed.exit_code == 0);
        CHECK_THAT(resumed.out, Contains("resumed from " + folder + "/step4 at step 4"));
    }
}

TEST_CASE("async save: save_safetensors' model.safetensors is published with its checkpoint or not at all") {
    test_util::TempDir dir;
    const CheckpointBytes bytes = tiny_checkpoint_bytes();
    // Room for the shard file and the metadata, and half of model.safetensors: the first save fills the disk while
    // it writes the unsharded copy.
    const long room = bytes.shards + bytes.metadata + bytes.safetensors / 2;
    for (const bool async : {true, false}) {
        CAPTURE(async);
        const std::string disk_at = dir.path(async ? "async" : "sync");
        const test_util::SmallDisk disk(disk_at, room);
        if (!disk.mounted()) {
            WARN("skipped: a small tmpfs cannot be mounted here (not root, or no mount permission)");
            return;
        }
        const std::string folder = disk_at + "/ck";
        const auto r = test_util::run_trainer(tiny(folder, 6,
                                                   {"--set", "save_interval=2", "--set", "save_safetensors=true",
                                                    "--set", std::string("save_async=") + (async ? "true" : "false")}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("No space left on device"));
        CHECK_THAT(r.err, Contains("checkpoint step 2") && Contains("not published: its model.safetensors"));
        CHECK(trainer::checkpoint_steps(folder).empty());  // nothing published without its model.safetensors
        CHECK_THAT(r.out, !Contains("saved checkpoint"));
        CHECK(temporary_folders(folder).empty());
    }
}

TEST_CASE("async save: the background write gives the synchronous path's files byte for byte") {
    test_util::TempDir dir;
    // FULL_SHARD on 2 ranks: each rank writes its own shard file.
    auto run = [&](const std::string& name, bool async) {
        const std::string folder = dir.path(name), metrics = dir.path(name + ".jsonl");
        const auto r = test_util::run_trainer(
            launched(2, tiny(folder, 8,
                             {"--strategy", "fsdp", "--metrics-file", metrics, "--set", "save_interval=2", "--set",
                              std::string("save_async=") + (async ? "true" : "false")})));
        INFO(r.out << r.err);
        REQUIRE(r.exit_code == 0);
        const trainer::Json summary = test_util::read_summary(metrics);
        CHECK(summary["save_async"].get<bool>() == async);
        CHECK(summary["checkpoints"].get<long>() == 4);
        // The snapshot is held by the ranks that save in the background only: a shard of the state each.
        const auto snapshot = summary["peak_memory_bytes"]["host_checkpoint_snapshot"].get<int64_t>();
        CHECK((snapshot > 0) == async);
        if (async) CHECK_THAT(r.out, Contains("saved checkpoint " + folder + "/step2 (written in the background)"));
        return folder;
    };
    const std::string async = run("async", true), sync = run("sync", false);
    REQUIRE(trainer::checkpoint_steps(async) == std::vector<long>{2, 4, 6, 8});
    REQUIRE(trainer::checkpoint_steps(sync) == std::vector<long>{2, 4, 6, 8});
    CHECK(temporary_folders(async).empty());
    for (const long step : {2, 4, 6, 8}) {
        CAPTURE(step);
        const std::string s = "/step" + std::to_string(step) + "/";
        for (const char* file : {"rank0.bin", "rank1.bin"}) {
            CHECK(test_util::read_file(async + s + file) == test_util::read_file(sync + s + file));
        }
        const auto meta = [&](const std::string& folder) {
            return trainer::Json::parse(test_util::read_file(folder + s + "metadata.json"));
        };
        CHECK(meta(async)["files"] == meta(sync)["files"]);
        CHECK(meta(async)["units"] == meta(sync)["units"]);
    }
}

TEST_CASE("async save: training goes on during the write and a kill during it leaves the previous checkpoint") {
    test_util::TempDir dir;
    const std::string folder = dir.path("ck"), metrics = dir.path("m.jsonl"), log = dir.path("log.txt");
    const Args train = tiny(folder, 40, {"--strategy", "fsdp", "--metrics-file", metrics, "--set", "save_interval=10"});
    // Step 20's shard files are written 60 s late: the ranks train on meanwhile, and rank 1 is killed.
    const pid_t launcher = test_util::start_logged(
        [&] {
            Args a = {test_util::trainer_binary()};
            const Args l = launched(2, train);
            a.insert(a.end(), l.begin(), l.end());
            return a;
        }(),
        log, {"TRAINER_DEBUG_SAVE_DELAY=20:60000"});
    REQUIRE(launcher > 0);
    const bool past = test_util::wait_until([&] { return newest_step(metrics) >= 25; }, 120);
    pid_t rank1 = test_util::launched_rank_pid(log, 1);
    if (!past || rank1 <= 0) ::kill(launcher, SIGKILL);
    INFO(test_util::read_file_if_exists(log));
    REQUIRE(past);
    REQUIRE(rank1 > 0);
    // Step 10 is published; step 20's write is still in flight while the ranks train past step 25.
    CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{10});
    CHECK(temporary_folders(folder).size() == 1);
    CHECK_THAT(test_util::read_file(log), !Contains("step20 (written"));
    REQUIRE(::kill(rank1, SIGKILL) == 0);
    const int code = test_util::wait_exit_code(launcher);
    INFO(test_util::read_file(log));
    CHECK(code == 1);
    // The previous checkpoint is the newest complete one, and a resume from it continues as if uninterrupted.
    CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{10});
    CHECK(*trainer::latest_checkpoint_step(folder) == 10);
    const std::string resumed_metrics = dir.path("resumed.jsonl");
    const auto resumed =
        test_util::run_trainer(launched(2, tiny(folder, 40,
                                                {"--strategy", "fsdp", "--metrics-file", resumed_metrics, "--set",
                                                 "save_interval=10", "--set", "try_load_latest_save=true"})));
    INFO(resumed.out << resumed.err);
    REQUIRE(resumed.exit_code == 0);
    CHECK_THAT(resumed.out, Contains("resumed from " + folder + "/step10 at step 10"));
    const std::string ref_metrics = dir.path("ref.jsonl");
    const auto ref = test_util::run_trainer(
        launched(2, tiny(dir.path("ref"), 40, {"--strategy", "fsdp", "--metrics-file", ref_metrics})));
    REQUIRE(ref.exit_code == 0);
    const auto ref_rows = test_util::read_metrics(ref_metrics);
    const auto got_rows = test_util::read_metrics(resumed_metrics);
    REQUIRE(got_rows.size() == 30);
    for (size_t i = 0; i < got_rows.size(); ++i) {
        CHECK(got_rows[i]["step"] == ref_rows[i + 10]["step"]);
        CHECK(got_rows[i]["loss"].get<double>() == ref_rows[i + 10]["loss"].get<double>());
    }
    CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{10, 20, 30, 40});
}

TEST_CASE("async save: a write that fails stops every rank with its error and keeps the previous checkpoints") {
    test_util::TempDir dir;
    const std::string folder = dir.path("ck"), log = dir.path("log.txt");
    // Step 4's write starts 2 s late; meanwhile rank 1's shard file becomes the full device (ENOSPC), a real
    // failed write. The save of step 6 waits for it and every rank stops.
    const pid_t launcher = test_util::start_logged(
        [&] {
            Args a = {test_util::trainer_binary()};
            const Args l = launched(2, tiny(folder, 100, {"--strategy", "fsdp", "--set", "save_interval=2"}));
            a.insert(a.end(), l.begin(), l.end());
            return a;
        }(),
        log, {"TRAINER_DEBUG_SAVE_DELAY=4:2000"});
    REQUIRE(launcher > 0);
    std::string tmp;
    const bool in_flight = test_util::wait_until(
        [&] {
            for (const std::string& t : temporary_folders(folder)) {
                if (t.find(".step4.tmp-") != std::string::npos) tmp = t;
            }
            return !tmp.empty();
        },
        60);
    if (!in_flight) ::kill(launcher, SIGKILL);
    REQUIRE(in_flight);
    fs::create_symlink("/dev/full", tmp + "/rank1.bin");
    const int code = test_util::wait_exit_code(launcher);
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(code == 1);
    CHECK_THAT(text, Contains("checkpoint step 4 (written in the background): checkpoint: writing " + tmp +
                              "/rank1.bin failed (No space left on device)"));
    CHECK_THAT(text, Contains("the write failed on 1 of 2 ranks (each says why); the newest complete checkpoint, " +
                              folder + "/step2, is kept"));
    CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2});
    CHECK(temporary_folders(folder).empty());  // rank 0 removed step 4's
}

TEST_CASE("async save: a stop signal waits for the write in flight and then saves its own step") {
    test_util::TempDir dir;
    const std::string folder = dir.path("ck"), metrics = dir.path("m.jsonl"), log = dir.path("log.txt");
    // Step 5's write starts 1.5 s late; SIGTERM arrives while it is in flight.
    const int code =
        stop_after_step(tiny(folder, 100000, {"--metrics-file", metrics, "--set", "save_interval=5"}), metrics, log, 7,
                        {"TRAINER_DEBUG_SAVE_DELAY=5:1500"}, [&] { CHECK(trainer::checkpoint_steps(folder).empty()); });
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(code == 128 + SIGTERM);
    const long stopped = newest_step(metrics);
    const std::vector<long> steps = trainer::checkpoint_steps(folder);
    REQUIRE(!steps.empty());
    CHECK(steps.front() == 5);
    CHECK(steps.back() == stopped);
    CHECK_THAT(text, Contains("stopped by SIGTERM after step " + std::to_string(stopped)));
    CHECK(temporary_folders(folder).empty());
}
