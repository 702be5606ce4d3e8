// The NCCL communicator: the Communicator seam over NCCL on the GPU of the CUDA backend.
//
// Ordering. Each collective is queued on the communicator's own stream after an event recorded on the
// compute stream at the call (so it sees every kernel queued before it), and records a "done" event;
// CommHandle::wait() makes the compute stream wait on that event. Nothing blocks the host, so gathers
// and reductions overlap with the compute queued between issue and wait. Host buffers (a scalar norm, the
// memory report) are staged through the device and complete before the call returns.
//
// The stream, its events and the compute stream's waits are CudaCommStream's, shared with staged Gloo; only the
// NCCL calls are here.
//
// Failure. The communicator is created non-blocking, so initialisation and every call can be bounded. The
// shared watchdog (comm_stream.h) polls the pending operations' events and NCCL's asynchronous error: when an
// operation outlasts the timeout, or NCCL reports an error (a peer died, a network failure), it prints which
// operation on which rank, aborts the communicator (which ends its kernels, so no rank hangs on it) and
// ends the process with exit code 1, as PyTorch's NCCL watchdog does; the launcher then names the rank.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/common.h"
#include "kernels/backend.h"
#include "kernels/cuda/common.cuh"
#include "parallel/comm/communicator.h"
#include "parallel/comm/cuda_comm_stream.h"
#include "parallel/launch/tcp_store.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(CommDType t) {
    switch (t) {
        case CommDType::kFloat32:
            return ncclFloat32;
        case CommDType::kBFloat16:
            return ncclBfloat16;
        case CommDType::kFloat64:
            return ncclFloat64;
    }
    return ncclFloat32;
}

