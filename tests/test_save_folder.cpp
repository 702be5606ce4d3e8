// What a run must not do to the checkpoints already written: resuming an older checkpoint does not overwrite
// newer ones unless save_overwrite says so; state that is not finite is never saved (so `latest` and the
// rotation keep the last good checkpoint); ranks do not outlive a killed launcher, training and saving
// beside a requeued run; two runs never share a save folder (its lock, taken over from dead owners only);
// outputs that cannot be written stop the run early and leave no temporary folders behind.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "core/weights/checkpoint.h"
#include "core/weights/save_folder.h"
#include "test_util.h"

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

using Args = std::vector<std::string>;

Args tiny(const std::string& folder, long steps, const Args& extra) {
    return test_util::tiny_saving(folder, steps, extra);
}

// A process that has exited, or that is a zombie nobody has reaped yet, no longer runs.
bool running(pid_t pid) {
    if (::kill(pid, 0) != 0) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] != 'Z';
}

// A lock of run "elsewhere" on another host in a new save folder `folder`; returns its path.
std::string foreign_lock(const std::string& folder) {
    fs::create_directories(folder);
    const std::string lock = folder + "/.lock";
    test_util::write_file(lock, R"({"run_id": "elsewhere", "host": "another-node", "pid": 1, "started": "then"})");
    return lock;
}

// Runs the trainer with `args` while a thread moves the heartbeat of `lock` (another run's) every 100 ms: to
// `stamp(k)` at beat k, or to now where it gives none; TRAINER_SAVE_LOCK_STALE_SECONDS is `stale`.
test_util::RunResult run_beside_heartbeat(const std::string& lock, const Args& args, int stale,
                                          const std::function<std::optional<timespec>(long)>& stamp) {
    std::atomic<bool> stop{false};
    std::thread beat([&] {
        for (long k = 0; !stop; ++k) {
            const std::optional<timespec> t = stamp(k);
            const timespec times[2] = {t.value_or(timespec{}), t.value_or(timespec{})};
            ::utimensat(AT_FDCWD, lock.c_str(), t ? times : nullptr, 0);
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    });
    const auto r = test_util::run_trainer(args, {"TRAINER_SAVE_LOCK_STALE_SECONDS=" + std::to_string(stale)});
    stop = true;
    beat.join();
    return r;
}

}  // namespace

TEST_CASE("save folder: resuming an older checkpoint into a folder with newer ones is refused unless save_overwrite") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run");
    const auto first = test_util::run_trainer(tiny(folder, 10, {"--set", "save_interval=5"}));
    INFO(first.out << first.err);
    REQUIRE(first.exit_code == 0);
    const std::string newest = test_util::read_file(folder + "/step10/metadata.json");
    // A rollback to step 5 with another learning rate, saving into the same folder.
    const Args branch = {"--load-path",     folder + "/step5", "--set",
                         "save_interval=5", "--set",           "optimizer.learning_rate=5e-3"};
    const auto refused = test_util::run_trainer(tiny(folder, 10, branch));
    INFO(refused.out << refused.err);
    CHECK(refused.exit_code == 1);
    CHECK_THAT(refused.err, Contains("holds checkpoints newer than the one resumed from"));
    CHECK_THAT(refused.err, Contains("step10"));
    CHECK(test_util::read_file(folder + "/step10/metadata.json") == newest);
    // Told to, it replaces them.
    Args overwrite = branch;
    overwrite.insert(overwrite.end(), {"--set", "save_overwrite=true"});
    const auto replaced = test_util::run_trainer(tiny(folder, 10, overwrite));
    INFO(replaced.out << replaced.err);
    CHECK(replaced.exit_code == 0);
    CHECK(test_util::read_file(folder + "/step10/metadata.json") != newest);
}

