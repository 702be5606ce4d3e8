// The watchdog of a device communicator (see comm_stream.h), and the CUDA stream's refusal in a build
// without CUDA.
#include "parallel/comm/comm_stream.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "base/common.h"

namespace trainer {

std::string comm_op_name(const std::string& library, const char* op, int rank, int size) {
    return fmt::format("{} {} on rank {}/{}", library, op, rank, size);
}

CommWatchdog::CommWatchdog(CommStream& stream, std::string library, int rank, int size,
                           std::chrono::milliseconds timeout, Hooks hooks)
    : stream_(stream),
      library_(std::move(library)),
      rank_(rank),
      size_(size),
      timeout_(timeout),
      hooks_(std::move(hooks)),
      thread_([this] { watch(); }) {}

CommWatchdog::~CommWatchdog() {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void CommWatchdog::track(const char* op, EventRef done, std::chrono::steady_clock::time_point issued) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.push_back({op, std::move(done), issued});
}

bool CommWatchdog::idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    // An operation the device failed will not complete: nothing to wait for there either.
    std::string error;
    while (!pending_.empty() && (stream_.done(pending_.front().done, &error) || !error.empty())) pending_.pop_front();
    return pending_.empty();
}

void CommWatchdog::watch() {
    // A new thread starts on device 0: without this, its first CUDA call would open a context on GPU 0 for
    // every rank of the node.
    stream_.bind_thread();
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
        cv_.wait_for(lock, std::chrono::milliseconds(100));
        if (stopping_) return;
        std::string device_error;
        while (!pending_.empty() && stream_.done(pending_.front().done, &device_error)) pending_.pop_front();
        std::string why;
        if (!device_error.empty()) {
            // A sticky device error (a faulting kernel) is not a late peer: report it as it is.
            why = "could not complete: the device reported " + device_error;
        } else if (hooks_.async_error) {
            const std::string e = hooks_.async_error();
            if (!e.empty()) why = "failed: " + e + "; a peer rank probably died";
        }
        if (why.empty() && !pending_.empty() && std::chrono::steady_clock::now() - pending_.front().issued > timeout_) {
            why = fmt::format(
                "timed out after {:.0f} s (distributed_timeout_seconds); a peer rank probably died or stopped "
                "issuing collectives",
                timeout_.count() / 1e3);
        }
        if (why.empty()) continue;
        const char* op = pending_.empty() ? "communicator" : pending_.front().op;
        std::fprintf(stderr, "error: %s %s; aborting the communicator\n",
                     comm_op_name(library_, op, rank_, size_).c_str(), why.c_str());
        std::fflush(stderr);
        if (hooks_.abort) hooks_.abort();
        std::_Exit(1);  // the main thread may be blocked on the device; the launcher reports this rank
    }
}

#ifndef TRAINER_HAVE_CUDA
std::unique_ptr<CommStream> make_cuda_comm_stream(Backend*) {
    user_error(
        "a communicator on device memory needs the CUDA backend: this build has no CUDA (nvcc was not found when "
        "it was configured); use --device cpu");
}
#endif

}  // namespace trainer
