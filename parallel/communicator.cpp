// Device-neutral parts of the Communicator seam (see communicator.h): element sizes and the communicator
// of a group of one.
#include "parallel/communicator.h"

#include <cstring>

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

}  // namespace

std::unique_ptr<Communicator> make_local_communicator(Backend* backend) {
    return std::make_unique<LocalCommunicator>(backend);
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
std::unique_ptr<Communicator> make_nccl_communicator(TcpStore&, const std::string&, int, int, std::chrono::milliseconds,
                                                     Backend*) {
    user_error(
        "distributed_backend \"nccl\": this build has no CUDA (nvcc was not found when it was configured); use "
        "gloo on the CPU");
}
#endif

}  // namespace trainer