TEST_CASE("save folder: parameters or moments that are not finite are never saved and the last good checkpoint stays") {
    test_util::TempDir dir;
    SECTION("a learning rate that overflows the parameters") {
        const std::string folder = dir.path("lr");
        const auto r = test_util::run_trainer(tiny(folder, 1, {"--set", "optimizer.learning_rate=1e39"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("step 1: not saved: the parameters of unit"));
        CHECK_THAT(r.err, Contains("lower optimizer.learning_rate"));
        CHECK(trainer::checkpoint_steps(folder).empty());
        CHECK(!fs::exists(folder + "/latest"));
        for (const auto& e : fs::directory_iterator(folder))
            CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
    }
    SECTION("AdamW without epsilon divides by zero where a parameter had no gradient, and the advice says so") {
        const std::string folder = dir.path("eps");
        // Untied embeddings: the rows of tokens the first batch does not hold get no gradient.
        const auto r =
            test_util::run_trainer(tiny(folder, 1, {"--set", "optimizer.eps=0", "--set", "model.weight_tying=false"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("step 1: not saved: the parameters of unit embedding are not finite"));
        CHECK_THAT(r.err, Contains("set optimizer.eps above 0"));
        CHECK(trainer::checkpoint_steps(folder).empty());
    }
    SECTION("a blow-up after good checkpoints keeps the newest of them through the rotation") {
        const std::string folder = dir.path("rot");
        const Args keep = {"--set", "save_interval=1", "--set", "save_num_checkpoints_to_keep=1"};
        const auto good = test_util::run_trainer(tiny(folder, 2, keep));
        INFO(good.out << good.err);
        REQUIRE(good.exit_code == 0);
        REQUIRE(trainer::checkpoint_steps(folder) == std::vector<long>{2});
        Args blow = keep;
        blow.insert(blow.end(), {"--set", "try_load_latest_save=true", "--set", "optimizer.learning_rate=1e39"});
        const auto r = test_util::run_trainer(tiny(folder, 3, blow));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("step 3: not saved"));
        CHECK_THAT(r.err, Contains("/step2, is kept"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2});
        CHECK(fs::read_symlink(folder + "/latest") == "step2");
    }
}

TEST_CASE("save folder: ranks do not outlive a launcher killed with SIGKILL") {
    test_util::TempDir dir;
    const std::string log = dir.path("log.txt"), metrics = dir.path("m.jsonl");
    const Args argv =
        test_util::launch_command(2, tiny(dir.path("run"), 1000000, {"--strategy", "ddp", "--metrics-file", metrics}));
    const pid_t launcher = test_util::start_logged(argv, log);
    REQUIRE(launcher > 0);
    test_util::wait_until(
        [&] { return test_util::read_file_if_exists(metrics).find("\"step\":2") != std::string::npos; });
    const std::string text = test_util::read_file(log);
    INFO(text);
    // "[launch] rank R (local L of N, world W): pid P, T threads"
    std::vector<pid_t> ranks;
    for (size_t at = text.find("[launch] rank "); at != std::string::npos; at = text.find("[launch] rank ", at + 1)) {
        const size_t pid = text.find("): pid ", at), eol = text.find('\n', at);
        if (pid != std::string::npos && pid < eol) ranks.push_back(static_cast<pid_t>(std::stol(text.substr(pid + 7))));
    }
    REQUIRE(ranks.size() == 2);
    for (pid_t p : ranks) REQUIRE(running(p));
    REQUIRE(::kill(launcher, SIGKILL) == 0);
    CHECK(test_util::wait_exit_code(launcher) == 128 + SIGKILL);
    const auto killed = std::chrono::steady_clock::now();
    bool gone = false;
    while (!gone && std::chrono::steady_clock::now() - killed < std::chrono::seconds(10)) {
        gone = !running(ranks[0]) && !running(ranks[1]);
        if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    CHECK(gone);
    for (pid_t p : ranks)
        if (running(p)) ::kill(p, SIGKILL);  // never leave a rank behind, whatever the verdict
}

namespace {

std::vector<std::string> temporary_entries(const std::string& folder) {
    std::vector<std::string> found;
    for (const auto& e : fs::directory_iterator(folder)) {
        const std::string name = e.path().filename().string();
        if (name.find(".tmp") != std::string::npos || name.find(".old-") != std::string::npos) found.push_back(name);
    }
    return found;
}

}  // namespace

TEST_CASE(
    "save folder: a second run on a save folder in use is refused by name and a dead owner's lock is taken over") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run"), log = dir.path("first.log");
    Args argv = {test_util::trainer_binary()};
    const Args first = tiny(folder, 1000000, {"--set", "save_interval=2"});
    argv.insert(argv.end(), first.begin(), first.end());
    const pid_t owner = test_util::start_logged(argv, log);
    REQUIRE(owner > 0);
    REQUIRE(test_util::wait_until([&] { return fs::exists(folder + "/step2/metadata.json"); }));
    const trainer::Json lock = trainer::Json::parse(test_util::read_file(folder + "/.lock"));
    CHECK(lock["pid"] == owner);

    // Started on the same folder (a requeue beside a live run): refused, naming the owner.
    const auto second = test_util::run_trainer(tiny(folder, 4, {"--load-path", "latest"}));
    INFO(second.out << second.err);
    CHECK(second.exit_code == 1);
    CHECK_THAT(second.err, Contains("is in use by run " + lock["run_id"].get<std::string>()));
    CHECK_THAT(second.err, Contains(fmt::format("pid {} on host", owner)));

    // The owner dies mid-run: its checkpoints stay and the next run takes the lock over, clearing what the
    // interrupted saves left.
    REQUIRE(::kill(owner, SIGKILL) == 0);
    test_util::wait_exit_code(owner);
    // The save it was writing, if the kill landed in one (its checkpoints are written in the background, so
    // often), and one more.
    fs::create_directories(folder + "/.step999.tmp-0123456789ab");
    const size_t interrupted = temporary_entries(folder).size();
    const std::vector<long> kept = trainer::checkpoint_steps(folder);
    REQUIRE(!kept.empty());
    const auto third = test_util::run_trainer(tiny(folder, kept.back() + 2, {"--load-path", "latest"}));
    INFO(third.out << third.err);
    CHECK(third.exit_code == 0);
    CHECK_THAT(third.err, Contains("took over the lock of run " + lock["run_id"].get<std::string>()));
    CHECK_THAT(third.err, Contains("which no longer runs"));
    CHECK_THAT(third.err, Contains(fmt::format("removed {} temporary folder{} of interrupted saves", interrupted,
                                               interrupted == 1 ? "" : "s")));
    CHECK_THAT(third.out, Contains(fmt::format("resumed from {}/step{}", folder, kept.back())));
    CHECK(temporary_entries(folder).empty());
    CHECK_FALSE(fs::exists(folder + "/.lock"));  // released at the end
}

TEST_CASE("save folder: another host's lock is taken over only once its heartbeat stops moving") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run"), lock = foreign_lock(folder);
    SECTION("a heartbeat that moves: a live run, refused") {
        const auto r =
            run_beside_heartbeat(lock, tiny(folder, 1, {}), 5, [](long) { return std::optional<timespec>(); });
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("is in use by run elsewhere (pid 1 on host another-node"));
        CHECK(trainer::Json::parse(test_util::read_file(lock))["run_id"] == "elsewhere");
    }
    SECTION("a heartbeat older than the stale limit: taken over") {
        const timespec old[2] = {{::time(nullptr) - 600, 0}, {::time(nullptr) - 600, 0}};
        REQUIRE(::utimensat(AT_FDCWD, lock.c_str(), old, 0) == 0);
        const auto r = test_util::run_trainer(tiny(folder, 1, {}), {"TRAINER_SAVE_LOCK_STALE_SECONDS=5"});
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.err, Contains("took over the lock of run elsewhere (pid 1 on host another-node"));
        CHECK_THAT(r.err, Contains("whose heartbeat did not move for"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{1});
    }
}

TEST_CASE("save folder: two runs that find one stale lock at once never both take it") {
    // In one process: each thread's run takes the lock as a process would (its own run id), and a run of this
    // process holding it is alive to the other. The pause makes both judge the stale lock before either takes it.
    test_util::ScopedEnv stale("TRAINER_SAVE_LOCK_STALE_SECONDS", "0");
    test_util::ScopedEnv pause("TRAINER_DEBUG_LOCK_TAKEOVER_PAUSE_MS", "20");
    test_util::TempDir dir;
    int both = 0, neither = 0;
    for (int trial = 0; trial < 50; ++trial) {
        const std::string folder = dir.path("t" + std::to_string(trial));
        fs::create_directories(folder);
        test_util::write_file(folder + "/.lock", R"({"run_id": "dead", "host": "another-node", "pid": 1})");
        std::unique_ptr<trainer::SaveFolderLock> held[2];
        std::string refused[2];
        std::thread runs[2];
        for (int r = 0; r < 2; ++r) {
            runs[r] = std::thread([&, r] {
                try {
                    held[r] = trainer::SaveFolderLock::acquire(folder, fmt::format("run{}-{}", trial, r));
                } catch (const trainer::UserError& e) {
                    refused[r] = e.what();
                }
            });
        }
        for (auto& t : runs) t.join();
        const int holders = (held[0] != nullptr) + (held[1] != nullptr);
        both += holders == 2;
        neither += holders == 0;
        for (int r = 0; r < 2; ++r) {
            if (!held[r]) CHECK_THAT(refused[r], Contains("is in use by run run" + std::to_string(trial)));
        }
    }
    CHECK(both == 0);
    CHECK(neither == 0);
}

TEST_CASE("save folder: a lock dated in the future or stamped by a clock that is behind is judged by its heartbeat") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run"), lock = foreign_lock(folder);
    SECTION("dated an hour ahead and not moving: stale after TRAINER_SAVE_LOCK_STALE_SECONDS, not after the hour") {
        const timespec ahead[2] = {{::time(nullptr) + 3600, 0}, {::time(nullptr) + 3600, 0}};
        REQUIRE(::utimensat(AT_FDCWD, lock.c_str(), ahead, 0) == 0);
        const auto start = std::chrono::steady_clock::now();
        const auto r = test_util::run_trainer(tiny(folder, 1, {}), {"TRAINER_SAVE_LOCK_STALE_SECONDS=2"});
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.err, Contains("took over the lock of run elsewhere"));
        CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
    }
    SECTION("stamped 1,000 s in the past by a live owner whose clock is behind: refused while it moves") {
        const auto r = run_beside_heartbeat(lock, tiny(folder, 1, {}), 3, [](long k) {
            return std::optional<timespec>(timespec{::time(nullptr) - 1000, k % 1000000});
        });
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("is in use by run elsewhere"));
        CHECK(trainer::Json::parse(test_util::read_file(lock))["run_id"] == "elsewhere");
    }
}

