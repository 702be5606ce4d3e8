// Stop requests (see stop.h). The handler only touches lock-free atomics and async-signal-safe calls
// (clock_gettime, sigaction, raise).
#include "base/stop.h"

#include <signal.h>
#include <time.h>

#include <atomic>
#include <initializer_list>

namespace trainer::stop {
namespace {

std::atomic<int> g_signal{0};
std::atomic<long long> g_first_ns{0};
std::atomic<bool> g_installed{false};

long long monotonic_ns() {
    timespec ts{};
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void on_signal(int sig) {
    int none = 0;
    if (g_signal.compare_exchange_strong(none, sig)) {
        g_first_ns = monotonic_ns();
        return;
    }
    if (monotonic_ns() - g_first_ns.load() < 2000000000LL) return;  // the same request, delivered twice
    // A second request: the default action (the process ends by the signal, as a user pressing Ctrl-C
    // twice expects).
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
}

}  // namespace

void install() {
    if (g_installed.exchange(true)) return;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // blocking reads, writes and waits carry on; the loop polls requested()
    for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &sa, nullptr);
}

int requested() { return g_signal.load(); }

namespace {
constexpr int kSignals[kVotes] = {SIGTERM, SIGINT, SIGUSR1};
}

void vote(double* votes) {
    const int sig = requested();
    for (int i = 0; i < kVotes; ++i) votes[i] = kSignals[i] == sig ? 1.0 : 0.0;
}

int agreed(const double* summed_votes) {
    int best = -1;
    for (int i = 0; i < kVotes; ++i) {
        if (summed_votes[i] > 0.0 && (best < 0 || summed_votes[i] > summed_votes[best])) best = i;
    }
    return best < 0 ? 0 : kSignals[best];
}

const char* signal_name(int sig) {
    switch (sig) {
        case SIGTERM:
            return "SIGTERM";
        case SIGINT:
            return "SIGINT";
        case SIGUSR1:
            return "SIGUSR1";
        default:
            return "a signal";
    }
}

}  // namespace trainer::stop
