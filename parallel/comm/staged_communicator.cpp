// The staged communicator (see comm_stream.h): a host communicator's collectives on device buffers, through
// pinned host memory on the communication stream.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

#include "base/common.h"
#include "base/trace.h"
#include "parallel/comm/comm_stream.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

class StagedCommunicator final : public Communicator {
   public:
    StagedCommunicator(std::unique_ptr<Communicator> host, std::unique_ptr<CommStream> stream, std::string library,
                       std::chrono::milliseconds timeout)
        : host_(std::move(host)),
          stream_(std::move(stream)),
          library_(std::move(library)),
          timeout_(timeout),
          watchdog_(*stream_, library_, host_->rank(), host_->size(), timeout, {}) {
        worker_ = std::thread([this] { run(); });
    }
    ~StagedCommunicator() override {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        worker_.join();
        // The last copies back may still read the staging buffer: wait for them (bounded), then free it.
        const auto deadline = Clock::now() + timeout_;
        while (!watchdog_.idle() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (staging_ != nullptr) stream_->free_pinned(staging_);
    }

    int rank() const override { return host_->rank(); }
    int size() const override { return host_->size(); }

    CommHandle all_reduce(void* buf, size_t count, CommDType dtype) override {
        const size_t bytes = count * comm_dtype_size(dtype);
        return submit("all_reduce", buf, buf, bytes, bytes, Result::kInPlace,
                      [=](void* in, void*) { return host_->all_reduce(in, count, dtype); });
    }
    CommHandle reduce_scatter(void* in, void* out, size_t count, CommDType dtype) override {
        const size_t bytes = count * comm_dtype_size(dtype);
        // The host collective runs in place on the staged input; this rank's block goes back.
        const size_t mine = static_cast<size_t>(rank()) * bytes;
        return submit(
            "reduce_scatter", in, out, bytes * size(), bytes, Result::kInPlace,
            [=](void* i, void* o) { return host_->reduce_scatter(i, o, count, dtype); }, mine);
    }
    CommHandle all_gather(const void* in, void* out, size_t count, CommDType dtype) override {
        const size_t bytes = count * comm_dtype_size(dtype);
        return submit("all_gather", in, out, bytes, bytes * size(), Result::kSeparate,
                      [=](void* i, void* o) { return host_->all_gather(i, o, count, dtype); });
    }
    CommHandle broadcast(void* buf, size_t count, CommDType dtype, int root) override {
        const size_t bytes = count * comm_dtype_size(dtype);
        return submit("broadcast", buf, buf, bytes, bytes, Result::kInPlace,
                      [=](void* in, void*) { return host_->broadcast(in, count, dtype, root); });
    }
    CommHandle barrier() override {
        return submit("barrier", nullptr, nullptr, 0, 0, Result::kInPlace,
                      [=](void*, void*) { return host_->barrier(); });
    }

   private:
    // Where the host collective leaves its result: in the staged input (at `result_offset`), or in a
    // staged output of its own.
    enum class Result { kInPlace, kSeparate };
    // The host collective on (input, output) host buffers.
    using HostOp = std::function<CommHandle(void*, void*)>;

    struct Task {
        const char* name;
        const void* in;
        void* out;
        size_t in_bytes, out_bytes, result_offset;
        Result result;
        bool staged;     // device buffers
        EventRef ready;  // the compute stream at the call
        HostOp op;
        std::promise<EventRef> done;  // the copy back's event (null: host buffers, nothing to wait for)
    };

    CommHandle submit(const char* name, const void* in, void* out, size_t in_bytes, size_t out_bytes, Result result,
                      HostOp op, size_t result_offset = 0) {
        auto task = std::make_shared<Task>();
        task->name = name;
        task->in = in;
        task->out = out;
        task->in_bytes = in_bytes;
        task->out_bytes = out_bytes;
        task->result_offset = result_offset;
        task->result = result;
        const bool in_host = in == nullptr || stream_->is_host(in), out_host = out == nullptr || stream_->is_host(out);
        TRAINER_CHECK(in_host == out_host, "{}: input and output must both be host or both device memory",
                      comm_op_name(library_, name, rank(), size()));
        task->staged = !in_host && in_bytes + out_bytes > 0;
        // After the compute queued so far: the event is recorded now, on the caller's thread.
        if (task->staged) task->ready = stream_->mark_compute();
        task->op = std::move(op);
        std::shared_future<EventRef> done = task->done.get_future().share();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(task);
        }
        cv_.notify_one();
        CommStream* stream = stream_.get();
        return CommHandle(std::function<void()>([done, stream] {
            const EventRef e = done.get();  // rethrows the collective's error
            if (e) stream->compute_waits_for(e);
        }));
    }