TEST_CASE("save folder: a live lock from another PID namespace on this host is never taken over", "[heavy]") {
    if (::geteuid() != 0 || ::system("/usr/bin/unshare --pid --fork --mount-proc true >/dev/null 2>&1") != 0) {
        WARN("skipped: needs root and unshare(1) to start a run in a PID namespace of its own");
        return;
    }
    test_util::TempDir dir;
    const std::string folder = dir.path("run"), log = dir.path("owner.log");
    // The owner, in a PID namespace of its own on this host (a container with the host's network): its pid means
    // another process here, so only its heartbeat can say it lives.
    Args argv = {"/usr/bin/unshare", "--pid", "--fork", "--mount-proc", "--kill-child", test_util::trainer_binary()};
    const Args owner_run = tiny(folder, 1000000, {});
    argv.insert(argv.end(), owner_run.begin(), owner_run.end());
    const pid_t owner = test_util::start_logged(argv, log);
    REQUIRE(owner > 0);
    REQUIRE(test_util::wait_until([&] { return fs::exists(folder + "/.lock"); }));
    const trainer::Json lock = trainer::Json::parse(test_util::read_file(folder + "/.lock"));
    const auto second = test_util::run_trainer(tiny(folder, 2, {}), {"TRAINER_SAVE_LOCK_STALE_SECONDS=15"});
    ::kill(owner, SIGKILL);
    test_util::wait_exit_code(owner);
    INFO(second.out << second.err << test_util::read_file(log));
    CHECK(second.exit_code == 1);
    CHECK_THAT(second.err, Contains("is in use by run " + lock["run_id"].get<std::string>()));
}

