// `trainer launch`: ranks get their environment and prefixed output; a failing rank is named and the
// others stopped; SIGKILL of one rank brings down every other rank and the launcher within 30 s, for
// `trainer launch` and for mpirun, during training (the survivors blocked in collectives); and a stop
// signal to either launcher makes every rank save its last step and exit, the run resuming bitwise.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "base/stop.h"
#include "core/weights/checkpoint.h"
#include "kernels/backend.h"
#include "test_util.h"

using Catch::Matchers::Contains;
using test_util::run_trainer;

TEST_CASE("launch: every rank runs with prefixed output") {
    const auto r = run_trainer({"launch", "--nproc-per-node", "3", "--", "peak-flops", "--seconds", "0.05"});
    INFO(r.out << r.err);
    CHECK(r.exit_code == 0);
    for (int rank = 0; rank < 3; ++rank) {
        CHECK_THAT(r.out, Contains("[rank " + std::to_string(rank) + "] {\"threads\": 1"));  // 2 cores / 3 ranks -> 1
        CHECK_THAT(r.out,
                   Contains("[launch] rank " + std::to_string(rank) + " (local " + std::to_string(rank) + " of 3"));
    }
}

TEST_CASE("launch: a failing rank is named and the others are stopped") {
    const auto r = run_trainer({"launch", "--nproc-per-node", "2", "--", "--config", "missing.json"});
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.err, Contains("error: launch: rank") && Contains("exited with exit status 1"));
    CHECK_THAT(r.err, Contains("missing.json: cannot be read"));
    const auto bad = run_trainer({"launch", "--nproc-per-node", "0", "--", "peak-flops"});
    CHECK(bad.exit_code == 1);
    CHECK_THAT(bad.err, Contains("--nproc-per-node: 0"));
}

TEST_CASE("launch: GPU ranks over Gloo without a usable GPU are refused by every rank before any work") {
    test_util::TempDir dir;
    const std::string metrics = dir.path("m.jsonl"), folder = dir.path("ckpt");
    const auto r = test_util::launch(
        2, {"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"), "--device", "cuda",
            "--strategy", "ddp", "--set", "distributed_backend=gloo", "--set", "device_train_microbatch_size=2",
            "--max-duration", "2", "--metrics-file", metrics, "--save-folder", folder});
    INFO(r.out << r.err);
    if (trainer::cuda_device_count() > 0) {  // a GPU machine: the same command trains
        CHECK(r.exit_code == 0);
        return;
    }
#ifdef TRAINER_HAVE_CUDA
    const std::string why = "no usable GPU on this machine (rank ";
#else
    const std::string why = "this build has no CUDA backend";
#endif
    CHECK(r.exit_code != 0);
    CHECK_THAT(r.err, Contains("] error: device \"cuda\""));
    CHECK_THAT(r.err, Contains(why));
    CHECK(!std::filesystem::exists(metrics));
    CHECK(!std::filesystem::exists(folder));
}

