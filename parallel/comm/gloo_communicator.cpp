// The Gloo communicator (see communicator.h): Gloo's TCP transport and its collective algorithms
// (allreduce, broadcast, barrier) plus a ring reduce-scatter and a ring all-gather of our own over its
// point-to-point buffers, driven by one worker thread per communicator that runs the queued operations in FIFO order.
// bf16 travels as 16-bit words on the wire and is summed in fp32 (the element functions of
// kernels/element.h), rounded back to bf16 after each add.
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "base/common.h"
#include "base/memory.h"
#include "base/trace.h"
#include "kernels/backend.h"
#include "kernels/element.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/rank_env.h"
#include "parallel/launch/tcp_store.h"

namespace trainer {
namespace {

// The slot prefix of the ring reduce-scatter's point-to-point messages, apart from Gloo's own (0x01..0x08).
constexpr uint8_t kRingSlotPrefix = 0x20;

void bf16_sum3(void* c, const void* a, const void* b, size_t n) {
    uint16_t* out = static_cast<uint16_t*>(c);
    const uint16_t* x = static_cast<const uint16_t*>(a);
    const uint16_t* y = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) out[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

class GlooCommunicator final : public Communicator {
   public:
    GlooCommunicator(TcpStore& store, const std::string& prefix, int rank, int size, std::chrono::milliseconds timeout,
                     const std::string& bind_host)
        : rank_(rank), size_(size), timeout_(timeout), prefix_(prefix) {
        gloo::transport::tcp::attr attr;
        attr.ai_family = AF_INET;
        try {
            attr.hostname = bind_host;
            device_ = gloo::transport::tcp::CreateDevice(attr);
            context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
            context_->setTimeout(timeout);
            gloo::rendezvous::PrefixStore prefixed(prefix, store);
            // Where this rank listens, for the other ranks' errors (published before the barrier, so read after it).
            const std::string host = host_name(), where = (host.empty() ? "" : host + " ") + bind_host;
            store.set(fmt::format("{}/where/{}", prefix, rank), std::vector<char>(where.begin(), where.end()));
            rendezvous_barrier(store, prefix, rank, size);
            context_->connectFullMesh(prefixed, device_);
            read_peers(store);
        } catch (const gloo::Exception& e) {
            user_error("communicator {} rank {}/{}: connecting the full mesh through {} failed: {}", prefix, rank, size,
                       store.address(), e.what());
        }
        worker_ = std::thread([this] { run(); });
        if (size_ > 1) {
            // Its own connection, answering within 2 s or failing: a call to a store out of reach (a link down)
            // must neither hold up the error of a failed op nor wait behind another call. After a failure the
            // next call connects again, so reports go on once a link that was down is back.
            progress_store_ = store.another_connection();
            progress_store_->set_io_timeout(std::chrono::milliseconds(2000));
            progress_store_->set_reconnect(true);
            publisher_ = std::thread([this] { publish_progress(); });
        }
    }

    ~GlooCommunicator() override {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        cv_.notify_all();
        publish_cv_.notify_all();
        worker_.join();
        if (publisher_.joinable()) publisher_.join();
        memory_record_free(MemCategory::kCommunication, static_cast<int64_t>(scratch_bytes_));
    }

    int rank() const override { return rank_; }
    int size() const override { return size_; }

    CommHandle all_reduce(void* buf, size_t count, CommDType dtype) override {
        return enqueue("all_reduce", count * comm_dtype_size(dtype), [=] {
            if (size_ == 1 || count == 0) return;
            gloo::AllreduceOptions opts(context_);
            opts.setTag(next_tag());
            opts.setTimeout(timeout_);
            using Fn = void (*)(void*, const void*, const void*, size_t);
            if (dtype == CommDType::kFloat32) {
                opts.setOutput(static_cast<float*>(buf), count);
                opts.setReduceFunction(static_cast<Fn>(&gloo::sum<float>));
            } else if (dtype == CommDType::kFloat64) {
                opts.setOutput(static_cast<double*>(buf), count);
                opts.setReduceFunction(static_cast<Fn>(&gloo::sum<double>));
            } else {
                opts.setOutput(static_cast<uint16_t*>(buf), count);
                opts.setReduceFunction(&bf16_sum3);
            }
            gloo::allreduce(opts);
        });
    }

    CommHandle reduce_scatter(void* in, void* out, size_t count, CommDType dtype) override {
        TRAINER_CHECK(dtype != CommDType::kFloat64, "reduce_scatter carries fp32 or bf16");
        return enqueue("reduce_scatter", count * comm_dtype_size(dtype), [=] {
            const size_t bytes = count * comm_dtype_size(dtype);
            if (size_ == 1 || count == 0) {
                std::memmove(out, in, bytes);
                return;
            }
            // A ring over Gloo's point-to-point buffers, n - 1 steps: at step s this rank sends its partial sum of
            // chunk (r - s - 1) mod n to rank r + 1, receives rank r - 1's partial of chunk (r - s - 2) mod n and
            // adds it into its own, in place in `in` (the contract makes `in` scratch). The last chunk received
            // is this rank's, complete. Each chunk is summed in one fixed order (x_{c+1} + x_{c+2} + ... + x_c),
            // so results repeat bit for bit; the receive buffer is one shard, where an all-to-all needs the
            // whole unit (98 MiB for cpu_bench's embedding). bf16 partial sums travel as bf16, rounded at each
            // hop, as in NCCL's ring. (Gloo's own ReduceScatterHalvingDoubling gave run-to-run different
            // results when other collectives ran between its calls.)
            uint8_t* tmp = scratch(gloo_reduce_scatter_scratch_bytes(count, dtype, size_));
            auto* base = static_cast<uint8_t*>(in);
            auto send_buf = context_->createUnboundBuffer(base, bytes * size_);
            auto recv_buf = context_->createUnboundBuffer(tmp, bytes);
            ring(
                *send_buf, *recv_buf, bytes, 1, [](int) { return size_t{0}; },
                [&](int step) {
                    uint8_t* acc = base + static_cast<size_t>(chunk(step + 2)) * bytes;
                    if (dtype == CommDType::kFloat32) {
                        float* a = reinterpret_cast<float*>(acc);
                        const float* b = reinterpret_cast<const float*>(tmp);
                        for (size_t i = 0; i < count; ++i) a[i] = b[i] + a[i];
                    } else {
                        uint16_t* a = reinterpret_cast<uint16_t*>(acc);
                        const uint16_t* b = reinterpret_cast<const uint16_t*>(tmp);
                        for (size_t i = 0; i < count; ++i)
                            a[i] = float_to_bf16(bf16_to_float(b[i]) + bf16_to_float(a[i]));
                    }
                });
            if (out != base + static_cast<size_t>(rank_) * bytes)  // else in place: already there
                std::memcpy(out, base + static_cast<size_t>(rank_) * bytes, bytes);
        });
    }

    CommHandle all_gather(const void* in, void* out, size_t count, CommDType dtype) override {
        return enqueue("all_gather", count * comm_dtype_size(dtype), [=] {
            const size_t bytes = count * comm_dtype_size(dtype);
            if (size_ == 1 || count == 0) {
                std::memmove(out, in, bytes);
                return;
            }
            // The reduce-scatter's ring (Gloo's own allgather posts each step's send before its receive: 1.6x the
            // time on a slow link where the ranks arrive apart). At step s this rank sends chunk (r - s) mod n to
            // rank r + 1 and receives chunk (r - s - 1) mod n from rank r - 1, in place in `out`. Bytes are bytes,
            // whatever the element type.
            auto* base = static_cast<uint8_t*>(out);
            if (in != base + static_cast<size_t>(rank_) * bytes)
                std::memcpy(base + static_cast<size_t>(rank_) * bytes, in, bytes);
            auto buf = context_->createUnboundBuffer(base, bytes * size_);
            ring(
                *buf, *buf, bytes, 0, [&](int step) { return static_cast<size_t>(chunk(step + 1)) * bytes; },
                [](int) {});
        });
    }

    CommHandle broadcast(void* buf, size_t count, CommDType dtype, int root) override {
        TRAINER_CHECK(root >= 0 && root < size_, "broadcast root {} outside [0, {})", root, size_);
        return enqueue("broadcast", count * comm_dtype_size(dtype), [=] {
            if (size_ == 1 || count == 0) return;
            gloo::BroadcastOptions opts(context_);
            opts.setTag(next_tag());
            opts.setTimeout(timeout_);
            opts.setRoot(root);
            opts.setOutput(static_cast<uint8_t*>(buf), count * comm_dtype_size(dtype));
            gloo::broadcast(opts);
        });
    }

    CommHandle barrier() override {
        return enqueue("barrier", 0, [=] {
            if (size_ == 1) return;
            gloo::BarrierOptions opts(context_);
            opts.setTag(next_tag());
            opts.setTimeout(timeout_);
            gloo::barrier(opts);
        });
    }

   private:
    // Chunk (r - shift) mod n of a ring step.
    int chunk(int shift) const { return ((rank_ - shift) % size_ + size_) % size_; }

    // The ring of the reduce-scatter and the all-gather, n - 1 steps over Gloo's point-to-point buffers: at step s
    // this rank sends chunk (r - s - send_shift) mod n of `sent` (chunks of `bytes`) to rank r + 1, receives rank
    // r - 1's into `received` at recv_offset(s), and runs on_received(s) before its send is waited for (the next
    // step sends what this one received). The receive is posted first: Gloo writes a send whose receive is
    // already posted from the calling thread, until it is on the wire, so a rank that came late and sent first
    // would tell its peer that it may send only after its own send had crossed the link (measured: twice the time
    // of one send, on a 40 Mbit/s link where one rank reached the op 0.2 s after the other).
    template <typename RecvOffset, typename OnReceived>
    void ring(gloo::transport::UnboundBuffer& sent, gloo::transport::UnboundBuffer& received, size_t bytes,
              int send_shift, RecvOffset recv_offset, OnReceived on_received) {
        const uint64_t slot = gloo::Slot::build(kRingSlotPrefix, next_tag());
        const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
        for (int step = 0; step < size_ - 1; ++step) {
            received.recv(left, slot, recv_offset(step), bytes);
            sent.send(right, slot, static_cast<size_t>(chunk(step + send_shift)) * bytes, bytes);
            received.waitRecv(timeout_);
            on_received(step);
            sent.waitSend(timeout_);
        }
    }

    uint8_t* scratch(size_t bytes) {
        if (bytes > scratch_bytes_) {
            scratch_.reset(new uint8_t[bytes]);  // uninitialised: the all-to-all writes every byte
            memory_record_alloc(MemCategory::kCommunication, static_cast<int64_t>(bytes - scratch_bytes_));
            scratch_bytes_ = bytes;
        }
        return scratch_.get();
    }
    uint32_t next_tag() { return tag_++; }

    // The text naming this rank's peers and where they listen, for the errors of its collectives: every peer in a
    // group of up to 9 ranks, else the 8 nearest in rank order (a ring's neighbours first), read once now, since
    // the store may be out of reach when a collective fails.
    void read_peers(TcpStore& store) {
        std::vector<int> order;
        for (int d = 1; d < size_ && order.size() < 8; ++d) {
            for (const int peer : {(rank_ + d) % size_, (rank_ - d + size_) % size_}) {
                if (order.size() < 8 && std::find(order.begin(), order.end(), peer) == order.end())
                    order.push_back(peer);
            }
        }
        std::vector<std::string> items;
        for (const int peer : order) {
            items.push_back(
                fmt::format("rank {} on {}", peer, store.get_text(fmt::format("{}/where/{}", prefix_, peer), 300)));
        }
        peers_ = fmt::format("{}: {}", static_cast<int>(order.size()) == size_ - 1 ? "its peers" : "its nearest peers",
                             fmt::join(items, ", "));
    }

    // Queues `op` (`bytes`: what this rank contributes, for the trace). The ops of a group are numbered in the
    // order they run (the same order on every rank), for the errors of one that fails.
    CommHandle enqueue(const char* what, size_t bytes, std::function<void()> op) {
        auto task = std::make_shared<std::packaged_task<void()>>([this, what, bytes, op = std::move(op)] {
            const uint64_t seq = ++started_;
            try {
                trace::Span span("comm", what, static_cast<int64_t>(bytes));
                op();
                std::lock_guard<std::mutex> lock(progress_mutex_);
                completed_ = seq;
                completed_name_ = what;
            } catch (const gloo::Exception& e) {
                const std::string message = e.what();
                const bool timed_out = message.find("imed out") != std::string::npos;
                const std::string who = who_reached(seq, what, timed_out);
                // This rank's failure is a consequence: wait a moment before it ends the process, so the
                // launcher (trainer launch, mpirun, srun) sees the rank that died first and names it.
                std::this_thread::sleep_for(std::chrono::seconds(1));
                user_error(
                    "{} #{} of group {} failed on rank {}/{}: {} (a peer died, its link went down, or it did not issue "
                    "the same collective within {} s); {}; {}",
                    what, seq, prefix_, rank_, size_, message, timeout_.count() / 1000.0, who, peers_);
            }
        });
        CommHandle h(task->get_future().share());
        {
            std::lock_guard<std::mutex> lock(mutex_);
            queue_.push_back([task] { (*task)(); });
        }
        cv_.notify_one();
        return h;
    }

    std::string key(const char* what, uint64_t seq, int rank) const {
        return seq ? fmt::format("{}/{}/{}/{}", prefix_, what, seq, rank)
                   : fmt::format("{}/{}/{}", prefix_, what, rank);
    }

    // Once a second, when it changed: the last op this rank completed, as "<number> <name> <unix ms>" under
    // `<group>/progress/<rank>` in the store, for the errors of the other ranks when they wait for this one in vain.
    void publish_progress() {
        uint64_t published = 0;
        std::unique_lock<std::mutex> lock(mutex_);
        while (!publish_cv_.wait_for(lock, std::chrono::seconds(1), [this] { return stopping_; })) {
            lock.unlock();
            std::string text;
            {
                std::lock_guard<std::mutex> progress(progress_mutex_);
                if (completed_ != published) {
                    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count();
                    text = fmt::format("{} {} {}", completed_, completed_name_, ms);
                    published = completed_;
                }
            }
            if (!text.empty()) {
                try {
                    progress_store_->set(key("progress", 0, rank_), std::vector<char>(text.begin(), text.end()));
                } catch (const UserError&) {
                    published = 0;  // out of reach for now (a link down, or rank 0's process ended): told again
                }
            }
            lock.lock();
        }
    }

    // Which ranks of the group reached op #seq and which did not, from the store (not the stuck collective): a
    // rank whose op fails says so under `<group>/stuck/<seq>/<rank>`; ranks stuck in the same op time out within
    // moments of one another, so a rank that timed out waits a little for their word. A rank that did not reach
    // it is named with the last op it reported completing (reported once a second) and how long before.
    std::string who_reached(uint64_t seq, const char* what, bool timed_out) {
        if (!progress_store_) return "a group of one rank";
        try {
            progress_store_->set(key("stuck", seq, rank_), {1});
            std::vector<std::string> keys;
            for (int r = 0; r < size_; ++r) keys.push_back(key("stuck", seq, r));
            const auto grace = std::chrono::milliseconds(
                timed_out ? std::clamp<long>(static_cast<long>(timeout_.count() / 10), 2000, 10000) : 0);
            const auto deadline = std::chrono::steady_clock::now() + grace;
            std::vector<bool> in;
            for (;;) {
                in = progress_store_->check(keys);
                if (std::count(in.begin(), in.end(), true) == size_ || std::chrono::steady_clock::now() >= deadline)
                    break;
                std::this_thread::sleep_for(std::chrono::milliseconds(100));
            }
            std::vector<int> reached, missing;
            for (int r = 0; r < size_; ++r) (in[r] ? reached : missing).push_back(r);
            // This rank completed op #seq - 1 of the group, which every rank of it takes part in (a broadcast's root
            // aside): so every rank reached it, however long ago its own last report was.
            uint64_t before = 0;
            std::string before_name;
            {
                std::lock_guard<std::mutex> lock(progress_mutex_);
                if (completed_ + 1 == seq && completed_name_ != nullptr &&
                    std::strcmp(completed_name_, "broadcast") != 0) {
                    before = completed_;
                    before_name = completed_name_;
                }
            }
            std::vector<std::string> absent;
            for (size_t k = 0; k < missing.size() && k < 8; ++k) {
                const int r = missing[k];
                const std::string progress_key = key("progress", 0, r);
                unsigned long long done = 0;
                char name[64] = {};
                long long ms = 0;
                const bool reported = progress_store_->check({progress_key})[0] &&
                                      std::sscanf(progress_store_->get_text(progress_key, 128).c_str(),
                                                  "%llu %63s %lld", &done, name, &ms) == 3;
                const double ago = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch() -
                                                                 std::chrono::milliseconds(ms))
                                       .count();
                // Its own report (once a second) may be older than op #seq - 1, which it reached with this rank.
                if (before > 0 && (!reported || done < before)) {
                    absent.push_back(fmt::format("rank {} (it reached #{} {} with this rank{})", r, before, before_name,
                                                 reported ? fmt::format("; its last report came {:.1f} s ago", ago)
                                                          : std::string("; it reported no op")));
                } else if (reported) {
                    absent.push_back(
                        fmt::format("rank {} (its last completed op: #{} {}, {:.1f} s ago)", r, done, name, ago));
                } else {
                    absent.push_back(fmt::format("rank {} (no completed op reported)", r));
                }
            }
            if (missing.size() > 8) absent.push_back(fmt::format("{} more", missing.size() - 8));
            if (missing.empty()) return fmt::format("every rank of the group reached {} #{}", what, seq);
            return fmt::format("{} #{} was reached by rank(s) {}, not by {}", what, seq, fmt::join(reached, ", "),
                               fmt::join(absent, ", "));
        } catch (const UserError& e) {
            return fmt::format("the store could not say which ranks reached it ({})", e.what());
        }
    }

    void run() {
        if (trace::enabled()) trace::name_thread("gloo " + prefix_);
        for (;;) {
            std::function<void()> op;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;
                op = std::move(queue_.front());
                queue_.pop_front();
            }
            op();
        }
    }

