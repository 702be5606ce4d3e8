// A CPU run on a node that other processes also use: with threads: 0 the thread count follows the cores
// left free (kernels/cpu/machine.h ThreadGovernor), and the numbers do not depend on it. The speed it
// keeps is measured by scripts/bench_shared_cpu.sh, not here.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "base/common.h"
#include "test_util.h"

using Catch::Matchers::Contains;

namespace {

// CPU-bound child processes, killed when this goes out of scope.
class BusyProcesses {
   public:
    explicit BusyProcesses(int n) {
        for (int i = 0; i < n; ++i) {
            const pid_t pid = ::fork();
            if (pid == 0) {
                volatile unsigned long x = 0;
                for (;;) x = x + 1;
            }
            pids_.push_back(pid);
        }
    }
    ~BusyProcesses() {
        for (pid_t p : pids_) ::kill(p, SIGKILL);
        for (pid_t p : pids_) ::waitpid(p, nullptr, 0);
    }

   private:
    std::vector<pid_t> pids_;
};

}  // namespace

TEST_CASE("shared node: threads 0 drops to the cores other processes leave and the losses stay the same bits",
          "[heavy]") {
    const long cores = ::sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 2) {
        WARN("skipped: this machine has one core, so there is no thread count to follow");
        return;
    }
    test_util::TempDir dir;
    const std::vector<std::string> run = {"--config",       "configs/tiny.json",
                                          "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                          "--max-duration", "300",
                                          "--set",          "console_log_interval=100000"};
    auto with = [&](std::vector<std::string> extra, const std::string& metrics) {
        std::vector<std::string> a = run;
        extra.insert(extra.end(), {"--metrics-file", metrics});
        a.insert(a.end(), extra.begin(), extra.end());
        return a;
    };
    // OpenBLAS's Haswell kernels where the CPU runs them (and no kernel set is pinned already): their own threading
    // sums differently on each thread count, as most of its x86 sets' does, so the bits hold only if the GEMMs keep
    // their tiles whatever the thread count (kernels/cpu/matmul.cpp). Its SkylakeX set, which this machine may pick
    // by itself, sums alike on any count and would not tell.
    std::vector<std::string> env;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2") && std::getenv("OPENBLAS_CORETYPE") == nullptr)
        env.push_back("OPENBLAS_CORETYPE=Haswell");
#endif
    test_util::RunResult shared;
    {
        const BusyProcesses busy(static_cast<int>(cores) - 1);  // one core left
        std::vector<std::string> shared_env = env;
        shared_env.push_back("-OMP_NUM_THREADS");
        shared = test_util::run_trainer(with({}, dir.path("shared.jsonl")), shared_env);
    }
    INFO(shared.out << shared.err);
    REQUIRE(shared.exit_code == 0);
    // Fewer threads (on 2 cores, 1; on more it steps down towards 1 as the samples come).
    CHECK_THAT(shared.out, Contains(fmt::format(" of {}: other processes are using the cores", cores)));
    // The same run on its starting thread count, fixed, gives the same losses, bit for bit.
    const auto fixed = test_util::run_trainer(with({"--threads", std::to_string(cores)}, dir.path("fixed.jsonl")), env);
    REQUIRE(fixed.exit_code == 0);
    if (!env.empty()) CHECK_THAT(fixed.out, Contains("GEMMs: OpenBLAS Haswell kernels"));
    const auto a = test_util::read_metrics(dir.path("shared.jsonl")),
               b = test_util::read_metrics(dir.path("fixed.jsonl"));
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(a[i]["loss"].get<double>() == b[i]["loss"].get<double>());
}
