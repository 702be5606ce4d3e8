// Dry runs: one training step of a config, on one rank of a world of any size, through the real strategy,
// model and optimizer over a backend that computes and allocates nothing (make_dry_backend) and
// communicators that move nothing (make_dry_communicator). The memory accounting sees every buffer the step
// takes, when it takes it, so the peak memory by category is the real run's, from the same code that
// allocates (no second formula to drift); every op and collective is recorded in the order the rank issues
// them, the input of a time model.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/memory.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

// One op, collective issue or collective wait of the step, in the order the rank issues them.
struct StepEvent {
    // kIssue / kWait: a collective issued, waited for. kCopy / kCopyWait: an asynchronous copy between host
    // and device memory (CPU offload's gradients down, parameters up; Backend::copy_async) queued, waited
    // for (by the host or by the device's work). kSpanBegin / kSpanEnd: a trace span of the step
    // (base/trace.h), named in `label`.
    enum Kind { kOp, kIssue, kWait, kCopy, kCopyWait, kSpanBegin, kSpanEnd } kind = kOp;
    const char* what = "";            // the backend op, the collective's kind, or the span's category
    std::string label;                // spans: the name
    double flops = 0.0, bytes = 0.0;  // an op's work; a collective's bytes per rank; a copy's bytes
    bool on_host = false;             // an op of the host's (CPU offload's optimizer), not the device's
    int group_size = 1;               // collectives: the ranks of the group
    bool spans_nodes = false;         // collectives: the group has ranks on several nodes
    int node_flows = 1;               // collectives across nodes: the node's groups like it at once (CollectiveCall)
    uint64_t id = 0;                  // collectives: the issue a wait is for; copies: the copy's ticket
    const void* channel = nullptr;    // collectives: the communicator (its collectives run in order)
};

struct DryRunStep {
    std::array<int64_t, kNumMemCategories> peak{};  // bytes per category
    int64_t total_peak = 0;                         // the device categories' high-water mark
    int64_t host_peak = 0;                          // the host categories' (CPU offload)
    std::vector<StepEvent> events;
    size_t optimizer_begin = 0;  // events from here on are the optimizer step's
};

// One optimizer step of `config` (after check_parallel_config) on rank env.rank of env.world_size ranks
// (env.local_world_size per node) computing on `device` (kCpu or kCuda: which collectives a run would use).
// Peaks are the step's own (what was allocated before the call does not count); the process's peaks are
// left as they were.
// With `timer`, the events go to it as they happen and `events` stays empty (a step of a thousand
// micro-batches has millions).
// Where a dry run's events go as they happen (the time model, core/plan/step_time.h).
class StepEventSink {
   public:
    virtual ~StepEventSink() = default;
    // The next event of the step; `optimizer`: it belongs to the optimizer step.
    virtual void add(const StepEvent& e, bool optimizer) = 0;
};
DryRunStep dry_run_step(const TrainConfig& config, const RankEnv& env, Device device, StepEventSink* timer = nullptr);

}  // namespace trainer
