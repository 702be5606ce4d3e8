// Device-neutral parts of the Communicator seam (see communicator.h): element sizes and the communicator
// of a group of one.
#include "parallel/comm/communicator.h"

#include <atomic>
#include <cstring>
#include <utility>

#include "base/common.h"
#include "kernels/backend.h"

namespace trainer {
namespace {

// A group of one: sums and gathers of one rank are copies (or nothing).
class LocalCommunicator final : public Communicator {
   public:
    explicit LocalCommunicator(Backend* backend) : backend_(backend) {}
    int rank() const override { return 0; }
    int size() const override { return 1; }
    CommHandle all_reduce(void*, size_t, CommDType) override { return CommHandle(); }
    CommHandle reduce_scatter(void* in, void* out, size_t count, CommDType dtype) override {
        copy(out, in, count * comm_dtype_size(dtype));
        return CommHandle();
    }
    CommHandle all_gather(const void* in, void* out, size_t count, CommDType dtype) override {
        copy(out, in, count * comm_dtype_size(dtype));
        return CommHandle();
    }
    CommHandle broadcast(void*, size_t, CommDType, int) override { return CommHandle(); }
    CommHandle barrier() override { return CommHandle(); }

   private:
    void copy(void* out, const void* in, size_t bytes) {
        if (out == in || bytes == 0) return;
        if (backend_ != nullptr)
            backend_->copy_any(out, in, bytes);
        else
            std::memmove(out, in, bytes);
    }
    Backend* backend_;
};

// Moves nothing; reports what it was asked.
class DryCommunicator final : public Communicator {
   public:
    DryCommunicator(int rank, int size, bool gloo_scratch, bool spans_nodes, int node_flows,
                    std::function<void(const CollectiveCall&)> observer)
        : rank_(rank),
          size_(size),
          gloo_scratch_(gloo_scratch),
          spans_nodes_(spans_nodes),
          node_flows_(node_flows),
          observer_(std::move(observer)) {}
    ~DryCommunicator() override { memory_record_free(MemCategory::kCommunication, static_cast<int64_t>(scratch_)); }
    int rank() const override { return rank_; }
    int size() const override { return size_; }
    CommHandle all_reduce(void*, size_t count, CommDType dtype) override {
        return note("all_reduce", count * comm_dtype_size(dtype));
    }
    CommHandle reduce_scatter(void*, void*, size_t count, CommDType dtype) override {
        const size_t need = gloo_scratch_ && count > 0 ? gloo_reduce_scatter_scratch_bytes(count, dtype, size_) : 0;
        if (need > scratch_) {
            memory_record_alloc(MemCategory::kCommunication, static_cast<int64_t>(need - scratch_));
            scratch_ = need;
        }
        return note("reduce_scatter", count * comm_dtype_size(dtype));
    }
    CommHandle all_gather(const void*, void*, size_t count, CommDType dtype) override {
        return note("all_gather", count * comm_dtype_size(dtype));
    }
    CommHandle broadcast(void*, size_t count, CommDType dtype, int) override {
        return note("broadcast", count * comm_dtype_size(dtype));
    }
    CommHandle barrier() override { return note("barrier", 0); }

   private:
    CommHandle note(const char* kind, size_t bytes) {
        if (!observer_) return CommHandle();
        static std::atomic<uint64_t> next_id{1};
        CollectiveCall call{kind, bytes, size_, next_id++, this, spans_nodes_, node_flows_, false};
        observer_(call);
        call.wait = true;
        return CommHandle(std::function<void()>([observer = observer_, call] { observer(call); }));
    }
    int rank_, size_;
    bool gloo_scratch_, spans_nodes_;
    int node_flows_;
    std::function<void(const CollectiveCall&)> observer_;
    size_t scratch_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(Backend* backend) {
    return std::make_unique<LocalCommunicator>(backend);
}

std::unique_ptr<Communicator> make_dry_communicator(int rank, int size, bool gloo_scratch, bool spans_nodes,
                                                    int node_flows,
                                                    std::function<void(const CollectiveCall&)> observer) {
    return std::make_unique<DryCommunicator>(rank, size, gloo_scratch, spans_nodes, node_flows, std::move(observer));
}

size_t comm_dtype_size(CommDType t) {
    switch (t) {
        case CommDType::kFloat32:
            return 4;
        case CommDType::kBFloat16:
            return 2;
        case CommDType::kFloat64:
            return 8;
    }
    return 0;
}

#ifndef TRAINER_HAVE_CUDA
std::string nccl_library_version() { return "NCCL: none (built without CUDA)"; }

std::unique_ptr<Communicator> make_nccl_communicator(TcpStore&, const std::string&, int, int, std::chrono::milliseconds,
                                                     Backend*) {
    user_error(
        "distributed_backend \"nccl\": this build has no CUDA (nvcc was not found when it was configured); use "
        "gloo on the CPU");
}
#endif

}  // namespace trainer
