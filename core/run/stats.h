// What a training run measures of its steps: each step's outcome, its record's measured numbers and console line, and
// the totals the summary reports (the mean step over the timed steps, communication waits, the device's busy
// share, each rank's compute time).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "base/json.h"
#include "core/optimizer.h"
#include "kernels/backend.h"

namespace trainer {

class Strategy;

// One optimizer step's results, as the log and the metrics file report them.
struct StepOutcome {
    double loss = 0.0;          // the cross-entropy, mean over the global batch's predicted tokens
    double z_loss = 0.0;        // the z-loss's mean (softmax_auxiliary_loss), 0 without one
    long masked_instances = 0;  // the global batch's instances the instance filter masked
    double tokens_in_loss = 0;  // the global batch's tokens the loss is the mean over
    OptimizerStepResult opt;
    double seconds = 0.0, comm_wait = 0.0;
    Backend::Activity activity;  // the device's busy and wait time, when measured
    int stop_signal = 0;         // the ranks agreed to stop after this step (base/stop.h), 0: go on
    // Every console_log_interval steps on several ranks: each rank's mean compute time a step (the step less its
    // waits on collectives) over the `compute_steps` steps before this one, exchanged in the loss all-reduce.
    std::vector<double> compute_per_rank;
    long compute_steps = 0;
    bool recorded_graph = false;  // kernels.cuda_graphs: a micro-batch was recorded (a one-off cost)
};

// The throughput a run's steps are measured by: tokens and model FLOPs of one global batch, the device's peak.
struct StepRates {
    double tokens_per_step = 0.0;  // global batch x L (OLMo counts L per instance)
    double flops_per_step = 0.0;   // flops_per_token x global batch x (L - 1) predicted positions
    double peak_flops = 1.0;       // one device's
    int world = 1;
};

class RunStats {
   public:
    RunStats(long start_step, long total_steps, const StepRates& rates)
        : start_step_(start_step), total_steps_(total_steps), rates_(rates) {}

    // Adds a step to the totals and returns its record's measured part: step, loss, lr, grad_norm,
    // tokens_per_second_per_device, mfu, step_time_ms, comm_wait_ms, z_loss (`z_loss`), and where the device's
    // activity was measured its busy, communication-wait and host-wait fractions.
    Json add(long step, const StepOutcome& r, bool z_loss);
    // The step's console line ("step 3/10 | loss ...").
    std::string console_line(long step, const StepOutcome& r, bool z_loss) const;
    // The seconds left at the mean timed step.
    double eta_seconds(long step) const;
    // This rank's mean compute time a step (the step less its waits on collectives) since the last reset, and the
    // steps it spans: what the ranks exchange to find stragglers.
    double interval_compute() const { return interval_steps_ > 0 ? interval_compute_ / interval_steps_ : 0.0; }
    long interval_steps() const { return interval_steps_; }
    void reset_interval() { interval_compute_ = 0.0, interval_steps_ = 0; }
    // The same over the whole run.
    double run_compute() const { return run_compute_steps_ > 0 ? run_compute_ / run_compute_steps_ : 0.0; }
    // Every rank's run_compute() in ms (the summary's compute_ms_per_rank): a collective over `strategy`, which every
    // rank calls.
    Json compute_ms_per_rank(Strategy& strategy, int rank, int world) const;

    // The summary record's measured part for the steps up to `last_step`: steps, final_step, final_loss,
    // tokens_per_second_per_device, mfu, mean_step_time_ms, mean_comm_wait_ms, mean_device_busy_fraction.
    Json summary(long last_step) const;
    // The closing console line's first part: "done: N steps | final loss ... | mean step ... ms (device busy ...)".
    std::string done_line(long last_step) const;

   private:
    double mean_step() const { return timed_steps_ > 0 ? total_time_ / timed_steps_ : 0.0; }

    long start_step_, total_steps_;
    StepRates rates_;
    double total_time_ = 0.0, total_comm_wait_ = 0.0, last_loss_ = 0.0;
    long timed_steps_ = 0;
    double total_busy_ = 0.0;  // the measured steps' device_busy_fraction, summed over busy_steps_ of them
    long busy_steps_ = 0;
    double last_tps_ = 0.0, last_mfu_ = 0.0, last_busy_ = -1.0;  // the last step's, for its console line
    double interval_compute_ = 0.0, run_compute_ = 0.0;
    long interval_steps_ = 0, run_compute_steps_ = 0;
};

// The ranks whose compute time a step over the last exchange's window (`r.compute_per_rank`, the window's
// `r.compute_steps` steps before `step`) exceeds `factor` times the median rank's: named in the step's record
// (stragglers, compute_ms_median) and, with each one's host (`host_of`) and both times, in the lines returned for
// the console.
std::vector<std::string> report_stragglers(long step, const StepOutcome& r, double factor,
                                           const std::function<std::string(int)>& host_of, Json& record);

}  // namespace trainer
