// A training run's step statistics (see stats.h).
#include "core/run/stats.h"

#include <algorithm>

#include "base/common.h"
#include "core/metrics.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

Json RunStats::add(long step, const StepOutcome& r, bool z_loss) {
    // The first step warms caches, and one that recorded a graph paid for it once: neither is timed (unless it is
    // the only step).
    const bool timed = (step > start_step_ + 1 && !r.recorded_graph) || total_steps_ - start_step_ == 1;
    if (timed) {
        total_time_ += r.seconds;
        total_comm_wait_ += r.comm_wait;
        ++timed_steps_;
    }
    const double compute = std::max(0.0, r.seconds - r.comm_wait);
    interval_compute_ += compute;
    ++interval_steps_;
    run_compute_ += compute;
    ++run_compute_steps_;
    last_loss_ = r.loss;
    last_tps_ = rates_.tokens_per_step / rates_.world / r.seconds;
    last_mfu_ = rates_.flops_per_step / rates_.world / r.seconds / rates_.peak_flops;
    Json record = {{"step", step},
                   {"loss", r.loss},
                   {"lr", r.opt.lr},
                   {"grad_norm", r.opt.grad_norm},
                   {"tokens_per_second_per_device", last_tps_},
                   {"mfu", last_mfu_},
                   {"step_time_ms", r.seconds * 1e3},
                   {"comm_wait_ms", r.comm_wait * 1e3}};
    if (z_loss) record["z_loss"] = r.z_loss;  // OLMo's train/ZLoss
    last_busy_ = -1.0;
    if (r.activity.measured) {
        // Shares of the step: the device ran kernels, waited for collectives (the CUDA stream's waits; on the CPU
        // the host's), or had nothing to run, waiting for the host.
        const double busy = std::min(1.0, r.activity.busy_s / r.seconds);
        const double wait =
            std::min(1.0 - busy, (r.activity.wait_s >= 0.0 ? r.activity.wait_s : r.comm_wait) / r.seconds);
        record["device_busy_fraction"] = busy;
        record["device_comm_wait_fraction"] = wait;
        record["device_host_wait_fraction"] = std::max(0.0, 1.0 - busy - wait);
        last_busy_ = busy;
        if (timed) {
            total_busy_ += busy;
            ++busy_steps_;
        }
    }
    return record;
}

std::string RunStats::console_line(long step, const StepOutcome& r, bool z_loss) const {
    const std::string z = z_loss ? fmt::format(" | z_loss {:.3e}", r.z_loss) : "";
    const std::string busy = last_busy_ >= 0.0 ? fmt::format(" | busy {:.0f}%", 100.0 * last_busy_) : "";
    return fmt::format(
        "step {}/{} | loss {:.4f}{} | lr {:.3e} | grad_norm {:.4f} | tok/s/dev {:.0f} | mfu {:.1f}% | "
        "step {:.1f} ms{}",
        step, total_steps_, r.loss, z, r.opt.lr, r.opt.grad_norm, last_tps_, 100.0 * last_mfu_, r.seconds * 1e3, busy);
}

double RunStats::eta_seconds(long step) const {
    return static_cast<double>(total_steps_ - step) *
           (total_time_ / static_cast<double>(std::max<long>(1, timed_steps_)));
}

Json RunStats::summary(long last_step) const {
    const double mean = mean_step();
    const double tps = mean > 0 ? rates_.tokens_per_step / rates_.world / mean : 0.0;
    const double mfu = mean > 0 ? rates_.flops_per_step / rates_.world / mean / rates_.peak_flops : 0.0;
    Json s = {{"event", "summary"},
              {"steps", last_step - start_step_},
              {"final_step", last_step},
              {"final_loss", last_loss_},
              {"tokens_per_second_per_device", tps},
              {"mfu", mfu},
              {"mean_step_time_ms", mean * 1e3},
              {"mean_comm_wait_ms", timed_steps_ > 0 ? total_comm_wait_ / timed_steps_ * 1e3 : 0.0}};
    if (busy_steps_ > 0) s["mean_device_busy_fraction"] = total_busy_ / busy_steps_;
    return s;
}

std::string RunStats::done_line(long last_step) const {
    const double mean = mean_step();
    const double tps = mean > 0 ? rates_.tokens_per_step / rates_.world / mean : 0.0;
    const double mfu = mean > 0 ? rates_.flops_per_step / rates_.world / mean / rates_.peak_flops : 0.0;
    const std::string busy =
        busy_steps_ > 0 ? fmt::format(" (device busy {:.0f}%)", 100.0 * total_busy_ / busy_steps_) : "";
    return fmt::format(
        "done: {} steps | final loss {:.4f} | {:.0f} tokens/s/device | MFU {:.1f}% | mean step {:.1f} ms{}",
        last_step - start_step_, last_loss_, tps, 100.0 * mfu, mean * 1e3, busy);
}

std::vector<std::string> report_stragglers(long step, const StepOutcome& r, double factor,
                                           const std::function<std::string(int)>& host_of, Json& record) {
    const std::vector<int> slow = find_stragglers(r.compute_per_rank, factor);
    if (slow.empty()) return {};
    const double median = lower_median(r.compute_per_rank);
    record["stragglers"] = slow;
    record["compute_ms_median"] = median * 1e3;
    std::vector<std::string> lines;
    for (const int k : slow) {
        lines.push_back(fmt::format(
            "straggler: rank {} on {} computed {:.1f} ms a step over steps {}-{}, {:.2f}x the median rank's {:.1f} ms "
            "(straggler_factor {:g})",
            k, host_of(k), r.compute_per_rank[k] * 1e3, step - r.compute_steps, step - 1,
            r.compute_per_rank[k] / median, median * 1e3, factor));
    }
    return lines;
}

Json RunStats::compute_ms_per_rank(Strategy& strategy, int rank, int world) const {
    std::vector<double> per_rank(static_cast<size_t>(world), 0.0);
    per_rank[static_cast<size_t>(rank)] = run_compute();
    if (world > 1) strategy.all_reduce_sum(per_rank.data(), world);
    Json ms = Json::array();
    for (const double c : per_rank) ms.push_back(c * 1e3);
    return ms;
}

}  // namespace trainer