    int rank_, size_;
    std::chrono::milliseconds timeout_;
    std::string prefix_;  // the group's name ("world", "shard0", ...), for the trace
    std::string peers_;   // read_peers
    std::shared_ptr<gloo::transport::Device> device_;
    std::shared_ptr<gloo::rendezvous::Context> context_;
    uint32_t tag_ = 1;
    // The reduce-scatter's receive blocks: one buffer, grown to the largest call and kept (the worker runs one
    // operation at a time), counted as communication memory. A fresh zeroed vector per call cost a memset,
    // and its frees and mallocs on this thread's arena fragmented it (glibc stops unmapping blocks of a size
    // it has freed once).
    std::unique_ptr<uint8_t[]> scratch_;
    size_t scratch_bytes_ = 0;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::deque<std::function<void()>> queue_;
    bool stopping_ = false;
    std::thread worker_;
    // Progress, for the errors of an op that fails (who_reached): ops begun, and the last completed.
    std::unique_ptr<TcpStore> progress_store_;
    std::atomic<uint64_t> started_{0};
    std::mutex progress_mutex_;
    uint64_t completed_ = 0;
    const char* completed_name_ = "";
    std::condition_variable publish_cv_;  // with mutex_: the publisher's wake-up (stopping_)
    std::thread publisher_;
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(TcpStore& store, const std::string& prefix, int rank, int size,
                                                     std::chrono::milliseconds timeout, const std::string& bind_host) {
    return std::make_unique<GlooCommunicator>(store, prefix, rank, size, timeout, bind_host);
}

}  // namespace trainer