TEST_CASE("save folder: a symbolic link or a folder at .lock is refused by name") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run");
    fs::create_directories(folder);
    SECTION("a dangling symbolic link") {
        fs::create_symlink(dir.path("nowhere"), folder + "/.lock");
        const auto r = test_util::run_trainer(tiny(folder, 1, {}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("is not a lock file but a symbolic link; remove it if no run uses the folder"));
    }
    SECTION("a folder") {
        fs::create_directories(folder + "/.lock");
        const auto r = test_util::run_trainer(tiny(folder, 1, {}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("is not a lock file but a folder"));
    }
}

TEST_CASE("save folder: a checkpoint that appears while a save is written is never replaced without save_overwrite") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run"), log = dir.path("log.txt");
    Args argv = {test_util::trainer_binary()};
    const Args run = tiny(folder, 4, {"--set", "save_interval=2"});
    argv.insert(argv.end(), run.begin(), run.end());
    // Step 2's save is held in flight; meanwhile "another run" publishes a step2/ of its own.
    const pid_t pid = test_util::start_logged(argv, log, {"TRAINER_DEBUG_SAVE_DELAY=2:3000"});
    REQUIRE(pid > 0);
    REQUIRE(test_util::wait_until([&] {
        std::error_code ec;
        for (const auto& e : fs::directory_iterator(folder, ec)) {
            if (e.path().filename().string().rfind(".step2.tmp-", 0) == 0) return true;
        }
        return false;
    }));
    fs::create_directories(folder + "/step2");
    test_util::write_file(folder + "/step2/theirs.txt", "another run's checkpoint\n");
    const int code = test_util::wait_exit_code(pid);
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(code == 1);
    CHECK_THAT(text, Contains("appeared while this run wrote its step 2 and save_overwrite is false"));
    CHECK(test_util::read_file(folder + "/step2/theirs.txt") == "another run's checkpoint\n");
    CHECK_FALSE(fs::exists(folder + "/step2/metadata.json"));
    CHECK(temporary_entries(folder).empty());
}

