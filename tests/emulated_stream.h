// An emulated device for the CPU tests of the device communicators (parallel/comm_stream.h): the compute and
// communication streams are host threads, each running what is queued on it in order; an event is a flag
// its stream sets when it reaches it; "device memory" is host memory registered with the device, so is_host
// tells the two apart as cudaPointerGetAttributes does. Copies can be slowed (copy_delay), so that collectives
// are still in flight when the next is issued, and a device error can be injected.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/comm/comm_stream.h"

namespace test_util {

class EmulatedStream {
   public:
    EmulatedStream() : thread_([this] { run(); }) {}
    ~EmulatedStream() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        thread_.join();
    }
    void push(std::function<void()> work) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back(std::move(work));
        }
        cv_.notify_all();
    }
    // Blocks until everything queued so far has run.
    void synchronize() {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
    }

   private:
    void run() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;
            auto work = std::move(queue_.front());
            queue_.pop_front();
            busy_ = true;
            lock.unlock();
            work();
            lock.lock();
            busy_ = false;
            idle_.notify_all();
        }
    }
    std::mutex mutex_;
    std::condition_variable cv_, idle_;
    std::deque<std::function<void()>> queue_;
    bool stopping_ = false, busy_ = false;
    std::thread thread_;
};

struct EmulatedEvent final : trainer::StreamEvent {
    std::atomic<bool> fired{false};
    std::string error;  // the device's error when it was marked: it never completes
};

class EmulatedDevice {
   public:
    EmulatedStream compute, comm;
    std::chrono::microseconds copy_delay{0};
    std::atomic<int> copies_down{0}, copies_up{0}, compute_waits{0};
    std::atomic<long> pinned_live{0}, pinned_allocs{0};
    std::string error;  // set before a call: the events marked from then on fail with it

    // Marks [p, p + bytes) as device memory.
    void register_memory(const void* p, size_t bytes) {
        std::lock_guard<std::mutex> lock(mutex_);
        ranges_[static_cast<const char*>(p)] = bytes;
    }
    bool is_device(const void* p) {
        std::lock_guard<std::mutex> lock(mutex_);
        const char* c = static_cast<const char*>(p);
        auto it = ranges_.upper_bound(c);
        if (it == ranges_.begin()) return false;
        --it;
        return c < it->first + it->second;
    }
    // A "kernel" on the compute stream.
    void launch(std::function<void()> kernel) { compute.push(std::move(kernel)); }

   private:
    std::mutex mutex_;
    std::map<const char*, size_t> ranges_;
};

class EmulatedCommStream final : public trainer::CommStream {
   public:
    explicit EmulatedCommStream(EmulatedDevice& d) : d_(d) {}
    // The device finishes what was queued on the stream, as a GPU does after cudaStreamDestroy.
    ~EmulatedCommStream() override { d_.comm.synchronize(); }
    trainer::EventRef mark_compute() override { return mark_on(d_.compute, d_.error); }
    trainer::EventRef mark() override { return mark_on(d_.comm, d_.error); }
    void wait_for(const trainer::EventRef& e) override { d_.comm.push(waiter(e)); }
    void compute_waits_for(const trainer::EventRef& e) override {
        ++d_.compute_waits;
        d_.compute.push(waiter(e));
    }
    void copy_to_host(void* host, const void* device, size_t bytes) override {
        d_.comm.push([&d = d_, host, device, bytes] {  // the device's, not this object's: it may be gone
            std::this_thread::sleep_for(d.copy_delay);
            std::memcpy(host, device, bytes);
            ++d.copies_down;
        });
    }
    void copy_to_device(void* device, const void* host, size_t bytes) override {
        d_.comm.push([&d = d_, host, device, bytes] {
            std::this_thread::sleep_for(d.copy_delay);
            std::memcpy(device, host, bytes);
            ++d.copies_up;
        });
    }
    bool done(const trainer::EventRef& e, std::string* error) override {
        const auto& ev = static_cast<const EmulatedEvent&>(*e);
        if (!ev.error.empty()) {
            *error = ev.error;
            return false;
        }
        return ev.fired.load();
    }
    bool is_host(const void* p) const override { return !d_.is_device(p); }
    void* alloc_pinned(size_t bytes) override {
        d_.pinned_live += static_cast<long>(bytes);
        ++d_.pinned_allocs;
        void* p = ::operator new(bytes);
        sizes_[p] = bytes;
        return p;
    }
    void free_pinned(void* p) override {
        d_.comm.synchronize();  // as cudaFreeHost waits for the device: no queued copy writes freed memory
        d_.pinned_live -= static_cast<long>(sizes_.at(p));
        sizes_.erase(p);
        ::operator delete(p);
    }

   private:
    static trainer::EventRef mark_on(EmulatedStream& s, const std::string& error) {
        auto e = std::make_shared<EmulatedEvent>();
        e->error = error;
        s.push([e] { e->fired = true; });
        return e;
    }
    static std::function<void()> waiter(const trainer::EventRef& e) {
        auto ev = std::static_pointer_cast<EmulatedEvent>(e);
        return [ev] {
            while (!ev->fired) std::this_thread::sleep_for(std::chrono::microseconds(20));
        };
    }
    EmulatedDevice& d_;
    std::map<void*, size_t> sizes_;  // the staged communicator's worker alone allocates and frees
};

}  // namespace test_util
