// The launcher (see launcher.h): fork/exec of /proc/self/exe per local rank, a poll loop over the ranks'
// stdout/stderr pipes that prefixes whole lines, and waitpid to notice the first failure.
#include "parallel/launch/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>

#include "base/common.h"
#include "parallel/launch/store_secret.h"
#include "parallel/launch/tcp_store.h"

namespace trainer {
namespace {

std::atomic<int> g_forward_signal{0};
std::atomic<bool> g_signalled{false};  // a stop signal came at some point: no restart after it

void on_signal(int sig) {
    g_forward_signal = sig;
    g_signalled = true;
}

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
Child start_rank(const LaunchOptions& o, int i, int world, int threads, int round) {
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
        if (o.max_restarts > 0) {  // the launchers' store, one key prefix a round (rank_env.h)
            ::setenv("TRAINER_AGENT_STORE", "1", 1);
            ::setenv("TRAINER_STORE_PREFIX", fmt::format("round{}/", round).c_str(), 1);
            ::setenv("TRAINER_RESTART_COUNT", std::to_string(round).c_str(), 1);
        }
        std::vector<char*> argv;
        static char self[] = "trainer";
        argv.push_back(self);
        for (const auto& a : o.args) argv.push_back(const_cast<char*>(a.c_str()));
        if (round > 0)
            for (const auto& a : o.restart_args) argv.push_back(const_cast<char*>(a.c_str()));
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

// The launchers' agreement on restarts: node 0's launcher hosts the store at the master address, every
// launcher is a client. A round starts when every node's launcher has joined it; a launcher whose ranks fail
// reports why under the round's key, and the others, polling, stop their ranks too.
class Agreement {
   public:
    explicit Agreement(const LaunchOptions& o) : o_(o) {
        const std::string secret = store_secret_from_env([](const char* name) { return std::getenv(name); }).value();
        if (o.node_rank == 0) server_ = std::make_unique<TcpStoreServer>(o.master_port, secret);
        store_ = std::make_unique<TcpStore>(o.master_addr, o.master_port,
                                            std::chrono::milliseconds(static_cast<long>(o.join_timeout_seconds * 1000)),
                                            secret);
    }

    // Waits until every node's launcher joined `round` (or a stop signal came: false).
    bool join(int round) {
        store_->set(key(round, "joined", o_.node_rank), {1});
        std::vector<std::string> keys;
        for (int n = 0; n < o_.nnodes; ++n) keys.push_back(key(round, "joined", n));
        const auto deadline = std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(static_cast<long>(o_.join_timeout_seconds * 1000));
        for (;;) {
            const std::vector<bool> in = store_->check(keys);
            std::string missing;
            for (int n = 0; n < o_.nnodes; ++n)
                if (!in[n]) missing += (missing.empty() ? "" : ", ") + std::to_string(n);
            if (missing.empty()) return true;
            if (g_forward_signal.load() != 0) return false;
            if (std::chrono::steady_clock::now() > deadline) {
                user_error("launch: round {} of the restarts: node(s) {} of {} did not join within {} s at {}", round,
                           missing, o_.nnodes, o_.join_timeout_seconds, store_->address());
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
    }

    void report_failure(int round, const std::string& why) {
        const std::string text = o_.nnodes > 1 ? fmt::format("node {}: {}", o_.node_rank, why) : why;
        store_->set(key(round, "failed", o_.node_rank), std::vector<char>(text.begin(), text.end()));
    }

    // What the nodes reported failing in `round`, "; "-joined ("" when none did).
    std::string failures(int round) {
        std::vector<std::string> keys;
        for (int n = 0; n < o_.nnodes; ++n) keys.push_back(key(round, "failed", n));
        const std::vector<bool> in = store_->check(keys);
        std::string out;
        for (int n = 0; n < o_.nnodes; ++n) {
            if (!in[n]) continue;
            out += (out.empty() ? "" : "; ") + store_->get_text(keys[n], 4096);
        }
        return out;
    }

    // The run ended well on this node. Node 0 hosts the store, so it waits (a while) for the others to say so
    // too before it exits and takes the store with it.
    void finish(int round) {
        store_->set(key(round, "done", o_.node_rank), {1});
        if (o_.node_rank != 0) return;
        std::vector<std::string> keys;
        for (int n = 0; n < o_.nnodes; ++n) keys.push_back(key(round, "done", n));
        try {
            store_->wait(keys, std::chrono::milliseconds(30000));
        } catch (const UserError&) {
            std::fprintf(stderr, "[launch] the other nodes did not report their end within 30 s; exiting\n");
        }
    }

   private:
    static std::string key(int round, const char* what, int node) {
        return fmt::format("launch/round{}/{}/{}", round, what, node);
    }
    const LaunchOptions& o_;
    std::unique_ptr<TcpStoreServer> server_;
    std::unique_ptr<TcpStore> store_;
};

// How one round of local ranks ended.
struct RoundEnd {
    enum Kind { kSuccess, kStopped, kFailed } kind = kSuccess;
    int code = 0;       // kStopped: 128 + the signal
    std::string cause;  // kFailed: which rank exited how, or which node's failure stopped this one
};

// Starts this node's ranks for `round` and watches them until every one has exited (see launch()).
RoundEnd run_round(const LaunchOptions& o, int round, Agreement* agreement) {
    const int world = o.nnodes * o.nproc_per_node;
    const int threads = std::max(1, available_cores() / o.nproc_per_node);
    std::vector<Child> children(o.nproc_per_node);
    for (int i = 0; i < o.nproc_per_node; ++i) {
        children[i] = start_rank(o, i, world, threads, round);
    }
    std::fflush(stdout);

    // A stop signal (SIGTERM, SIGINT, SIGUSR1) is forwarded to every rank, which finish their step, save
    // and exit with 128 + the signal (base/stop.h): no deadline, the ranks' collective timeout bounds it. A
    // second signal more than 2 s later kills them. A rank that fails (any other exit), or a failure another
    // node's launcher reports, gets the others SIGTERMed, then SIGKILLed after stop_grace_seconds.
    int failed_rank = -1, failed_status = 0, stopped_code = 0;
    std::string remote_failure;
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
    auto stop_started = std::chrono::steady_clock::now(), polled = stop_started;
    bool killed = false, store_lost = false;
    auto start_stopping = [&] {
        if (stopping) return;
        stop_all(SIGTERM);
        stopping = true;
        stop_started = std::chrono::steady_clock::now();
    };
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
                if (stopped && stopped_code == 0 && !stopping)
                    stopped_code = ended_by_forward ? 128 + forwarded : WEXITSTATUS(status);
                if (!ok && !stopped &&
                    (!first_failure || (WIFSIGNALED(status) && !WIFSIGNALED(first_failure->status)))) {
                    first_failure = &c;
                }
            } else {
                ++running;
            }
        }
        if (first_failure && failed_rank < 0 && remote_failure.empty()) {
            failed_rank = first_failure->rank;
            failed_status = first_failure->status;
            const std::string why = fmt::format("rank {} exited with {}", failed_rank, describe(failed_status));
            if (!stopping) std::fprintf(stderr, "[launch] %s; stopping the other ranks\n", why.c_str());
            start_stopping();
            if (agreement && !store_lost) {
                try {
                    agreement->report_failure(round, why);
                } catch (const UserError& e) {
                    std::fprintf(stderr, "[launch] could not report it to the other nodes: %s\n", e.what());
                    store_lost = true;
                }
            }
        }
        // Another node's failure: polled a few times a second while this node's ranks run.
        if (agreement && !store_lost && !stopping && forwarded == 0 && seconds_since(polled) > 0.25) {
            polled = std::chrono::steady_clock::now();
            try {
                remote_failure = agreement->failures(round);
            } catch (const UserError& e) {
                // Node 0's launcher is gone: no restart can be agreed on, and this node's ranks end on their own.
                std::fprintf(stderr, "[launch] lost the launchers' store (%s); no restart is possible\n", e.what());
                store_lost = true;
            }
            if (!remote_failure.empty()) {
                std::fprintf(stderr, "[launch] %s; stopping this node's ranks\n", remote_failure.c_str());
                start_stopping();
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
    RoundEnd end;
    if (failed_rank >= 0 || !remote_failure.empty()) {
        end.kind = RoundEnd::kFailed;
        end.cause = failed_rank >= 0 ? fmt::format("rank {} exited with {}", failed_rank, describe(failed_status))
                                     : remote_failure;
        if (store_lost) end.code = -1;  // no restart: the launchers can no longer agree
    } else if (stopped_code != 0) {
        end.kind = RoundEnd::kStopped;
        end.code = stopped_code;
    }
    return end;
}

// Restarts after a failure that repeats at once back off: the first round that fails within kSettledSeconds of its
// start restarts at once (a transient: a rank killed), and each further one in a row waits 1, 2, 4, ... s (at most
// kMaxBackoffSeconds) first, so a failure that is not transient (a bad node, a file missing, a port in use) does not
// spin through the restarts. A round that trained for longer resets the count. False when a stop signal came
// meanwhile.
constexpr double kSettledSeconds = 60.0, kMaxBackoffSeconds = 30.0;
bool back_off(int quick_failures) {
    if (quick_failures < 2) return true;
    const double seconds = std::min(kMaxBackoffSeconds, std::ldexp(1.0, std::min(quick_failures, 16) - 2));
    std::fprintf(stderr,
                 "[launch] %d rounds in a row failed within %.0f s of their start: waiting %.0f s before the "
                 "restart\n",
                 quick_failures, kSettledSeconds, seconds);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < until) {
        if (g_forward_signal.load() != 0) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
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
    if (o.max_restarts < 0) user_error("launch --max-restarts: {}; expected a count >= 0", o.max_restarts);
    if (!(o.join_timeout_seconds > 0)) {
        user_error("launch --join-timeout: {}; expected a positive number of seconds", o.join_timeout_seconds);
    }

    // The job's rendezvous secret, inherited by every rank (and used by the launchers' own store): given, or on one
    // node made here. Several nodes must share one, so it must be given.
    if (!store_secret_from_env([](const char* name) { return std::getenv(name); })) {
        if (o.nnodes > 1) {
            user_error(
                "launch --nnodes {}: {} is not set; every node's launcher and ranks need the job's same rendezvous "
                "secret: export it (or {}, a file holding it) on each node first",
                o.nnodes, kStoreSecretEnv, kStoreSecretFileEnv);
        }
        ::setenv(kStoreSecretEnv, new_store_secret().c_str(), 1);
    }

    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaction(sig, &sa, nullptr);

    std::unique_ptr<Agreement> agreement;
    if (o.max_restarts > 0) agreement = std::make_unique<Agreement>(o);
    int quick_failures = 0;  // consecutive rounds that failed within kSettledSeconds of their start
    for (int round = 0;; ++round) {
        if (round > 0 && !back_off(quick_failures)) {
            const int sig = g_forward_signal.load();
            std::fprintf(stderr, "[launch] %s while waiting to restart; exit status %d\n", strsignal(sig), 128 + sig);
            return 128 + sig;
        }
        if (agreement && !agreement->join(round)) {
            const int sig = g_forward_signal.load();
            std::fprintf(stderr, "[launch] %s before the ranks started; exit status %d\n", strsignal(sig), 128 + sig);
            return 128 + sig;
        }
        if (round > 0) {
            // Every node that failed reported it before joining this round: the causes of every node.
            std::fprintf(stderr,
                         "[launch] restart %d of %d: %s; starting every rank again from the newest complete "
                         "checkpoint\n",
                         round, o.max_restarts, agreement->failures(round - 1).c_str());
        }
        const auto round_start = std::chrono::steady_clock::now();
        const RoundEnd end = run_round(o, round, agreement.get());
        const double lasted = std::chrono::duration<double>(std::chrono::steady_clock::now() - round_start).count();
        quick_failures = lasted < kSettledSeconds ? quick_failures + 1 : 0;
        if (end.kind == RoundEnd::kSuccess) {
            if (agreement) agreement->finish(round);
            return 0;
        }
        if (end.kind == RoundEnd::kStopped) {
            std::fprintf(stderr, "[launch] every rank stopped on %s; exit status %d\n", strsignal(end.code - 128),
                         end.code);
            return end.code;
        }
        if (round >= o.max_restarts || end.code < 0 || g_signalled) {
            const std::string used =
                o.max_restarts > 0 ? fmt::format(" ({} of {} restarts used)", round, o.max_restarts) : "";
            std::fprintf(stderr, "error: launch: %s; the other ranks were stopped%s\n", end.cause.c_str(),
                         used.c_str());
            return 1;
        }
    }
}

}  // namespace trainer
