// `trainer launch`: ranks get their environment and prefixed output; a failing rank is named and the
// others stopped; SIGKILL of one rank brings down every other rank and the launcher within 30 s.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>

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
