// FSDP FULL_SHARD and SHARD_GRAD_OP over the Communicator (fp32 on the wire).
//
// Each unit's flat buffer is padded to a multiple of the world size and split evenly: rank r owns
// elements [r*S, (r+1)*S) of the parameters, their gradients and the AdamW moments (S = padded / world).
// Padding follows the last parameter; it is zero, never updated (the optimizer's decay segments stop at
// the unit's numel) and adds nothing to the gradient norm.
//   before_forward / before_backward: all-gather the unit's full parameters if they are not resident.
//   after_forward / after_backward:   FULL_SHARD frees them when no hook holds them (a tied head holds
//                                     the embedding from its forward to the embedding's backward);
//                                     SHARD_GRAD_OP keeps them for the whole step.
//   gradients: the unit's full gradient buffer lives from its first backward to its reduction, which is
//   a reduce-scatter into this rank's shard, once per step (grad_sync_mode batch: unsharded gradients
//   accumulate across micro-batches, OLMo's missing mode) or after every micro-batch (micro_batch).
// As in DDP, each rank's loss gradient carries world / global tokens and reductions are means.
#include <memory>

#include "core/common.h"
#include "parallel/communicator.h"
#include "parallel/shard_storage.h"
#include "parallel/strategy.h"

namespace trainer {
namespace {

class FsdpStrategy final : public Strategy {
   public:
    FsdpStrategy(Backend* backend, const ParamLayout& layout, Communicator* comm, bool keep_params_for_step,
                 bool reduce_every_micro_batch, std::string name)
        : backend_(backend),
          comm_(comm),
          keep_params_(keep_params_for_step),
          every_micro_(reduce_every_micro_batch),
          name_(std::move(name)) {
        const size_t world = static_cast<size_t>(comm->size());
        for (const auto& u : layout.units()) {
            UnitState s;
            s.numel = u.numel;
            s.shard = (u.numel + world - 1) / world;
            s.padded = s.shard * world;
            s.mine = ShardStorage(backend, s.shard);
            units_.push_back(std::move(s));
        }
    }

    std::string name() const override { return name_; }
    int rank() const override { return comm_->rank(); }
    int world_size() const override { return comm_->size(); }
    bool replicated() const override { return false; }

    float* unit_params(int u) override {
        TRAINER_CHECK(units_.at(u).full_params.data(), "unit {} parameters used outside its hooks", u);
        return units_[u].full_params.f32();
    }
    float* unit_grads(int u) override {
        TRAINER_CHECK(units_.at(u).full_grads.data(), "unit {} gradients used outside its backward hooks", u);
        return units_[u].full_grads.f32();
    }

    void begin_step(int num_micro_batches) override { num_micro_ = num_micro_batches; }
    void begin_micro_batch(int index) override { micro_ = index; }
    void before_forward(int u) override { acquire_params(u); }
    void after_forward(int u) override { release_params(u); }
    void before_backward(int u) override {
        acquire_params(u);
        UnitState& s = units_[u];
        if (!s.full_grads.data()) {
            s.full_grads = DeviceBuffer(backend_, s.padded * sizeof(float), MemCategory::kGradients);
            backend_->fill_zero(s.full_grads.data(), s.padded * sizeof(float));
        }
    }
    void after_backward(int u) override {
        if (every_micro_ || micro_ == num_micro_ - 1) reduce_grads(u);
        release_params(u);
    }
    void after_optimizer_step() override {
        // The shards changed: SHARD_GRAD_OP's kept units are stale.
        for (auto& s : units_) {
            s.refs = 0;
            s.full_params.reset();
        }
    }

    void zero_grads() override {
        for (auto& s : units_) backend_->fill_zero(s.mine.grads.data(), s.shard * sizeof(float));
    }
    std::vector<ShardView> owned_shards() override {
        std::vector<ShardView> views;
        const size_t r = static_cast<size_t>(comm_->rank());
        for (size_t u = 0; u < units_.size(); ++u)
            views.push_back(units_[u].mine.view(static_cast<int>(u), r * units_[u].shard));
        return views;
    }
    double all_reduce_sum(double x) override {
        comm_->all_reduce(&x, 1, CommDType::kFloat64).wait();
        return x;
    }
    double global_grad_sq(double local_sq) override { return all_reduce_sum(local_sq); }
    void barrier() override { comm_->barrier().wait(); }

    void load_full_unit_params(int u, const float* host) override {
        UnitState& s = units_.at(u);
        const size_t begin = static_cast<size_t>(comm_->rank()) * s.shard;
        const size_t n = begin < s.numel ? std::min(s.shard, s.numel - begin) : 0;
        backend_->fill_zero(s.mine.params.data(), s.shard * sizeof(float));
        if (n > 0) backend_->copy_host_to_device(s.mine.params.data(), host + begin, n * sizeof(float));
    }

   private:
    struct UnitState {
        size_t numel = 0, shard = 0, padded = 0;
        ShardStorage mine;                     // this rank's shard
        DeviceBuffer full_params, full_grads;  // while gathered / accumulating
        int refs = 0;
    };

    void acquire_params(int u) {
        UnitState& s = units_[u];
        ++s.refs;
        if (s.full_params.data()) return;
        s.full_params = DeviceBuffer(backend_, s.padded * sizeof(float), MemCategory::kGatheredUnits);
        comm_->all_gather(s.mine.params.data(), s.full_params.data(), s.shard, CommDType::kFloat32).wait();
    }
    void release_params(int u) {
        UnitState& s = units_[u];
        TRAINER_CHECK(s.refs > 0, "unit {} released more often than acquired", u);
        if (--s.refs == 0 && !keep_params_) s.full_params.reset();
    }
    void reduce_grads(int u) {
        UnitState& s = units_[u];
        if (!s.full_grads.data()) return;
        DeviceBuffer mine(backend_, std::max<size_t>(1, s.shard) * sizeof(float), MemCategory::kCommunication);
        comm_->reduce_scatter(s.full_grads.data(), mine.data(), s.shard, CommDType::kFloat32).wait();
        // Mean over ranks, accumulated into the shard's gradient (micro_batch mode adds every micro-batch).
        backend_->scale_inplace(mine.f32(), s.shard, 1.0f / static_cast<float>(comm_->size()));
        backend_->residual_forward(s.mine.grads.f32(), s.mine.grads.f32(), mine.f32(), s.shard);
        s.full_grads.reset();
    }

    Backend* backend_;
    Communicator* comm_;
    bool keep_params_, every_micro_;
    std::string name_;
    int num_micro_ = 1, micro_ = 0;
    std::vector<UnitState> units_;
};

}  // namespace

std::unique_ptr<Strategy> make_fsdp_strategy(Backend* backend, const ParamLayout& layout, Communicator* comm,
                                             bool keep_params_for_step, bool reduce_every_micro_batch,
                                             const std::string& name) {
    return std::make_unique<FsdpStrategy>(backend, layout, comm, keep_params_for_step, reduce_every_micro_batch, name);
}

}  // namespace trainer