TEST_CASE("launch: SIGKILL of one rank stops the others and the launcher within 30 s") {
    int out_pipe[2];
    REQUIRE(::pipe(out_pipe) == 0);
    const pid_t launcher = ::fork();
    REQUIRE(launcher >= 0);
    if (launcher == 0) {
        ::dup2(out_pipe[1], STDOUT_FILENO);
        const int devnull = ::open("/dev/null", O_WRONLY);
        ::dup2(devnull, STDERR_FILENO);
        ::close(out_pipe[0]);
        const std::string bin = test_util::trainer_binary();
        ::execl(bin.c_str(), bin.c_str(), "launch", "--nproc-per-node", "2", "--", "peak-flops", "--seconds", "60",
                static_cast<char*>(nullptr));
        ::_exit(127);
    }
    ::close(out_pipe[1]);
    // Read the launcher's "[launch] rank N ...: pid P" lines.
    std::string text;
    std::map<int, int> pids;
    char buf[4096];
    while (pids.size() < 2) {
        const ssize_t n = ::read(out_pipe[0], buf, sizeof buf);
        REQUIRE(n > 0);
        text.append(buf, static_cast<size_t>(n));
        for (size_t at = 0; (at = text.find("[launch] rank ", at)) != std::string::npos; ++at) {
            const size_t pid_at = text.find(": pid ", at);
            if (pid_at == std::string::npos || text.find('\n', pid_at) == std::string::npos) break;
            pids[std::stoi(text.substr(at + 14))] = std::stoi(text.substr(pid_at + 6));
        }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(::kill(pids[1], SIGKILL) == 0);
    int status = 0;
    pid_t done = 0;
    while ((done = ::waitpid(launcher, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
        char sink[4096];
        (void)!::read(out_pipe[0], sink, sizeof sink);  // keep the pipe drained
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (done == 0) ::kill(launcher, SIGKILL), ::waitpid(launcher, &status, 0);
    ::close(out_pipe[0]);
    CHECK(done == launcher);
    CHECK(seconds < 30.0);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 1);
    CHECK(::kill(pids[0], 0) != 0);  // rank 0 is gone too
}

namespace {

// How a launcher ended: waited for up to 30 s from t0, then SIGKILLed (exited false).
struct Ended {
    bool exited = false;
    double seconds = 0.0;
    int status = 0;
};
Ended wait_up_to_30s(pid_t pid, std::chrono::steady_clock::time_point t0) {
    Ended e;
    pid_t done = 0;
    while ((done = ::waitpid(pid, &e.status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    e.exited = done == pid;
    if (!e.exited) ::kill(pid, SIGKILL), ::waitpid(pid, &e.status, 0);
    return e;
}

// The pid of the trainer process that is rank `rank` among the children of `parent` (mpirun's ranks),
// found through /proc; 0 when none is there yet.
pid_t mpi_rank_pid(pid_t parent, int rank) {
    for (const auto& e : std::filesystem::directory_iterator("/proc")) {
        const std::string name = e.path().filename();
        if (name.find_first_not_of("0123456789") != std::string::npos) continue;
        std::ifstream stat(e.path() / "stat");
        std::string pid, comm, state;
        long ppid = 0;
        if (!(stat >> pid >> comm >> state >> ppid) || ppid != parent) continue;
        std::ifstream env(e.path() / "environ");
        const std::string all((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
        if (all.find(std::string("OMPI_COMM_WORLD_RANK=") + std::to_string(rank) + '\0') != std::string::npos)
            return static_cast<pid_t>(std::stol(name));
    }
    return 0;
}

// Runs a long 2-rank DDP training under `launcher_argv`, SIGKILLs rank 1 once training has started, and
// checks that the launcher exits non-zero within 30 s, that rank 0 is gone, and that the log names rank 1.
void kill_rank_during_training(const std::vector<std::string>& launcher_argv, bool mpirun, const std::string& named) {
    test_util::TempDir dir;
    const std::string log = dir.path("log.txt"), metrics = dir.path("m.jsonl");
    std::vector<std::string> argv = launcher_argv;
    argv.insert(argv.end(), {"--config", test_util::fixture("olmo_tiny.json"), "--max-duration", "100000", "--strategy",
                             "ddp", "--metrics-file", metrics, "--threads", "1"});
    const pid_t launcher = test_util::start_logged(argv, log);
    REQUIRE(launcher > 0);
    // Wait for two logged steps (both ranks are inside the training loop's collectives).
    pid_t victim = 0, survivor = 0;
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
        if (test_util::read_file_if_exists(metrics).find("\"step\":2") != std::string::npos) {
            if (mpirun) {
                victim = mpi_rank_pid(launcher, 1), survivor = mpi_rank_pid(launcher, 0);
            } else {
                victim = test_util::launched_rank_pid(log, 1), survivor = test_util::launched_rank_pid(log, 0);
            }
            if (victim > 0 && survivor > 0) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    REQUIRE(victim > 0);
    REQUIRE(survivor > 0);
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(::kill(victim, SIGKILL) == 0);
    const Ended ended = wait_up_to_30s(launcher, t0);
    const int status = ended.status;
    const double seconds = ended.seconds;
    const std::string text = test_util::read_file(log);
    INFO(text);
    CHECK(ended.exited);
    CHECK(seconds < 30.0);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) != 0));
    // Rank 0 is gone too (mpirun may return while its last rank is still being torn down: allow 10 s).
    bool gone = false;
    for (int i = 0; i < 200 && !gone; ++i) {
        std::ifstream stat("/proc/" + std::to_string(survivor) + "/stat");
        std::string pid, comm, state;
        gone = !(stat >> pid >> comm >> state) || state == "Z";
        if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(gone);
    CHECK_THAT(text, Contains(named));
}

}  // namespace

TEST_CASE("launch: SIGKILL of a training rank ends trainer launch and mpirun runs within 30 s naming it") {
    kill_rank_during_training(test_util::launch_command(2), false, "rank 1");
    kill_rank_during_training({"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
                               "2", "-x", "MASTER_PORT=" + test_util::free_port(), test_util::trainer_binary()},
                              true, "rank 1");
}

namespace {

// Losses by step of a metrics file (the last record of each step).
std::map<long, double> losses_by_step(const std::string& metrics) {
    std::map<long, double> m;
    for (const auto& r : test_util::read_metrics(metrics)) m[r["step"].get<long>()] = r["loss"].get<double>();
    return m;
}

// Runs a 2-rank training of `steps` steps under `launcher_argv`, sends `sig` to the launcher once 3 steps
// are logged, and checks: the launcher exits within 30 s (with `want_code` when it is not -1, non-zero
// otherwise), the metrics file records the stop after the last logged step, the newest checkpoint is
// that step's, and (with `resume`) resuming it under `trainer launch` gives `ref`'s losses bitwise. The
// resume is the same code whichever launcher stopped the run, so one case resumes (the test's time).
void preempt_and_resume(const std::vector<std::string>& launcher_argv, const std::vector<std::string>& train_args,
                        int sig, int want_code, const std::map<long, double>& ref, bool resume_after = false) {
    test_util::TempDir dir;
    const std::string log = dir.path("log.txt"), metrics = dir.path("m.jsonl"), folder = dir.path("ckpt");
    std::vector<std::string> argv = launcher_argv;
    argv.insert(argv.end(), train_args.begin(), train_args.end());
    argv.insert(argv.end(), {"--save-folder", folder, "--metrics-file", metrics});
    const pid_t launcher = test_util::start_logged(argv, log);
    REQUIRE(launcher > 0);
    const auto start = std::chrono::steady_clock::now();
    while (test_util::read_file_if_exists(metrics).find("\"step\":3") == std::string::npos &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    const auto t0 = std::chrono::steady_clock::now();
    REQUIRE(::kill(launcher, sig) == 0);
    const Ended ended = wait_up_to_30s(launcher, t0);
    const int status = ended.status;
    const double seconds = ended.seconds;
    const std::string text = test_util::read_file(log);
    INFO(text);
    REQUIRE(ended.exited);
    CHECK(seconds < 30.0);
    REQUIRE(WIFEXITED(status));
    if (want_code >= 0) CHECK(WEXITSTATUS(status) == want_code);
    CHECK(WEXITSTATUS(status) != 0);
    // The stop record names the last logged step, whose checkpoint is the newest.
    trainer::Json stopped;
    std::stringstream lines(test_util::read_file(metrics));
    for (std::string line; std::getline(lines, line);) {
        if (line.find("\"event\":\"stopped\"") != std::string::npos) stopped = trainer::Json::parse(line);
    }
    INFO("exit status " << WEXITSTATUS(status) << "; metrics:\n" << test_util::read_file_if_exists(metrics));
    REQUIRE(stopped.is_object());
    const long step = stopped["step"].get<long>();
    const auto logged = losses_by_step(metrics);
    CHECK(logged.rbegin()->first == step);
    CHECK(step < static_cast<long>(ref.size()));
    CHECK(trainer::latest_checkpoint_step(folder) == std::optional<long>(step));
    CHECK_THAT(text, Contains("stopped by " + std::string(trainer::stop::signal_name(sig)) + " after step " +
                              std::to_string(step)));
    if (!resume_after) return;
    // Resume (on the same command line, through try_load_latest_save) to the end.
    std::vector<std::string> resume = test_util::launch_args(2, train_args);
    resume.insert(resume.end(),
                  {"--save-folder", folder, "--metrics-file", metrics, "--set", "try_load_latest_save=true"});
    const auto r = test_util::run_trainer(resume);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.out, Contains("resumed from " + folder + "/step" + std::to_string(step)));
    CHECK(losses_by_step(metrics) == ref);
}

}  // namespace

TEST_CASE("preemption: a stop signal to trainer launch or mpirun saves the last step and resumes bitwise", "[heavy]") {
    const std::vector<std::string> args = {"--config",       test_util::fixture("olmo_tiny.json"),
                                           "--max-duration", "2000",
                                           "--threads",      "1",
                                           "--strategy",     "fsdp",
                                           "--set",          "console_log_interval=100"};
    test_util::TempDir dir;
    std::vector<std::string> ref_args = test_util::launch_args(2, args);
    ref_args.insert(ref_args.end(), {"--metrics-file", dir.path("ref.jsonl")});
    const auto r = test_util::run_trainer(ref_args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const auto ref = losses_by_step(dir.path("ref.jsonl"));
    REQUIRE(ref.size() == 2000);
    {
        INFO("trainer launch, SIGTERM");
        preempt_and_resume(test_util::launch_command(2), args, SIGTERM, 128 + SIGTERM, ref, true);
    }
    // mpirun passes SIGTERM on after odls_base_sigkill_timeout seconds and SIGKILLs as long after that, and
    // stops relaying its ranks' output meanwhile (a rank that logs every millisecond blocks on a full
    // terminal: hence one console line per 100 steps); SIGUSR1 it forwards at once.
    {
        INFO("mpirun, SIGTERM");
        preempt_and_resume({"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--mca",
                            "odls_base_sigkill_timeout", "2", "-np", "2", "-x", "MASTER_PORT=" + test_util::free_port(),
                            test_util::trainer_binary()},
                           args, SIGTERM, -1, ref);
    }
    {
        INFO("mpirun, SIGUSR1");
        preempt_and_resume({"/usr/bin/mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
                            "2", "-x", "MASTER_PORT=" + test_util::free_port(), test_util::trainer_binary()},
                           args, SIGUSR1, 128 + SIGUSR1, ref);
    }
}

TEST_CASE("preemption: SIGTERM to one rank alone stops every rank after the same step") {
    test_util::TempDir dir;
    const std::string log = dir.path("log.txt"), metrics = dir.path("m.jsonl"), folder = dir.path("ck");
    const pid_t launcher = test_util::start_logged({test_util::trainer_binary(),
                                                    "launch",
                                                    "--nproc-per-node",
                                                    "2",
                                                    "--master-port",
                                                    test_util::free_port(),
                                                    "--",
                                                    "--config",
                                                    test_util::fixture("olmo_tiny.json"),
                                                    "--max-duration",
                                                    "100000",
                                                    "--threads",
                                                    "1",
                                                    "--strategy",
                                                    "ddp",
                                                    "--save-folder",
                                                    folder,
                                                    "--metrics-file",
                                                    metrics,
                                                    "--set",
                                                    "console_log_interval=100"},
                                                   log);
    // Rank 1's pid from the launcher's "[launch] rank 1 ...: pid P" line, once training runs.
    pid_t rank1 = 0;
    const auto start = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
        if (test_util::read_file_if_exists(metrics).find("\"step\":3") != std::string::npos &&
            (rank1 = test_util::launched_rank_pid(log, 1)) > 0)
            break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    REQUIRE(rank1 > 0);
    REQUIRE(::kill(rank1, SIGTERM) == 0);  // rank 0 never sees a signal: it learns of the stop in the all-reduce
    const Ended ended = wait_up_to_30s(launcher, std::chrono::steady_clock::now());
    const int status = ended.status;
    const std::string text = test_util::read_file(log);
    INFO(text);
    REQUIRE(ended.exited);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM));
    const auto rows = test_util::read_metrics(metrics);
    REQUIRE(!rows.empty());
    CHECK(trainer::latest_checkpoint_step(folder) == std::optional<long>(rows.back()["step"].get<long>()));
    CHECK_THAT(text, Contains("every rank stopped on Terminated; exit status 143"));
}
