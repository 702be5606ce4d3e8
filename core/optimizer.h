// The optimizer step: global gradient norm, clipping, AdamW on the locally owned shards, and OLMo's
// learning-rate schedules. It sees shards through the Strategy, never the strategy's kind.
#pragma once

#include <functional>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

// Learning rate at 1-based step `step` of a run of `total_steps` (OLMo's formulas; t_max defaults to
// total_steps; warmup rises linearly from warmup_min_lr, 0.1 x lr by default).
double scheduled_lr(const OptimizerConfig& opt, const SchedulerConfig& sched, long step, long total_steps);
// Clipping threshold at `step` (x grad_clip_warmup_factor while step <= grad_clip_warmup_steps), or a
// negative number when clipping is off.
double scheduled_max_grad_norm(const TrainConfig& config, long step);
// Clipping coefficient min(1, max_norm / (norm + 1e-6)) (OLMo / PyTorch clip_grad_norm_).
double clip_coefficient(double grad_norm, double max_norm);

// What to change when the training state is no longer finite: the learning rate, and first the AdamW epsilon
// where it is 0 (the update divides by zero where a parameter has had no gradient yet).
std::string divergence_advice(const OptimizerConfig& opt);

struct OptimizerStepResult {
    double grad_norm = 0.0;  // global, before clipping
    double lr = 0.0;
};

class AdamW {
   public:
    // `host`: the backend that runs the step on shards in host memory (cpu_offload: the CPU backend, the
    // device's own when it computes on the CPU); null where no shard is. The gradients' norm is always the
    // device's (`backend`), where the gradients are. `stream_chunk`: how many gradient elements CPU offload
    // copies down at a time (smaller in tests, to split shards and decay groups).
    AdamW(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Backend* host = nullptr,
          size_t stream_chunk = kStreamChunk);
    // One optimizer step at 1-based `step`: the global gradient norm (sum of squares of every owned
    // shard, all-reduced), the clipping coefficient, then AdamW on every owned shard with the decay group
    // of each parameter range, on the device or, for offloaded shards, on the host.
    OptimizerStepResult step(Strategy& strategy, long step, long total_steps);

    // CPU offload streams the gradients down in chunks of this many elements (16 MiB: a few milliseconds of
    // the host's update, against tens of microseconds a copy costs to start), two in flight.
    static constexpr size_t kStreamChunk = size_t(1) << 22;

   private:
    // AdamW's ranges over elements [a, b) of shard `s` (offsets in the shard), one per decay group, the
    // gradient read from `grad` (element a's).
    void append_ranges(std::vector<Backend::AdamwRange>& out, const ShardView& s, size_t a, size_t b,
                       const float* grad) const;
    // CPU offload: `update` over every shard, its gradients streamed from the device through staging_.
    void update_streaming(const std::vector<ShardView>& shards,
                          const std::function<void(const std::vector<Backend::AdamwRange>&)>& update);
    const TrainConfig& config_;
    const ParamLayout& layout_;
    Backend* backend_;
    Backend* host_;
    size_t stream_chunk_;
    DeviceBuffer staging_;  // CPU offload: two chunks of pinned host memory for the streamed gradients
};

}  // namespace trainer