TEST_CASE("save folder: outputs that cannot be written stop the run before step 1 or when they fail") {
    test_util::TempDir dir;
    SECTION("a save_folder that is a file, or a name too long") {
        test_util::write_file(dir.path("file"), "x");
        for (const std::string& folder : {dir.path("file"), dir.path(std::string(300, 'x'))}) {
            const auto r = test_util::run_trainer(tiny(folder, 5, {"--set", "save_interval=5"}));
            INFO(r.out << r.err);
            CHECK(r.exit_code == 1);
            CHECK_THAT(r.err, Contains("save_folder " + folder + ": cannot be created ("));
            CHECK(r.out.find("step 1/") == std::string::npos);
        }
    }
    SECTION("a metrics file on a full disk: the run stops with the reason") {
        const auto r = test_util::run_trainer(tiny(dir.path("m"), 3, {"--metrics-file", "/dev/full"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("metrics_file /dev/full: a record could not be written (No space left on device)"));
    }
    SECTION("a trace file that cannot be written is refused before step 1 with its reason") {
        const auto r = test_util::run_trainer(tiny(dir.path("t"), 2, {"--trace-file", dir.path("none/trace.json")}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("trace_file " + dir.path("none/trace.json") +
                                   ": cannot be written (No such file or directory)"));
        CHECK(r.out.find("step 1/") == std::string::npos);
    }
    SECTION("the ranks of one run write into one temporary folder named for the run") {
        // FSDP on 2 ranks: each writes its shard; both die between the shards and the metadata.
        const std::string folder = dir.path("fsdp");
        const Args a = test_util::launch_args(2, tiny(folder, 4, {"--strategy", "fsdp", "--set", "save_interval=2"}));
        const auto killed = test_util::run_trainer(a, {"TRAINER_DEBUG_KILL_IN_SAVE=4"});
        INFO(killed.out << killed.err);
        CHECK(killed.exit_code == 1);
        const auto left = temporary_entries(folder);
        REQUIRE(left.size() == 1);
        CHECK(left[0].rfind(".step4.tmp-", 0) == 0);
        CHECK(fs::exists(folder + "/" + left[0] + "/rank0.bin"));
        CHECK(fs::exists(folder + "/" + left[0] + "/rank1.bin"));
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2});
    }
    SECTION("a save's temporary folder carries the run's tag, and a failed save leaves none") {
        // Killed between the shard files and the metadata: the temporary folder carries the run's tag.
        const std::string folder = dir.path("ranks");
        const auto killed =
            test_util::run_trainer(tiny(folder, 4, {"--set", "save_interval=2"}), {"TRAINER_DEBUG_KILL_IN_SAVE=4"});
        CHECK(killed.exit_code == -SIGKILL);
        const auto left = temporary_entries(folder);
        REQUIRE(left.size() == 1);
        CHECK(left[0].rfind(".step4.tmp-", 0) == 0);
        CHECK(left[0].size() == std::string(".step4.tmp-").size() + 12);
        // The state is not finite at step 3: the save fails and removes its temporary folder.
        const auto failed = test_util::run_trainer(tiny(
            folder, 4, {"--load-path", "latest", "--set", "save_interval=1", "--set", "optimizer.learning_rate=1e39"}));
        INFO(failed.out << failed.err);
        CHECK(failed.exit_code == 1);
        CHECK_THAT(failed.err, Contains("removed 1 temporary folder of interrupted saves"));
        CHECK(temporary_entries(folder).empty());
        CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2});
    }
}

