// The launcher (see launcher.h): fork/exec of /proc/self/exe per local rank, a poll loop over the ranks'
// stdout/stderr pipes that prefixes whole lines, and waitpid to notice the first failure.
#include "parallel/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "base/common.h"

namespace trainer {
namespace {

std::atomic<int> g_forward_signal{0};

void on_signal(int sig) { g_forward_signal = sig; }

struct Child {
    int local_rank = 0, rank = 0;
    pid_t pid = -1;
    int out_fd = -1, err_fd = -1;
    std::string out_buf, err_buf;
    bool exited = false;
    int status = 0;
};

// Writes every complete line of `buf` with the rank prefix; keeps the unfinished tail (all of it at EOF).
void flush_lines(std::string& buf, int rank, std::FILE* to, bool eof) {
    size_t start = 0;
    for (size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1) {
        std::fprintf(to, "[rank %d] %.*s\n", rank, static_cast<int>(nl - start), buf.data() + start);
    }
    buf.erase(0, start);
    if (eof && !buf.empty()) {
        std::fprintf(to, "[rank %d] %s\n", rank, buf.c_str());
        buf.clear();
    }
    std::fflush(to);
}

std::string describe(int status) {
    if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
    return "unknown status";
}

int available_cores() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
}

// Starts local rank `i` of this node: the trainer with the ranks' arguments, torchrun's variables and its
// share of the cores, its stdout and stderr piped back to the launcher.
Child start_rank(const LaunchOptions& o, int i, int world, int threads) {
    Child c;
    c.local_rank = i;
    c.rank = o.node_rank * o.nproc_per_node + i;
    int out_pipe[2], err_pipe[2];
    if (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0) user_error("launch: pipe failed ({})", std::strerror(errno));
    std::fflush(nullptr);
    const pid_t launcher = ::getpid();
    c.pid = ::fork();
    if (c.pid < 0) user_error("launch: fork failed ({})", std::strerror(errno));
    if (c.pid == 0) {
        // A rank dies with its launcher: killed (the OOM killer, a scheduler's SIGKILL), the launcher can
        // neither stop its ranks nor relay their output, and ranks left running beside a requeued run would
        // train and save into the same folder. The death signal survives the exec; a launcher that died
        // before it was set is noticed by the parent's pid.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != launcher) ::_exit(1);
        ::dup2(out_pipe[1], STDOUT_FILENO);
        ::dup2(err_pipe[1], STDERR_FILENO);
        ::close(out_pipe[0]);
        ::close(out_pipe[1]);
        ::close(err_pipe[0]);
        ::close(err_pipe[1]);
        ::setenv("RANK", std::to_string(c.rank).c_str(), 1);
        ::setenv("LOCAL_RANK", std::to_string(i).c_str(), 1);
        ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
        ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
        ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
        ::setenv("MASTER_PORT", std::to_string(o.master_port).c_str(), 1);
        ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
        ::setenv("OPENBLAS_NUM_THREADS", std::to_string(threads).c_str(), 1);
        std::vector<char*> argv;
        static char self[] = "trainer";
        argv.push_back(self);
        for (const auto& a : o.args) argv.push_back(const_cast<char*>(a.c_str()));
        argv.push_back(nullptr);
        ::execv("/proc/self/exe", argv.data());
        std::fprintf(stderr, "error: launch: cannot start the trainer for rank %d (%s)\n", c.rank,
                     std::strerror(errno));
        ::_exit(127);
    }
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    c.out_fd = out_pipe[0];
    c.err_fd = err_pipe[0];
    std::printf("[launch] rank %d (local %d of %d, world %d): pid %d, %d threads\n", c.rank, i, o.nproc_per_node, world,
                static_cast<int>(c.pid), threads);
    return c;
}

// Relays what the ranks wrote since the last call, line by line with their rank (waits up to 100 ms for it).
void relay_output(std::vector<Child>& children) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Child*, bool>> owners;  // (child, is_stderr)
    for (auto& c : children) {
        if (c.out_fd >= 0) fds.push_back({c.out_fd, POLLIN, 0}), owners.emplace_back(&c, false);
        if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0}), owners.emplace_back(&c, true);
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    for (size_t k = 0; k < fds.size(); ++k) {
        if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Child& c = *owners[k].first;
        const bool is_err = owners[k].second;
        char buf[65536];
        const ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
        std::string& acc = is_err ? c.err_buf : c.out_buf;
        if (n > 0) {
            acc.append(buf, static_cast<size_t>(n));
            flush_lines(acc, c.rank, is_err ? stderr : stdout, false);
        } else {
            flush_lines(acc, c.rank, is_err ? stderr : stdout, true);
            ::close(fds[k].fd);
            (is_err ? c.err_fd : c.out_fd) = -1;
        }
    }
    if (fds.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace

int launch(const LaunchOptions& o) {
    if (o.nproc_per_node < 1) user_error("launch --nproc-per-node: {}; expected >= 1", o.nproc_per_node);
    if (o.nnodes < 1) user_error("launch --nnodes: {}; expected >= 1", o.nnodes);
    if (o.node_rank < 0 || o.node_rank >= o.nnodes) {
        user_error("launch --node-rank: {}; expected 0..{} for --nnodes {}", o.node_rank, o.nnodes - 1, o.nnodes);
    }
    if (o.master_port < 1 || o.master_port > 65535) {
        user_error("launch --master-port: {}; expected 1..65535", o.master_port);
    }
    const int world = o.nnodes * o.nproc_per_node;
    const int threads = std::max(1, available_cores() / o.nproc_per_node);

    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaction(sig, &sa, nullptr);

    std::vector<Child> children(o.nproc_per_node);
    for (int i = 0; i < o.nproc_per_node; ++i) {
        children[i] = start_rank(o, i, world, threads);
    }
    std::fflush(stdout);

    // A stop signal (SIGTERM, SIGINT, SIGUSR1) is forwarded to every rank, which finish their step, save
    // and exit with 128 + the signal (base/stop.h): no deadline, the ranks' collective timeout bounds it. A
    // second signal more than 2 s later kills them. A rank that fails (any other exit) gets the others
    // SIGTERMed, then SIGKILLed after stop_grace_seconds.
    int failed_rank = -1, failed_status = 0, stopped_code = 0;
    int forwarded = 0;
    auto forwarded_at = std::chrono::steady_clock::now();
    bool stopping = false;
    auto stop_all = [&](int sig) {
        for (auto& c : children) {
            if (!c.exited) ::kill(c.pid, sig);
        }
    };
    auto seconds_since = [](std::chrono::steady_clock::time_point t) {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    };
    auto stop_started = std::chrono::steady_clock::now();
    bool killed = false;
    for (;;) {
        // Output first, so a failing rank's last words appear before the launcher's verdict.
        relay_output(children);

        if (const int sig = g_forward_signal.exchange(0)) {
            if (forwarded == 0) {
                std::fprintf(stderr, "[launch] %s: every rank stops after its current step\n", strsignal(sig));
                stop_all(sig);
                forwarded = sig;
                forwarded_at = std::chrono::steady_clock::now();
            } else if (seconds_since(forwarded_at) > 2.0 && !killed) {
                std::fprintf(stderr, "[launch] second stop signal: killing every rank\n");
                stop_all(SIGKILL);
                killed = true;
            }
        }
        int running = 0;
        const Child* first_failure = nullptr;  // of this pass: a rank killed by a signal wins over one that
                                               // exited with an error, usually the consequence
        for (auto& c : children) {
            if (c.exited) continue;
            int status = 0;
            if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
                c.exited = true;
                c.status = status;
                const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
                // A stop the ranks agreed on (base/stop.h), whether the signal came through this launcher or
                // reached a rank directly (scancel signals every process of a job step).
                // A rank that the forwarded signal ended before it took stop signals (in its rendezvous) was
                // stopped by it too: nothing was trained, so nothing was lost.
                const bool ended_by_forward = forwarded != 0 && WIFSIGNALED(status) && WTERMSIG(status) == forwarded;
                const bool stopped = ended_by_forward || (WIFEXITED(status) && (WEXITSTATUS(status) == 128 + SIGTERM ||
                                                                                WEXITSTATUS(status) == 128 + SIGINT ||
                                                                                WEXITSTATUS(status) == 128 + SIGUSR1));
                if (stopped && stopped_code == 0)
                    stopped_code = ended_by_forward ? 128 + forwarded : WEXITSTATUS(status);
                if (!ok && !stopped &&
                    (!first_failure || (WIFSIGNALED(status) && !WIFSIGNALED(first_failure->status)))) {
                    first_failure = &c;
                }
            } else {
                ++running;
            }
        }
        if (first_failure && failed_rank < 0) {
            failed_rank = first_failure->rank;
            failed_status = first_failure->status;
            if (!stopping) {
                std::fprintf(stderr, "[launch] rank %d exited with %s; stopping the other ranks\n", failed_rank,
                             describe(failed_status).c_str());
                stop_all(SIGTERM);
                stopping = true;
                stop_started = std::chrono::steady_clock::now();
            }
        }
        if (stopping && !killed && seconds_since(stop_started) > o.stop_grace_seconds) {
            stop_all(SIGKILL);
            killed = true;
        }
        bool pipes_open = false;
        for (auto& c : children) pipes_open = pipes_open || c.out_fd >= 0 || c.err_fd >= 0;
        if (running == 0 && !pipes_open) break;
        if (running == 0 && killed) break;  // grandchildren may hold the pipes open
    }
    std::fflush(stdout);
    if (failed_rank >= 0) {
        std::fprintf(stderr, "error: launch: rank %d exited with %s; the other ranks were stopped\n", failed_rank,
                     describe(failed_status).c_str());
        return 1;
    }
    if (stopped_code != 0) {
        std::fprintf(stderr, "[launch] every rank stopped on %s; exit status %d\n", strsignal(stopped_code - 128),
                     stopped_code);
        return stopped_code;
    }
    return 0;
}

}  // namespace trainer