class NcclCommunicator final : public Communicator {
   public:
    NcclCommunicator(TcpStore& store, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout,
                     Backend* backend)
        : rank_(rank), size_(size), timeout_(timeout), stream_(backend, "nccl " + prefix) {
        ncclUniqueId id{};
        const std::string key = prefix + "/nccl_unique_id";
        if (rank == 0) {
            check(ncclGetUniqueId(&id), "ncclGetUniqueId");
            store.set(key, std::vector<char>(id.internal, id.internal + sizeof id.internal));
        } else {
            const std::vector<char> bytes = store.get(key);  // bounded by the store's timeout
            if (bytes.size() != sizeof id.internal) {
                user_error(
                    "rendezvous store {}: key {} holds {} bytes, not the {} of an NCCL unique id; is another "
                    "job using this MASTER_ADDR and MASTER_PORT with the same secret?",
                    store.address(), key, bytes.size(), sizeof id.internal);
            }
            std::copy(bytes.begin(), bytes.end(), id.internal);
        }
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;  // every call returns at once; completion is polled with a deadline
        check(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig");
        wait_ready("ncclCommInitRankConfig (a rank that never joins holds up the others)");
        CommWatchdog::Hooks hooks;
        hooks.async_error = [this]() -> std::string {
            std::lock_guard<std::mutex> lock(mutex_);
            ncclResult_t st = ncclSuccess;
            if (comm_ == nullptr || ncclCommGetAsyncError(comm_, &st) != ncclSuccess || st == ncclSuccess ||
                st == ncclInProgress)
                return "";
            return fmt::format("{} ({})", ncclGetErrorString(st), ncclGetLastError(comm_));
        };
        hooks.abort = [this] {
            failed_.store(true);
            std::lock_guard<std::mutex> lock(mutex_);
            if (comm_ != nullptr) ncclCommAbort(comm_);
            comm_ = nullptr;
        };
        watchdog_ = std::make_unique<CommWatchdog>(stream_, "NCCL", rank, size, timeout, std::move(hooks));
    }
    ~NcclCommunicator() override {
        // Collectives still queued (a rank leaving on an error while its peers are gone) could spin for
        // ever: wait for the stream at most the timeout, then abort them.
        const bool drained = stream_.drain(timeout_);
        watchdog_.reset();
        std::lock_guard<std::mutex> lock(mutex_);
        if (comm_ == nullptr) return;
        if (!drained) {
            ncclCommAbort(comm_);
            return;
        }
        ncclCommFinalize(comm_);
        ncclResult_t st = ncclInProgress;
        const auto deadline = Clock::now() + timeout_;
        while (ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st == ncclInProgress && Clock::now() < deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (st == ncclSuccess)
            ncclCommDestroy(comm_);
        else
            ncclCommAbort(comm_);
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    CommHandle all_reduce(void* buf, size_t count, CommDType dtype) override {
        return run("all_reduce", buf, buf, count, count, dtype, [&](const void* in, void* out, cudaStream_t s) {
            return ncclAllReduce(in, out, count, nccl_type(dtype), ncclSum, comm_, s);
        });
    }
    CommHandle reduce_scatter(void* in, void* out, size_t count, CommDType dtype) override {
        return run("reduce_scatter", in, out, count * size_, count, dtype, [&](const void* i, void* o, cudaStream_t s) {
            return ncclReduceScatter(i, o, count, nccl_type(dtype), ncclSum, comm_, s);
        });
    }
    CommHandle all_gather(const void* in, void* out, size_t count, CommDType dtype) override {
        return run("all_gather", in, out, count, count * size_, dtype, [&](const void* i, void* o, cudaStream_t s) {
            return ncclAllGather(i, o, count, nccl_type(dtype), comm_, s);
        });
    }
    CommHandle broadcast(void* buf, size_t count, CommDType dtype, int root) override {
        return run("broadcast", buf, buf, count, count, dtype, [&](const void* i, void* o, cudaStream_t s) {
            return ncclBroadcast(i, o, count, nccl_type(dtype), root, comm_, s);
        });
    }
    // A host barrier: a one-element all-reduce the host waits for.
    CommHandle barrier() override {
        float one = 1.0f;
        return all_reduce(&one, 1, CommDType::kFloat32);  // a host buffer: staged, complete on return
    }

   private:
    std::string op_name(const char* op) const { return comm_op_name("NCCL", op, rank_, size_); }

    // Fails with the NCCL error, its last message and this rank. Not TRAINER_CUDA_CHECK's internal error: a
    // collective fails where a peer or the network does, a failure of the run's world, as Gloo's are.
    void check(ncclResult_t r, const char* what) {
        if (r == ncclSuccess || r == ncclInProgress) return;
        user_error("{} failed: {} ({})", op_name(what), ncclGetErrorString(r),
                   comm_ != nullptr ? ncclGetLastError(comm_) : "");
    }
    // In non-blocking mode a call may still be in progress when it returns; the next call must wait.
    void wait_ready(const char* what) {
        const auto deadline = Clock::now() + timeout_;
        ncclResult_t st = ncclInProgress;
        while (true) {
            check(ncclCommGetAsyncError(comm_, &st), what);
            if (st != ncclInProgress) break;
            if (Clock::now() > deadline) {
                {
                    std::lock_guard<std::mutex> lock(mutex_);  // the watchdog reads comm_ under it
                    failed_.store(true);
                    ncclCommAbort(comm_);
                    comm_ = nullptr;
                }
                user_error("{} timed out after {:.0f} s (distributed_timeout_seconds)", op_name(what),
                           timeout_.count() / 1e3);
            }
            std::this_thread::yield();
        }
        check(st, what);
    }

    template <typename Op>
    CommHandle run(const char* name, const void* in, void* out, size_t in_count, size_t out_count, CommDType dtype,
                   Op op) {
        if (failed_.load()) user_error("{}: the communicator was aborted after an error", op_name(name));
        const bool in_host = stream_.is_host(in), out_host = stream_.is_host(out);
        TRAINER_CHECK(in_host == out_host, "{}: input and output must both be host or both device memory",
                      op_name(name));
        const size_t esize = comm_dtype_size(dtype);
        if (in_host) return run_staged(name, in, out, in_count * esize, out_count * esize, op);
        // Device buffers: after the compute queued so far, on the communication stream.
        stream_.wait_for(stream_.mark_compute());
        // The collective's extent on this stream for a recorded trace (kernels/cuda/timeline.h).
        cudaEvent_t began = stream_.comm_begin();
        EventRef done = enqueue(name, op, in, out);
        stream_.comm_end(began, name, static_cast<int64_t>(std::max(in_count, out_count) * esize));
        CudaCommStream* stream = &stream_;
        return CommHandle(std::function<void()>([this, done, stream, name] {
            if (failed_.load()) user_error("{} failed (see above)", op_name(name));
            stream->compute_waits_for(done);
        }));
    }

    // Host buffers: copied to the device, reduced there, copied back; complete on return.
    template <typename Op>
    CommHandle run_staged(const char* name, const void* in, void* out, size_t in_bytes, size_t out_bytes, Op op) {
        // In-place operations (all_reduce, broadcast) stage one buffer; the others an input and an output.
        const bool in_place = in == out;
        const cudaStream_t s = stream_.stream();
        void *din = nullptr, *dout = nullptr;
        TRAINER_CUDA_CHECK(cudaMallocAsync(&din, std::max<size_t>(in_bytes, 16), s));
        dout = din;
        if (!in_place) TRAINER_CUDA_CHECK(cudaMallocAsync(&dout, std::max<size_t>(out_bytes, 16), s));
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(din, in, in_bytes, cudaMemcpyHostToDevice, s));
        EventRef done = enqueue(name, op, din, dout);
        // Poll, so the watchdog's abort (timeout, dead peer) ends the wait.
        std::string error;
        while (!stream_.done(done, &error)) {
            if (failed_.load() || !error.empty()) user_error("{} failed (see above)", op_name(name));
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(out, dout, out_bytes, cudaMemcpyDeviceToHost, s));
        TRAINER_CUDA_CHECK(cudaFreeAsync(din, s));
        if (!in_place) TRAINER_CUDA_CHECK(cudaFreeAsync(dout, s));
        TRAINER_CUDA_CHECK(cudaStreamSynchronize(s));
        return CommHandle();
    }

    // Queues op(in, out) on the communication stream and returns its completion event, which the watchdog
    // tracks from now on.
    template <typename Op>
    EventRef enqueue(const char* name, Op& op, const void* in, void* out) {
        check(op(in, out, stream_.stream()), name);
        wait_ready(name);
        EventRef done = stream_.mark();
        watchdog_->track(name, done, Clock::now());
        return done;
    }

    int rank_, size_;
    std::chrono::milliseconds timeout_;
    CudaCommStream stream_;
    ncclComm_t comm_ = nullptr;
    std::mutex mutex_;  // comm_ against the watchdog's abort
    std::atomic<bool> failed_{false};
    std::unique_ptr<CommWatchdog> watchdog_;
};

}  // namespace

std::string nccl_library_version() {
#ifdef TRAINER_SIMT_DEVICE
    return "NCCL: none; an emulated build (one rank a communicator, tests/simt)";
#endif
    int v = 0;
    const std::string loaded = ncclGetVersion(&v) == ncclSuccess
                                   ? fmt::format("{}.{}.{}", v / 10000, v % 10000 / 100, v % 100)
                                   : std::string("not found");
    return fmt::format("NCCL: built with {}.{}.{}; loaded {}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, loaded);
}

std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout, Backend* backend) {
    if (backend == nullptr || backend->name() != "cuda") {
        user_error("distributed_backend \"nccl\" needs --device cuda (NCCL moves GPU memory); use gloo on the CPU");
    }
    return std::make_unique<NcclCommunicator>(store, prefix, rank, size, timeout, backend);
}

}  // namespace trainer