TEST_CASE("save folder: a stop signal during evaluation stops between its batches and saves the step") {
    test_util::TempDir dir;
    // A validation set that takes many seconds in any build: 40000 instances of the tiny model's 65 tokens.
    std::string tokens(static_cast<size_t>(65) * 40000 * 2, '\0');
    for (size_t i = 0; i < tokens.size(); i += 2) tokens[i] = static_cast<char>(i % 251);
    test_util::write_file(dir.path("val.u16"), tokens);
    const std::string folder = dir.path("run"), log = dir.path("log.txt"), metrics = dir.path("m.jsonl");
    Args argv = {test_util::trainer_binary()};
    const Args run = tiny(folder, 1000,
                          {"--set", "eval_interval=2", "--metrics-file", metrics, "--set",
                           R"(evaluators=[{"label": "big", "data": {"paths": [")" + dir.path("val.u16") + R"("]}}])"});
    argv.insert(argv.end(), run.begin(), run.end());
    const pid_t pid = test_util::start_logged(argv, log);
    REQUIRE(pid > 0);
    // Step 1's record is written before step 2 trains (milliseconds); a second later step 2's evaluation runs.
    REQUIRE(test_util::wait_until(
        [&] { return test_util::read_file_if_exists(metrics).find("\"step\":1") != std::string::npos; }, 120));
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    const auto signalled = std::chrono::steady_clock::now();
    REQUIRE(::kill(pid, SIGTERM) == 0);
    const int code = test_util::wait_exit_code(pid);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(code == 128 + SIGTERM);
    CHECK_THAT(text, Contains("step 2 | eval big interrupted by SIGTERM"));
    CHECK_THAT(text, Contains("stopped by SIGTERM after step 2 of 1000"));
    CHECK(trainer::checkpoint_steps(folder) == std::vector<long>{2});
    CHECK(seconds < 5.0);  // the evaluation alone takes longer; a stop waits for one batch
}

TEST_CASE("save folder: a stop signal to trainer launch during the rendezvous exits 128 + the signal") {
    // A second node that never comes: the rank waits in its rendezvous when the launcher is told to stop.
    test_util::TempDir dir;
    const std::string log = dir.path("log.txt");
    const pid_t launcher =
        test_util::start_node(2, 0, 1, test_util::free_port(), tiny(dir.path("run"), 5, {"--strategy", "ddp"}), log);
    REQUIRE(launcher > 0);
    REQUIRE(test_util::wait_until(
        [&] { return test_util::read_file_if_exists(log).find("[launch] rank 0") != std::string::npos; }, 30));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    REQUIRE(::kill(launcher, SIGTERM) == 0);
    const int code = test_util::wait_exit_code(launcher);
    INFO(test_util::read_file(log));
    CHECK(code == 128 + SIGTERM);
}

