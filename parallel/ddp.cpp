// DDP: a full replica on every rank; gradients all-reduced unit by unit (a unit is a bucket) as soon as
// the unit's backward is done, so the reduction of block l overlaps with the backward of block l-1 on the
// communicator's thread. grad_sync_mode "batch" reduces once per optimizer step, on the last micro-batch;
// "micro_batch" reduces after every micro-batch.
//
// The reduction is a mean: the model scales each rank's loss gradient by world / (global tokens), and the
// all-reduced sum is divided by world. A mean keeps micro_batch mode right: what was reduced after earlier
// micro-batches is identical on every rank, and averaging leaves it unchanged while the new contributions
// sum. Used for fsdp NO_SHARD too, which must cost what DDP costs.
#include <memory>

#include "core/common.h"
#include "parallel/communicator.h"
#include "parallel/strategy.h"

namespace trainer {
namespace {

class DdpStrategy final : public Strategy {
   public:
    DdpStrategy(Backend* backend, const ParamLayout& layout, Communicator* comm, bool sync_every_micro_batch,
                std::string name)
        : backend_(backend), comm_(comm), every_micro_(sync_every_micro_batch), name_(std::move(name)) {
        for (const auto& u : layout.units()) {
            const size_t bytes = u.numel * sizeof(float);
            UnitStorage s;
            s.numel = u.numel;
            s.params = DeviceBuffer(backend, bytes, MemCategory::kParameters);
            s.grads = DeviceBuffer(backend, bytes, MemCategory::kGradients);
            s.exp_avg = DeviceBuffer(backend, bytes, MemCategory::kOptimizerState);
            s.exp_avg_sq = DeviceBuffer(backend, bytes, MemCategory::kOptimizerState);
            for (DeviceBuffer* b : {&s.params, &s.grads, &s.exp_avg, &s.exp_avg_sq})
                backend->fill_zero(b->data(), bytes);
            units_.push_back(std::move(s));
        }
    }

    std::string name() const override { return name_; }
    int rank() const override { return comm_->rank(); }
    int world_size() const override { return comm_->size(); }
    float* unit_params(int u) override { return units_.at(u).params.f32(); }
    float* unit_grads(int u) override { return units_.at(u).grads.f32(); }

    void begin_step(int num_micro_batches) override { num_micro_ = num_micro_batches; }
    void begin_micro_batch(int index) override { micro_ = index; }
    void before_backward(int u) override {
        // micro_batch mode: the previous micro-batch's reduction of this unit must land (and be averaged)
        // before this backward accumulates into the same buffer.
        settle(u);
    }
    void after_backward(int u) override {
        if (!every_micro_ && micro_ != num_micro_ - 1) return;
        UnitStorage& s = units_[u];
        if (s.numel == 0) return;
        s.pending = comm_->all_reduce(s.grads.data(), s.numel, CommDType::kFloat32);
        s.has_pending = true;
    }
    void finish_backward() override {
        for (size_t u = 0; u < units_.size(); ++u) settle(static_cast<int>(u));
    }

    void zero_grads() override {
        for (auto& s : units_) backend_->fill_zero(s.grads.data(), s.numel * sizeof(float));
    }
    std::vector<ShardView> owned_shards() override {
        std::vector<ShardView> views;
        for (size_t u = 0; u < units_.size(); ++u) {
            auto& s = units_[u];
            views.push_back(
                {static_cast<int>(u), 0, s.numel, s.params.f32(), s.grads.f32(), s.exp_avg.f32(), s.exp_avg_sq.f32()});
        }
        return views;
    }
    double all_reduce_sum(double x) override {
        comm_->all_reduce(&x, 1, CommDType::kFloat64).wait();
        return x;
    }

    void load_full_unit_params(int u, const float* host) override {
        backend_->copy_host_to_device(units_.at(u).params.data(), host, units_.at(u).numel * sizeof(float));
    }
    void read_full_unit_params(int u, float* host) override {
        backend_->copy_device_to_host(host, units_.at(u).params.data(), units_.at(u).numel * sizeof(float));
    }

   private:
    void settle(int u) {
        UnitStorage& s = units_[u];
        if (!s.has_pending) return;
        s.pending.wait();
        s.has_pending = false;
        backend_->scale_inplace(s.grads.f32(), s.numel, 1.0f / static_cast<float>(comm_->size()));
    }

    struct UnitStorage {
        size_t numel = 0;
        DeviceBuffer params, grads, exp_avg, exp_avg_sq;
        CommHandle pending;
        bool has_pending = false;
    };
    Backend* backend_;
    Communicator* comm_;
    bool every_micro_;
    std::string name_;
    int num_micro_ = 1, micro_ = 0;
    std::vector<UnitStorage> units_;
};

}  // namespace

std::unique_ptr<Strategy> make_ddp_strategy(Backend* backend, const ParamLayout& layout, Communicator* comm,
                                            bool sync_every_micro_batch, const std::string& name) {
    return std::make_unique<DdpStrategy>(backend, layout, comm, sync_every_micro_batch, name);
}

}  // namespace trainer
