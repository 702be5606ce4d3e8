// The time model (see step_time.h).
#include "core/plan/step_time.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <thread>
#include <tuple>

#include "base/common.h"

namespace trainer {
namespace {

// Seconds of one collective over `link` (ring_cost).
// `sharing`: the flows that share the link's bandwidth.
double collective_seconds(const StepEvent& e, const Link& link, double sharing = 1.0) {
    if (e.group_size <= 1 || link.bandwidth <= 0.0) return 0.0;
    const RingCost c = ring_cost(e.what, e.bytes, e.group_size);
    return c.bytes * sharing / link.bandwidth + c.steps * link.latency;
}

}  // namespace

RingCost ring_cost(const std::string& kind, double bytes, int group_size) {
    const double n = group_size;
    if (n <= 1) return {};
    if (kind == "all_reduce") return {2.0 * (n - 1), 2.0 * (n - 1) / n * bytes};
    if (kind == "reduce_scatter" || kind == "all_gather") return {n - 1, (n - 1) * bytes};
    if (kind == "broadcast") return {n - 1, bytes};
    return {std::log2(n), 0.0};  // barrier
}

StepTimer::StepTimer(const Hardware& hw, const Calibration* calibration, bool bf16, double slowdown, Json* trace,
                     int pid)
    : hw_(hw),
      cal_(calibration),
      peak_(bf16 ? hw.bf16_flops : hw.fp32_flops),
      slowdown_(slowdown),
      trace_(trace),
      pid_(pid),
      part_seconds_(step_part_order().size(), 0.0) {}

double StepTimer::op_seconds(const StepEvent& e) const {
    // amp_fp8's block GEMMs are priced from the calibration's FP8 GEMM times where it has them (bench-kernels under
    // amp_fp8: a GPU's, or the CPU's emulation, which a CPU run with distributed_strategy auto plans with), else at
    // the hardware entry's FP8 peak; neither is refused by name (a calibration's copy speed is no GEMM's, and GPUs
    // before compute capability 8.9 have no FP8).
    const bool fp8 = std::strncmp(e.what, "matmul_fp8", 10) == 0;
    // The calibration entry of the same op whose work is closest; its time scaled by the work.
    if (cal_ != nullptr) {
        const bool by_flops = e.flops > 0.0;
        const double work = by_flops ? e.flops : e.bytes;
        const Calibration::Entry* best = nullptr;
        double best_d = 0.0;
        for (const auto& c : cal_->entries) {
            const double cw = by_flops ? c.flops : c.bytes;
            if (c.op != e.what || cw <= 0.0) continue;
            const double d = std::fabs(std::log(work / cw));
            if (best == nullptr || d < best_d) best = &c, best_d = d;
        }
        if (best != nullptr) return cal_->step_scale * best->seconds * work / (by_flops ? best->flops : best->bytes);
        if (fp8) {
            user_error(
                "plan --calibration {}: precision amp_fp8, and the file timed no {} (it was measured without "
                "amp_fp8); measure one with trainer bench-kernels --config C --precision amp_fp8 --calibration-out "
                "FILE, or plan without it",
                cal_->path, e.what);
        }
        // An op the file has not: a copy's speed.
        if (cal_->bandwidth > 0.0) return cal_->step_scale * e.bytes / cal_->bandwidth;
    }
    // CPU offload's optimizer: memory-bound loops over host memory (no calibration: it measures the device).
    if (e.on_host && hw_.host_bandwidth > 0.0) return e.bytes / hw_.host_bandwidth;
    const bool gemm = std::strncmp(e.what, "matmul", 6) == 0, attention = std::strncmp(e.what, "attention", 9) == 0;
    const double eff = gemm ? hw_.gemm_efficiency : attention ? hw_.attention_efficiency : 1.0;
    // amp_fp8's GEMMs at the FP8 peak (their casts are ops of their own: "fp8_cast", memory-bound).
    if (fp8 && hw_.fp8_flops <= 0.0) {
        user_error(
            "plan: precision amp_fp8 runs its Linear layers at an FP8 peak, and {} has none (its hardware file's "
            "fp8_tflops; FP8 tensor cores come with compute capability 8.9); plan amp_bf16 there",
            hw_.name);
    }
    const double peak = fp8 ? hw_.fp8_flops : peak_;
    const double t_flops = peak > 0.0 ? e.flops / (peak * eff) : 0.0;
    const double t_bytes = hw_.bandwidth > 0.0 ? e.bytes / (hw_.bandwidth * hw_.memory_efficiency) : 0.0;
    return std::max(t_flops, t_bytes) + hw_.op_overhead + (gemm ? hw_.gemm_overhead : 0.0);
}

void StepTimer::emit(const std::string& name, const char* category, double begin, double seconds, int tid,
                     double bytes) {
    Json ev = {{"name", name},         {"cat", category}, {"ph", "X"}, {"ts", begin * 1e6},
               {"dur", seconds * 1e6}, {"pid", pid_},     {"tid", tid}};
    if (bytes >= 0.0) ev["args"] = {{"bytes", bytes}};
    trace_->push_back(ev);
}

void StepTimer::add(const StepEvent& e, bool optimizer) {
    double& clock = r_.total;
    if (e.kind == StepEvent::kSpanBegin) {
        spans_.begin(e.what, e.label);
        if (trace_ != nullptr) open_.emplace_back(e.label, e.what, clock);
        return;
    }
    if (e.kind == StepEvent::kSpanEnd) {
        spans_.end();
        if (trace_ != nullptr) {
            TRAINER_CHECK(!open_.empty(), "a span ended that did not begin");
            const auto& [name, category, begin] = open_.back();
            emit(name, category, begin, clock - begin, 0, -1.0);
            open_.pop_back();
        }
        return;
    }
    const double before = clock;
    // Without a host link (the CPU: host memory is the device's) a copy is an op like any other.
    const bool copy_is_op = hw_.host_link.bandwidth <= 0.0;
    if (e.kind == StepEvent::kCopyWait && copy_is_op) return;
    if (e.kind == StepEvent::kOp || (e.kind == StepEvent::kCopy && copy_is_op)) {
        const auto [it, added] = costed_.emplace(std::make_tuple(e.what, e.flops, e.bytes, e.on_host), 0.0);
        if (added) it->second = op_seconds(e);
        const double t = it->second * slowdown_;
        clock += t;
        (optimizer ? r_.optimizer : r_.compute) += t;
        part_seconds_[step_part_index(optimizer ? StepSpan::kOptimizer : spans_.where(), e.what)] += t;
        return;
    }
    if (e.kind == StepEvent::kCopy) {  // on the host link's queue, after the work queued before it
        const double start = std::max(clock, copies_free_);
        const double d = e.bytes / hw_.host_link.bandwidth + hw_.host_link.latency;
        copies_free_ = copy_done_[e.id] = start + d;
        if (optimizer) uploads_end_ = std::max(uploads_end_, copies_free_);
        if (trace_ != nullptr) {
            const int tid = track_.emplace(&copies_free_, static_cast<int>(track_.size()) + 1).first->second;
            emit("host link copy", "copy", start, d, tid, e.bytes);
        }
        return;
    }
    if (e.kind == StepEvent::kCopyWait) {  // a copy of this step (the previous step's were waited for)
        const auto it = copy_done_.find(e.id);
        if (it != copy_done_.end()) clock = std::max(clock, it->second);
    } else if (e.kind == StepEvent::kIssue) {
        // CPU: the collective's own work (its copies and sums: its time over the node's own link, where the cores
        // are what bounds it) shares the cores with the compute beside it, so it runs at (1 - share) of that speed
        // and takes `share` of its time from the compute. Across nodes the wire may bound it instead: it then
        // takes the wire's time (bench-comm's, on that link), and the cores still only its work's share.
        const double share = hw_.comm_compute_share;
        // Across nodes with a link a node (inter_node_links): the node's groups that run such a collective at
        // once share it.
        const double sharing = e.spans_nodes && hw_.inter_node_links > 0
                                   ? std::max(1.0, static_cast<double>(e.node_flows) / hw_.inter_node_links)
                                   : 1.0;
        const double link = collective_seconds(e, link_for(hw_, e.what, e.spans_nodes), sharing);
        const double work =
            (share > 0.0 && e.spans_nodes ? collective_seconds(e, link_for(hw_, e.what, false)) : link) / (1.0 - share);
        const double d = std::max(work, link);
        double& free = channel_free_[e.channel];
        const double start = std::max(clock, free);
        free = start + d;
        done_[e.id] = free;
        if (trace_ != nullptr) {
            const int tid = track_.emplace(e.channel, static_cast<int>(track_.size()) + 1).first->second;
            emit(e.what, "comm", start, d, tid, e.bytes);
        }
        clock += share * work;  // CPU: the collective's cycles come out of the compute's
    } else {
        const auto it = done_.find(e.id);
        if (it != done_.end()) {
            clock = std::max(clock, it->second);
            done_.erase(it);  // a collective is waited for once
        }
    }
    (optimizer ? r_.optimizer : r_.exposed_comm) += clock - before;
}

StepTime StepTimer::result() const {
    StepTime r = r_;
    for (size_t p = 0; p < part_seconds_.size(); ++p) {
        if (part_seconds_[p] > 0.0) r.parts[step_part_order()[p]] = part_seconds_[p];
    }
    if (uploads_end_ > r.total) r.optimizer += uploads_end_ - r.total, r.total = uploads_end_;
    return r;
}

StepTime predict_step_time(const DryRunStep& step, const Hardware& hw, const Calibration* cal, bool bf16,
                           double slowdown, Json* trace, int pid) {
    StepTimer timer(hw, cal, bf16, slowdown, trace, pid);
    for (size_t i = 0; i < step.events.size(); ++i) timer.add(step.events[i], i >= step.optimizer_begin);
    return timer.result();
}

}  // namespace trainer