TEST_CASE("save folder: continuations that would silently go wrong are refused or said") {
    test_util::TempDir dir;
    const std::string folder = dir.path("run");
    const auto first = test_util::run_trainer(tiny(folder, 2, {"--set", "save_interval=1"}));
    INFO(first.out << first.err);
    REQUIRE(first.exit_code == 0);
    auto edit_metadata = [&](const std::string& step_folder, const std::function<void(trainer::Json&)>& edit) {
        const std::string path = step_folder + "/metadata.json";
        trainer::Json meta = trainer::Json::parse(test_util::read_file(path));
        edit(meta);
        test_util::write_file(path, meta.dump(2));
    };
    SECTION("a checkpoint whose metadata records another step than its folder's name") {
        edit_metadata(folder + "/step1", [](trainer::Json& m) { m["step"] = 2; });
        const auto r = test_util::run_trainer(tiny(folder, 4, {"--load-path", folder + "/step1"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("its metadata.json records step 2, not the step1 its folder is named for"));
    }
    SECTION("a copy of a checkpoint under a newer step's name, named by path or by latest") {
        fs::copy(folder + "/step2", folder + "/step5", fs::copy_options::recursive);
        const auto named = test_util::run_trainer(tiny(folder, 4, {"--load-path", folder + "/step5"}));
        INFO(named.out << named.err);
        CHECK(named.exit_code == 1);
        CHECK_THAT(named.err, Contains("checkpoint " + folder +
                                       "/step5: its metadata.json records step 2, not the step5 its folder is named "
                                       "for; the newest checkpoint before it that verifies is " +
                                       folder + "/step2"));
        const auto latest = test_util::run_trainer(tiny(folder, 4, {"--load-path", "latest"}));
        INFO(latest.out << latest.err);
        CHECK(latest.exit_code == 0);
        CHECK_THAT(latest.out, Contains("resumed from " + folder + "/step2 at step 2"));
        CHECK_THAT(latest.err, Contains("moved aside as " + folder + "/.step5.corrupt-"));
    }
    SECTION("export of a checkpoint whose config was edited to another model") {
        edit_metadata(folder + "/step2", [](trainer::Json& m) { m["config"]["model"]["d_model"] = 32; });
        const auto r =
            test_util::run_trainer({"export", "--checkpoint", folder + "/step2", "-o", dir.path("w.safetensors")});
        INFO(r.out << r.err);
        CHECK(r.exit_code == 1);
        CHECK_THAT(r.err, Contains("but the model configured is"));
        CHECK_FALSE(fs::exists(dir.path("w.safetensors")));
    }
    SECTION("resuming on other data is said, with where the data position goes on") {
        const auto r = test_util::run_trainer({"--config", "configs/tiny.json", "--data",
                                               test_util::fixture("olmo_tiny_tokens.u16"), "--data",
                                               test_util::fixture("olmo_tiny_tokens.u16"), "--max-duration", "3",
                                               "--save-folder", folder, "--load-path", "latest"});
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.err, Contains("note: resuming " + folder + "/step2 with data.paths"));
        CHECK_THAT(r.err, Contains("goes on at instance 16 of this data's order"));
    }
    SECTION("resuming with other label masks on the same data is said") {
        const std::string tokens = test_util::fixture("olmo_tiny_tokens.u16");
        const std::string mask = dir.path("ones.mask");
        test_util::write_file(mask, std::string(test_util::read_file(tokens).size() / 2, '\1'));
        const auto r = test_util::run_trainer(
            tiny(folder, 3, {"--load-path", "latest", "--set", "data.label_mask_paths=[\"" + mask + "\"]"}));
        INFO(r.out << r.err);
        CHECK(r.exit_code == 0);
        CHECK_THAT(r.err, Contains("note: resuming " + folder + "/step2 with data.label_mask_paths [\"" + mask +
                                   "\"]; it was written with null"));
    }
    SECTION("max_grad_norm 0 and a warmup longer than the run") {
        const auto zero = test_util::run_trainer(tiny(dir.path("z"), 2, {"--set", "max_grad_norm=0"}));
        CHECK(zero.exit_code == 1);
        CHECK_THAT(zero.err, Contains("config max_grad_norm: 0 clips every gradient to zero"));
        const auto warm = test_util::run_trainer(tiny(dir.path("w"), 3, {"--set", "scheduler.t_warmup=10"}));
        INFO(warm.out << warm.err);
        CHECK(warm.exit_code == 0);
        CHECK_THAT(warm.out, Contains("note: scheduler.t_warmup is 10 steps in a run of 3"));
    }
}
