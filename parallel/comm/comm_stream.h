// The device side of a communicator, written once for every collectives library that runs beside a GPU's
// compute: NCCL (the collective itself on the communication stream) and staged Gloo (the device buffer copied
// to pinned host memory on that stream, Gloo on the host, the result copied back).
//
// CommStream is what such a communicator needs of a device: a communication stream ordered after the
// compute stream by events, asynchronous copies between device and pinned host memory on it, events the host
// polls, and the compute stream's wait for an event (the handle's wait). The CUDA one (make_cuda_comm_stream)
// is the only one a run uses; the CPU tests drive the same communicators over an emulated device whose
// streams are host threads (tests/emulated_stream.h).
//
// CommWatchdog retires a communicator's device-side operations as their events complete and, when one
// outlasts the timeout, the device reports an error, or the library reports an asynchronous one, prints
// which operation failed on which rank, aborts the library and ends the process (exit 1), as PyTorch's NCCL
// watchdog does: the main thread may be blocked on the device, and the launcher then names the rank.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/comm/communicator.h"

namespace trainer {

// A point in a stream's work (a CUDA event): complete once everything queued before it has run.
class StreamEvent {
   public:
    virtual ~StreamEvent() = default;
};
using EventRef = std::shared_ptr<StreamEvent>;

class CommStream {
   public:
    virtual ~CommStream() = default;
    // The compute stream's work queued so far.
    virtual EventRef mark_compute() = 0;
    // The communication stream runs what is queued on it next only after `e`.
    virtual void wait_for(const EventRef& e) = 0;
    // Copies on the communication stream, in its order (host memory from alloc_pinned).
    virtual void copy_to_host(void* host, const void* device, size_t bytes) = 0;
    virtual void copy_to_device(void* device, const void* host, size_t bytes) = 0;
    // The communication stream's work queued so far.
    virtual EventRef mark() = 0;
    // Whether `e` is complete. A device error (a faulting kernel) sets *error and returns false.
    virtual bool done(const EventRef& e, std::string* error) = 0;
    // The compute stream runs what is queued on it next only after `e` (the step's communication wait).
    virtual void compute_waits_for(const EventRef& e) = 0;
    // Host memory (pageable or pinned), not device memory.
    virtual bool is_host(const void* p) const = 0;
    virtual void* alloc_pinned(size_t bytes) = 0;
    virtual void free_pinned(void* p) = 0;
    // Makes the calling thread (a communicator's worker, a watchdog) use this stream's device.
    virtual void bind_thread() {}
};

// The CUDA backend's: a high-priority communication stream on the backend's device, ordered against its
// compute stream. Refuses in a build without CUDA.
std::unique_ptr<CommStream> make_cuda_comm_stream(Backend* backend);

// "NCCL all_gather on rank 1/4": how every error of a device communicator names the operation.
std::string comm_op_name(const std::string& library, const char* op, int rank, int size);

class CommWatchdog {
   public:
    struct Hooks {
        std::function<std::string()> async_error;  // the library's asynchronous error ("" for none)
        std::function<void()> abort;               // ends the library's operations (so no rank hangs on them)
    };
    CommWatchdog(CommStream& stream, std::string library, int rank, int size, std::chrono::milliseconds timeout,
                 Hooks hooks);
    ~CommWatchdog();  // stops watching (what is still pending is the owner's to drain)
    CommWatchdog(const CommWatchdog&) = delete;
    CommWatchdog& operator=(const CommWatchdog&) = delete;

    // Watches operation `op`, issued at `issued`, until `done` completes.
    void track(const char* op, EventRef done, std::chrono::steady_clock::time_point issued);
    // Whether every tracked operation has completed (or failed on the device).
    bool idle();

   private:
    void watch();
    struct Pending {
        const char* op;
        EventRef done;
        std::chrono::steady_clock::time_point issued;
    };
    CommStream& stream_;
    std::string library_;
    int rank_, size_;
    std::chrono::milliseconds timeout_;
    Hooks hooks_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<Pending> pending_;
    bool stopping_ = false;
    std::thread thread_;
};

// A communicator that runs `host`'s collectives (host memory: the Gloo communicator) on device buffers by
// staging: each operation, in issue order on one worker thread, has the communication stream wait for the
// compute stream's work queued before the call, copies its input to pinned host memory, runs `host`'s
// collective there, and copies the result back on the communication stream. wait() blocks the host until
// the host collective is done (rethrowing its error) and makes the compute stream wait for the copy back,
// so the kernels queued between issue and wait overlap the collective. Stream order makes a collective see
// the result of the one before it on the same buffer, as NCCL's do. Host buffers go to `host` unstaged, in the
// same order. One pinned buffer, grown to the largest operation's input and output, is kept.
std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host,
                                                       std::unique_ptr<CommStream> stream, std::string library,
                                                       std::chrono::milliseconds timeout);

}  // namespace trainer
