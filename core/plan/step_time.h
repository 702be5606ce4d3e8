// The time model of `trainer plan`: a dry run's events (core/plan/dry_run.h) replayed on a clock. Each op takes its
// calibrated time (bench-kernels measured on this machine, scaled by its work) or, without a calibration,
// its roofline time on the hardware entry at that entry's efficiencies; each collective runs on its
// communicator's queue (one at a time, in issue order) for a ring algorithm's time over the link its group
// uses; the compute clock waits for a collective where the strategy waits for it. So prefetching, the
// reductions' overlap with the backward, grad_sync modes and HYBRID groups are modelled in the order the
// strategy issues them. On a CPU the collectives share the cores with the compute: a collective runs at
// (1 - comm_compute_share) of its link's speed (the link as it runs alone, what trainer bench-comm measures),
// and that share of its time lands on the compute clock.
// CPU offload: the gradients' copies down and the parameters' copies up run on the host link's queue
// beside the compute, the clock waiting where the host or the device waits for them; the host optimizer's
// ops take their bytes at the host's bandwidth. The parameters uploaded at the end of a step are waited
// for by the next step's forward, each unit's before its first use: the step ends here when the last has
// landed, an upper bound by the next forward's overlap with the uploads of its later units (at most the
// forward's time, small beside the uploads wherever offload pays).
#pragma once

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "base/config.h"
#include "core/plan/calibration.h"
#include "core/plan/dry_run.h"
#include "core/plan/hardware.h"
#include "core/plan/step_parts.h"

namespace trainer {

// A ring collective's cost on a link: `steps` latencies, and `bytes` that each rank sends (and receives) at the
// link's bandwidth. `bytes` is the call's as a dry run reports it (core/plan/dry_run.h): a reduce-scatter's or
// all-gather's shard, an all-reduce's or broadcast's buffer. A reduce-scatter or all-gather moves n-1 shards in
// n-1 steps, an all-reduce is both (2(n-1)/n of its buffer in 2(n-1) steps), a broadcast forwards its buffer
// along n-1 steps, a barrier takes log2(n) latencies.
struct RingCost {
    double steps = 0.0, bytes = 0.0;
};
RingCost ring_cost(const std::string& kind, double bytes, int group_size);

struct StepTime {
    double total = 0.0;         // seconds of one optimizer step
    double compute = 0.0;       // the ops of forward and backward
    double exposed_comm = 0.0;  // the compute clock waiting for collectives (and, on a CPU, their cycles)
    double optimizer = 0.0;     // the optimizer step's ops and its waits
    // The ops' seconds (compute's and the optimizer's) by the part of the step that runs them (step_parts.h); what
    // the total holds beyond their sum is waiting (for collectives and copies) and, on a CPU, collectives' cycles.
    std::map<std::string, double> parts;
};

// The time model, fed a step's events in order (dry_run_step streams them, so a step of a thousand
// micro-batches is never held in memory): ops on the compute clock at their calibrated or roofline times,
// collectives queued on their communicator's link, waits where the strategy waits. `slowdown` multiplies
// every op's time (CPU ranks sharing cores beyond their count). With `trace`, the predicted step is
// appended to it as Chrome trace events (the step's spans on the compute track, each collective on its
// communicator's track), process `pid`.
class StepTimer final : public StepEventSink {
   public:
    StepTimer(const Hardware& hw, const Calibration* calibration, bool bf16, double slowdown = 1.0,
              Json* trace = nullptr, int pid = 0);
    void add(const StepEvent& e, bool optimizer) override;
    // The step so far, ended when the parameters uploaded by its optimizer (CPU offload) have landed.
    StepTime result() const;

   private:
    double op_seconds(const StepEvent& e) const;
    void emit(const std::string& name, const char* category, double begin, double seconds, int tid, double bytes);
    const Hardware& hw_;
    const Calibration* cal_;
    double peak_, slowdown_;
    Json* trace_;
    int pid_;
    StepTime r_;
    // Every micro-batch repeats the same ops: each distinct one is costed once (op names are the dry
    // backend's literals, so their addresses identify them).
    std::map<std::tuple<const char*, double, double, bool>, double> costed_;
    StepSpans spans_;                             // the step's spans open now, which put each op in its part
    std::vector<double> part_seconds_;            // by step_part_index
    std::map<const void*, double> channel_free_;  // when each communicator's queue is next free
    std::map<const void*, int> track_;            // trace: each communicator's track (compute's is 0)
    std::map<uint64_t, double> done_;             // when each issued collective completes
    double copies_free_ = 0.0;                    // when the host link's queue is next free
    std::map<uint64_t, double> copy_done_;        // when each copy completes, by ticket
    double uploads_end_ = 0.0;                    // when the optimizer's last copy up completes
    std::vector<std::tuple<std::string, const char*, double>>
        open_;  // spans begun and not ended: name, category, start
};

// The time model over a dry run's stored events (StepTimer).
StepTime predict_step_time(const DryRunStep& step, const Hardware& hw, const Calibration* calibration, bool bf16,
                           double slowdown = 1.0, Json* trace = nullptr, int pid = 0);

}  // namespace trainer
