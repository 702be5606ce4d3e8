// Shared helpers of the C++ tests: temporary folders, running the trainer binary, reading metrics files.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"

namespace test_util {

inline std::string source_dir() { return TRAINER_SOURCE_DIR; }
inline std::string fixture(const std::string& name) { return source_dir() + "/tests/fixtures/" + name; }
inline std::string trainer_binary() { return TRAINER_BINARY; }

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

struct RunResult {
    int exit_code = -1;  // -signal when killed
    std::string out, err;
};

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

// Runs the trainer with `args` (no shell), from the source folder, capturing stdout and stderr.
// Extra environment assignments ("K=V") are added to the child's environment.
inline RunResult run_trainer(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
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
        for (const auto& kv : env) ::putenv(const_cast<char*>(kv.c_str()));
        ::setenv("OMP_NUM_THREADS", "2", 0);
        std::vector<char*> argv;
        const std::string bin = trainer_binary();
        argv.push_back(const_cast<char*>(bin.c_str()));
        for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::execv(bin.c_str(), argv.data());
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

// One JSON object per line of a metrics file; the summary line (event) is left out.
inline std::vector<trainer::Json> read_metrics(const std::string& path) {
    std::vector<trainer::Json> rows;
    std::ifstream f(path);
    std::string line;
    while (std::getline(f, line)) {
        if (line.empty()) continue;
        auto j = trainer::Json::parse(line);
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

}  // namespace test_util
