// The single-process strategy: full parameters, gradients and AdamW moments for every unit, no hooks.
#include <memory>

#include "core/common.h"
#include "parallel/strategy.h"

namespace trainer {
namespace {

class SingleStrategy final : public Strategy {
   public:
    SingleStrategy(Backend* backend, const ParamLayout& layout) : backend_(backend) {
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

    std::string name() const override { return "single"; }
    float* unit_params(int u) override { return units_.at(u).params.f32(); }
    float* unit_grads(int u) override { return units_.at(u).grads.f32(); }

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

    void load_full_unit_params(int u, const float* host) override {
        backend_->copy_host_to_device(units_.at(u).params.data(), host, units_.at(u).numel * sizeof(float));
    }
    void read_full_unit_params(int u, float* host) override {
        backend_->copy_device_to_host(host, units_.at(u).params.data(), units_.at(u).numel * sizeof(float));
    }

   private:
    struct UnitStorage {
        size_t numel = 0;
        DeviceBuffer params, grads, exp_avg, exp_avg_sq;
    };
    Backend* backend_;
    std::vector<UnitStorage> units_;
};

}  // namespace

std::unique_ptr<Strategy> make_single_strategy(Backend* backend, const ParamLayout& layout) {
    return std::make_unique<SingleStrategy>(backend, layout);
}

}  // namespace trainer