    void run() {
        stream_->bind_thread();
        if (trace::enabled()) trace::name_thread("staged " + library_);
        for (;;) {
            std::shared_ptr<Task> task;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;
                task = std::move(queue_.front());
                queue_.pop_front();
            }
            if (failed_) {
                task->done.set_exception(std::make_exception_ptr(
                    UserError(fmt::format("{}: not run, the communicator stopped at an earlier error",
                                          comm_op_name(library_, task->name, rank(), size())))));
                continue;
            }
            try {
                task->done.set_value(execute(*task));
            } catch (...) {
                failed_ = true;
                task->done.set_exception(std::current_exception());
            }
        }
    }

    EventRef execute(Task& t) {
        trace::Span span("comm", t.name, static_cast<int64_t>(std::max(t.in_bytes, t.out_bytes)));
        if (!t.staged) {
            t.op(const_cast<void*>(t.in), t.out).wait();
            return nullptr;
        }
        const size_t out_area = t.result == Result::kSeparate ? t.out_bytes : 0;
        uint8_t* host_in = stage(t.in_bytes + out_area);
        uint8_t* host_out = t.result == Result::kSeparate ? host_in + t.in_bytes : host_in + t.result_offset;
        // Down, after the compute queued before the call; the host waits for the copy, bounded by the timeout.
        stream_->wait_for(t.ready);
        if (t.in_bytes > 0) stream_->copy_to_host(host_in, t.in, t.in_bytes);
        wait_host(stream_->mark(), t.name);
        t.op(host_in, host_out).wait();
        // Up, on the communication stream; the handle's wait orders the compute stream after it.
        if (t.out_bytes > 0) stream_->copy_to_device(t.out, host_out, t.out_bytes);
        EventRef done = stream_->mark();
        watchdog_.track(t.name, done, Clock::now());  // the device's part from here; Gloo bounds its own
        return done;
    }

    // The pinned buffer, at least `bytes`. A larger one replaces it once the copies that read it are done.
    uint8_t* stage(size_t bytes) {
        if (bytes <= staging_bytes_) return staging_;
        wait_host(stream_->mark(), "staging");
        if (staging_ != nullptr) stream_->free_pinned(staging_);
        staging_ = nullptr;
        staging_bytes_ = 0;
        staging_ = static_cast<uint8_t*>(stream_->alloc_pinned(bytes));
        staging_bytes_ = bytes;
        return staging_;
    }

    // Blocks this thread until `e` is complete, polling so that a device error or the timeout ends it.
    void wait_host(const EventRef& e, const char* name) {
        const auto deadline = Clock::now() + timeout_;
        std::string error;
        while (!stream_->done(e, &error)) {
            if (!error.empty())
                user_error("{} failed: the device reported {}", comm_op_name(library_, name, rank(), size()), error);
            if (Clock::now() > deadline) {
                user_error(
                    "{}: the device did not finish the work queued before it within {:.0f} s "
                    "(distributed_timeout_seconds)",
                    comm_op_name(library_, name, rank(), size()), timeout_.count() / 1e3);
            }
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    }

    std::unique_ptr<Communicator> host_;
    std::unique_ptr<CommStream> stream_;
    std::string library_;
    std::chrono::milliseconds timeout_;
    CommWatchdog watchdog_;
    uint8_t* staging_ = nullptr;  // pinned; the worker's alone
    size_t staging_bytes_ = 0;
    bool failed_ = false;  // the worker's alone
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::shared_ptr<Task>> queue_;
    bool stopping_ = false;
    std::thread worker_;
};

}  // namespace

std::unique_ptr<Communicator> make_staged_communicator(std::unique_ptr<Communicator> host,
                                                       std::unique_ptr<CommStream> stream, std::string library,
                                                       std::chrono::milliseconds timeout) {
    return std::make_unique<StagedCommunicator>(std::move(host), std::move(stream), std::move(library), timeout);
}

}  // namespace trainer
