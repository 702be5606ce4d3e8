// The NCCL communicator: the Communicator seam over NCCL on the GPU of the CUDA backend.
//
// Ordering. Each collective is queued on the communicator's own stream after an event recorded on the
// compute stream at the call (so it sees every kernel queued before it), and records a "done" event;
// CommHandle::wait() makes the compute stream wait on that event. Nothing blocks the host, so gathers
// and reductions overlap with the compute queued between issue and wait. Host buffers (a scalar norm, the
// memory report) are staged through the device and complete before the call returns.
//
// Failure. The communicator is created non-blocking, so initialisation and every call can be bounded. A
// watchdog thread polls the pending operations' events and NCCL's asynchronous error: when an operation
// outlasts the timeout, or NCCL reports an error (a peer died, a network failure), it prints which
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
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/timeline.h"
#include "parallel/communicator.h"
#include "parallel/tcp_store.h"

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

// An event shared by the handle that waits on it and the watchdog that polls it.
struct Event {
    cudaEvent_t e = nullptr;
    Event() { TRAINER_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
    ~Event() { cudaEventDestroy(e); }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
};

class NcclCommunicator final : public Communicator {
   public:
    NcclCommunicator(TcpStore& store, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout,
                     Backend* backend)
        : rank_(rank),
          size_(size),
          device_(cuda::backend_device(backend)),
          timeout_(timeout),
          compute_(cuda::backend_stream(backend)),
          timeline_(&cuda::backend_timeline(backend)),
          track_("nccl " + prefix) {
        TRAINER_CUDA_CHECK(cudaSetDevice(device_));
        TRAINER_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority_high()));
        ncclUniqueId id{};
        const std::string key = prefix + "/nccl_unique_id";
        if (rank == 0) {
            check(ncclGetUniqueId(&id), "ncclGetUniqueId");
            store.set(key, std::vector<char>(id.internal, id.internal + sizeof id.internal));
        } else {
            const std::vector<char> bytes = store.get(key);  // bounded by the store's timeout
            TRAINER_CHECK(bytes.size() == sizeof id.internal, "NCCL unique id of {} bytes under {}", bytes.size(), key);
            std::copy(bytes.begin(), bytes.end(), id.internal);
        }
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;  // every call returns at once; completion is polled with a deadline
        check(ncclCommInitRankConfig(&comm_, size, id, rank, &config), "ncclCommInitRankConfig");
        wait_ready("ncclCommInitRankConfig (a rank that never joins holds up the others)");
        watchdog_ = std::thread([this] { watch(); });
    }
    ~NcclCommunicator() override {
        // Collectives still queued (a rank leaving on an error while its peers are gone) could spin for
        // ever: wait for the stream at most the timeout, then abort them.
        const auto drain_deadline = Clock::now() + timeout_;
        while (cudaStreamQuery(stream_) == cudaErrorNotReady && Clock::now() < drain_deadline)
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
            if (comm_ != nullptr && cudaStreamQuery(stream_) == cudaErrorNotReady) {
                ncclCommAbort(comm_);
                comm_ = nullptr;
            }
        }
        cv_.notify_all();
        if (watchdog_.joinable()) watchdog_.join();
        cudaStreamSynchronize(stream_);
        if (comm_ != nullptr) {
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
        cudaStreamDestroy(stream_);
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
    static int priority_high() {
        int least = 0, greatest = 0;
        cudaDeviceGetStreamPriorityRange(&least, &greatest);
        return greatest;  // collectives first: compute waits on them, not the other way round
    }

    // Fails with the NCCL error, its last message and this rank.
    void check(ncclResult_t r, const char* what) {
        if (r == ncclSuccess || r == ncclInProgress) return;
        user_error("NCCL {} failed on rank {}/{}: {} ({})", what, rank_, size_, ncclGetErrorString(r),
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
                user_error("NCCL {} on rank {}/{} timed out after {:.0f} s (distributed_timeout_seconds)", what, rank_,
                           size_, timeout_.count() / 1e3);
            }
            std::this_thread::yield();
        }
        check(st, what);
    }

    template <typename Op>
    CommHandle run(const char* name, const void* in, void* out, size_t in_count, size_t out_count, CommDType dtype,
                   Op op) {
        if (failed_.load()) user_error("NCCL communicator on rank {}/{} was aborted after an error", rank_, size_);
        const bool in_host = cuda::is_host_pointer(in), out_host = cuda::is_host_pointer(out);
        TRAINER_CHECK(in_host == out_host, "NCCL {}: input and output must both be host or both device memory", name);
        const size_t esize = comm_dtype_size(dtype);
        if (in_host) return run_staged(name, in, out, in_count * esize, out_count * esize, op);
        // Device buffers: after the compute queued so far, on the communication stream.
        auto ready = std::make_shared<Event>();
        TRAINER_CUDA_CHECK(cudaEventRecord(ready->e, compute_));
        TRAINER_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready->e, 0));
        // The collective's extent on this stream for a recorded trace, the compute stream's wait for it for
        // the step's wait time (kernels/cuda/timeline.h).
        cudaEvent_t began = timeline_->begin(stream_, cuda::Timeline::Kind::kComm);
        auto done = enqueue(name, op, in, out);
        timeline_->end(began, stream_, cuda::Timeline::Kind::kComm, "comm", name,
                       static_cast<int64_t>(std::max(in_count, out_count) * esize), track_);
        cudaStream_t compute = compute_;
        cuda::Timeline* timeline = timeline_;
        return CommHandle(std::function<void()>([this, done, compute, timeline, name] {
            if (failed_.load()) user_error("NCCL {} on rank {}/{} failed (see above)", name, rank_, size_);
            cudaEvent_t waited = timeline->begin(compute, cuda::Timeline::Kind::kWait);
            TRAINER_CUDA_CHECK(cudaStreamWaitEvent(compute, done->e, 0));
            timeline->end(waited, compute, cuda::Timeline::Kind::kWait);
        }));
    }

    // Host buffers: copied to the device, reduced there, copied back; complete on return.
    template <typename Op>
    CommHandle run_staged(const char* name, const void* in, void* out, size_t in_bytes, size_t out_bytes, Op op) {
        // In-place operations (all_reduce, broadcast) stage one buffer; the others an input and an output.
        const bool in_place = in == out;
        void *din = nullptr, *dout = nullptr;
        TRAINER_CUDA_CHECK(cudaMallocAsync(&din, std::max<size_t>(in_bytes, 16), stream_));
        dout = din;
        if (!in_place) TRAINER_CUDA_CHECK(cudaMallocAsync(&dout, std::max<size_t>(out_bytes, 16), stream_));
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(din, in, in_bytes, cudaMemcpyHostToDevice, stream_));
        auto done = enqueue(name, op, din, dout);
        // Poll, so the watchdog's abort (timeout, dead peer) ends the wait.
        while (cudaEventQuery(done->e) == cudaErrorNotReady) {
            if (failed_.load()) user_error("NCCL {} on rank {}/{} failed (see above)", name, rank_, size_);
            std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        TRAINER_CUDA_CHECK(cudaMemcpyAsync(out, dout, out_bytes, cudaMemcpyDeviceToHost, stream_));
        TRAINER_CUDA_CHECK(cudaFreeAsync(din, stream_));
        if (!in_place) TRAINER_CUDA_CHECK(cudaFreeAsync(dout, stream_));
        TRAINER_CUDA_CHECK(cudaStreamSynchronize(stream_));
        return CommHandle();
    }

    // Queues op(in, out) on the communication stream and returns its completion event, which the watchdog
    // tracks from now on.
    template <typename Op>
    std::shared_ptr<Event> enqueue(const char* name, Op& op, const void* in, void* out) {
        check(op(in, out, stream_), name);
        wait_ready(name);
        auto done = std::make_shared<Event>();
        TRAINER_CUDA_CHECK(cudaEventRecord(done->e, stream_));
        std::lock_guard<std::mutex> lock(mutex_);
        pending_.push_back({name, done, Clock::now()});
        return done;
    }

    // The watchdog: retires finished operations; on a timeout or an asynchronous NCCL error, reports,
    // aborts the communicator and ends the process.
    void watch() {
        // A new thread starts on device 0: without this, its first CUDA call would open a context on GPU 0
        // for every rank of the node.
        if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
        std::unique_lock<std::mutex> lock(mutex_);
        while (!stopping_) {
            cv_.wait_for(lock, std::chrono::milliseconds(100));
            if (comm_ == nullptr) return;  // aborted by a timed-out call, which reports it
            cudaError_t query = cudaSuccess;
            while (!pending_.empty() && (query = cudaEventQuery(pending_.front().done->e)) == cudaSuccess)
                pending_.pop_front();
            std::string why;
            ncclResult_t st = ncclSuccess;
            if (query != cudaSuccess && query != cudaErrorNotReady) {
                // A sticky device error (a faulting kernel) is not a late peer: report it as it is.
                why = fmt::format("could not complete: the device reported {}", cudaGetErrorString(query));
            } else if (ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st != ncclSuccess && st != ncclInProgress) {
                why = fmt::format("failed: {} ({}); a peer rank probably died", ncclGetErrorString(st),
                                  ncclGetLastError(comm_));
            } else if (!pending_.empty() && Clock::now() - pending_.front().issued > timeout_) {
                why = fmt::format(
                    "timed out after {:.0f} s (distributed_timeout_seconds); a peer rank probably died "
                    "or stopped issuing collectives",
                    timeout_.count() / 1e3);
            }
            if (why.empty()) continue;
            const char* op = pending_.empty() ? "communicator" : pending_.front().name;
            std::fprintf(stderr, "error: NCCL %s on rank %d/%d %s; aborting the communicator\n", op, rank_, size_,
                         why.c_str());
            std::fflush(stderr);
            failed_.store(true);
            ncclCommAbort(comm_);
            std::_Exit(1);  // the main thread may be blocked on the device; the launcher reports this rank
        }
    }

    struct Pending {
        const char* name;
        std::shared_ptr<Event> done;
        Clock::time_point issued;
    };

    int rank_, size_, device_;
    std::chrono::milliseconds timeout_;
    cudaStream_t compute_ = nullptr, stream_ = nullptr;
    cuda::Timeline* timeline_;
    std::string track_;  // its collectives' track in a trace
    ncclComm_t comm_ = nullptr;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<Pending> pending_;
    bool stopping_ = false;
    std::atomic<bool> failed_{false};
    std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout, Backend* backend) {
    if (backend == nullptr || backend->name() != "cuda") {
        user_error("distributed_backend \"nccl\" needs --device cuda (NCCL moves GPU memory); use gloo on the CPU");
    }
    return std::make_unique<NcclCommunicator>(store, prefix, rank, size, timeout, backend);
}

}  // namespace trainer
