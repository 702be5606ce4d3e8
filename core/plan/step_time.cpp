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

// Dense peaks and memory bandwidth from the vendors' spec sheets; link bandwidths are what NCCL's ring
// reaches (its bus bandwidth), NVLink within a node and one InfiniBand port per GPU between nodes.
Hardware gpu(const char* name, const char* description, double bf16, double fp32, double bandwidth, double gib,
             Link intra, Link inter) {
    Hardware h;
    h.name = name, h.description = description, h.bf16_flops = bf16, h.fp32_flops = fp32;
    h.bandwidth = bandwidth, h.memory_gib = gib, h.intra = intra, h.inter = inter;
    return h;
}

// The shares of the roofline this trainer's kernels reached on an H100 (trainer bench-kernels, OLMo-1B
// micro-batch 4, amp_bf16, cuDNN attention, commit 6deb299, docs/benchmarks.md; each the roofline time
// over the measured time, summed over a step's ops of the kind): the GEMMs 0.72 of the dense bf16 peak
// (the blocks' 0.73, the LM head's 0.66), cuDNN's attention 0.38 (forward 0.49, backward 0.34; GPT-2's
// heads of 64 reach less), the memory-bound ops 0.75 of the bandwidth (AdamW 0.89, SwiGLU 0.90, RoPE
// 0.80, LayerNorm 0.45-0.58, the norm's reduction 0.35). At 6aa9af3, with fp32 gradients and a cast per
// GEMM operand, they were 0.58, 0.23 and 0.67. The other GPUs keep the generic shares until measured.
//
// A GEMM op also costs a fixed 20 us beyond its FLOPs at that share and the 5 us every op pays (fitted on an
// H100, 2026-11-26, commit 3683599, to bench-kernels' 20 GEMM rows of OLMo-1B micro-batch 4 and GPT-2 124M
// micro-batch 16, 19 to 1,687 GFLOP an op: each within -38% to +21% of the fit, the sum of squared log errors
// 0.42, against -54% to +10% and 0.92 without it). It stands for what an op does beside its product (the
// weight's cast to bf16, the bias gradient's pass, an fp32 gradient's accumulation) and a grid's last wave,
// which the roofline's max(FLOPs, bytes) leaves out; small models' GEMMs pay it most (GPT-2's ran at 0.31-0.71
// of the peak, OLMo-1B's at 0.61-0.79).
Hardware hopper(Hardware h) {
    h.gemm_efficiency = 0.72, h.attention_efficiency = 0.38, h.memory_efficiency = 0.75;
    h.gemm_overhead = 20e-6;
    // cuDNN's attention at heads of 64 (GPT-2 124M micro-batch 16 on the H100 of 2026-11-26: 90 GFLOP forward
    // and backward in 419 us, 0.22 of the peak; OLMo-1B's heads of 128 in the same run: 0.38, the share above).
    // Per score the softmax costs the same at either size and the products half as much at 64, so less of the
    // time is tensor work.
    h.attention_efficiency_64 = 0.22;
    return h;
}

const std::vector<Hardware>& table() {
    static const std::vector<Hardware> t = [] {
        const Link nvlink4{360e9, 10e-6}, nvlink3{230e9, 10e-6}, pcie4{20e9, 15e-6}, ib400{45e9, 20e-6},
            ib200{22e9, 20e-6};
        // CPU offload's side: the GPU's own PCIe x16 link to host memory, where pinned copies reach about
        // 80% of the 64 GB/s (PCIe 5.0) or 32 GB/s (4.0) a direction; and the host's memory per GPU, a DGX
        // node's (Hopper: two Xeon 8480C, 16 channels of DDR5-4800, 614 GB/s; Ampere: two EPYC 7742, 16
        // channels of DDR4-3200, 410 GB/s) over its 8 GPUs, at 70% of it (what streaming loops reach).
        const Link pcie5_host{50e9, 10e-6}, pcie4_host{25e9, 10e-6};
        const double hopper_host = 0.7 * 614e9 / 8, ampere_host = 0.7 * 410e9 / 8;
        const auto host = [](Hardware h, Link link, double bandwidth) {
            h.host_link = link, h.host_bandwidth = bandwidth;
            return h;
        };
        std::vector<Hardware> v = {
            host(hopper(gpu("h100-sxm", "NVIDIA H100 SXM 80 GB, NVLink 4, 400 Gb/s InfiniBand per GPU", 989e12, 67e12,
                            3.35e12, 79.6, nvlink4, ib400)),
                 pcie5_host, hopper_host),
            host(hopper(gpu("h200", "NVIDIA H200 141 GB, NVLink 4, 400 Gb/s InfiniBand per GPU", 989e12, 67e12, 4.8e12,
                            139.8, nvlink4, ib400)),
                 pcie5_host, hopper_host),
            host(gpu("a100-40gb", "NVIDIA A100 SXM 40 GB, NVLink 3, 200 Gb/s InfiniBand per GPU", 312e12, 19.5e12,
                     1.555e12, 39.4, nvlink3, ib200),
                 pcie4_host, ampere_host),
            host(gpu("a100-80gb", "NVIDIA A100 SXM 80 GB, NVLink 3, 200 Gb/s InfiniBand per GPU", 312e12, 19.5e12,
                     2.039e12, 79.2, nvlink3, ib200),
                 pcie4_host, ampere_host),
            // No NVLink: the GPUs of a node talk over PCIe 4.0 x16 through the host's bridges, where NCCL's ring
            // reaches about 20 GB/s of bus bandwidth (nccl-tests all_reduce_perf across PCIe host bridges,
            // NVIDIA/nccl-tests#178), a tenth of NVLink 3's.
            host(gpu("a100-40gb-pcie",
                     "NVIDIA A100 PCIe 40 GB, no NVLink (PCIe 4.0 between GPUs), 200 Gb/s InfiniBand per GPU", 312e12,
                     19.5e12, 1.555e12, 39.4, pcie4, ib200),
                 pcie4_host, ampere_host),
        };
        // This kind of machine (the CPU backend over Gloo on loopback): ops come from a calibration. The link
        // is Gloo's on loopback with the cores to itself, 1.4 GB/s and 50 us a ring step (trainer bench-comm on
        // 2 ranks measures 1.55-1.96 GB/s); beside the compute it shares the cores (comm_compute_share): half
        // the speed, about the 0.7 GB/s a trace of 2 ranks of cpu_bench showed, and half its time taken from
        // the compute.
        Hardware cpu;
        cpu.name = "cpu", cpu.description = "this machine's CPU cores, Gloo over loopback (ops: --calibration)";
        cpu.op_overhead = 0.0, cpu.intra = {1.4e9, 50e-6}, cpu.inter = cpu.intra;
        cpu.comm_compute_share = 0.5;
        cpu.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        v.push_back(cpu);
        return v;
    }();
    return t;
}

// Seconds of one collective over `link` (ring_cost).
double collective_seconds(const StepEvent& e, const Link& link) {
    if (e.group_size <= 1 || link.bandwidth <= 0.0) return 0.0;
    const RingCost c = ring_cost(e.what, e.bytes, e.group_size);
    return c.bytes / link.bandwidth + c.steps * link.latency;
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

const Link& link_for(const Hardware& hw, const std::string& kind, bool spans_nodes) {
    const auto& measured = spans_nodes ? hw.inter_by_kind : hw.intra_by_kind;
    const auto it = measured.find(kind);
    return it != measured.end() ? it->second : spans_nodes ? hw.inter : hw.intra;
}

double attention_efficiency_at(const Hardware& hw, int head_size) {
    if (hw.attention_efficiency_64 <= 0.0 || head_size >= 128) return hw.attention_efficiency;
    const double halvings = std::log2(128.0 / std::max(head_size, 64));  // 0 at 128, 1 at 64
    return hw.attention_efficiency * std::pow(hw.attention_efficiency_64 / hw.attention_efficiency, halvings);
}

const Hardware* find_hardware(const std::string& name) {
    for (const Hardware& h : table()) {
        if (h.name == name) return &h;
    }
    return nullptr;
}

const Hardware* hardware_for_gpu(const std::string& device_name) {
    // Every word of `all` in the name and none of `none`, first match wins.
    struct Rule {
        std::vector<const char*> all, none;
        const char* entry;
    };
    static const Rule rules[] = {{{"H100"}, {"PCIe", "NVL"}, "h100-sxm"},
                                 {{"H200"}, {"NVL"}, "h200"},
                                 {{"A100", "SXM4-40GB"}, {}, "a100-40gb"},
                                 {{"A100", "SXM4-80GB"}, {}, "a100-80gb"},
                                 {{"A100", "PCIE-40GB"}, {}, "a100-40gb-pcie"}};
    const auto has = [&](const char* word) { return device_name.find(word) != std::string::npos; };
    for (const Rule& r : rules) {
        if (std::all_of(r.all.begin(), r.all.end(), has) && std::none_of(r.none.begin(), r.none.end(), has)) {
            return find_hardware(r.entry);
        }
    }
    return nullptr;
}

std::string hardware_names() {
    std::string out;
    for (const Hardware& h : table()) out += (out.empty() ? "" : ", ") + h.name;
    return out;
}

Calibration read_calibration(const std::string& path) {
    const Json j = read_json_file(path, "calibration");
    if (j.value("format", "") != "trainer-calibration" || !j.contains("ops") || !j["ops"].is_array()) {
        user_error("calibration {}: not a file of trainer bench-kernels --calibration-out", path);
    }
    Calibration c;
    c.path = path;
    c.bandwidth = j.value("bandwidth", 0.0);
    c.peak_flops = j.value("peak_flops", 0.0);
    c.step_scale = j.value("step_scale", 1.0);
    c.threads = j.value("threads", 0);
    c.ranks_per_node = j.value("ranks_per_node", 1);
    if (c.ranks_per_node < 1) user_error("calibration {}: ranks_per_node: expected at least 1", path);
    for (const Json& e : j["ops"]) {
        Calibration::Entry entry{e.value("op", ""), e.value("flops", 0.0), e.value("bytes", 0.0),
                                 e.value("seconds", 0.0)};
        if (entry.op.empty() || entry.seconds <= 0.0 || (entry.flops <= 0.0 && entry.bytes <= 0.0)) {
            user_error("calibration {}: an entry without an op, its work or a positive time: {}", path, e.dump());
        }
        c.entries.push_back(entry);
    }
    return c;
}

CommCalibration read_comm_calibration(const std::string& path) {
    const Json j = read_json_file(path, "comm calibration");
    if (!j.is_object() || j.value("format", "") != "trainer-comm-calibration" || !j.contains("links") ||
        !j["links"].is_object()) {
        user_error("comm calibration {}: not a file of trainer bench-comm --calibration-out", path);
    }
    CommCalibration c;
    c.path = path;
    // The world it was measured on (bench-comm writes them; a file written by hand may leave them out).
    const auto count = [&](const char* key) {
        if (!j.contains(key)) return 0;
        if (!j[key].is_number_integer() || j[key].get<int64_t>() < 1 || j[key].get<int64_t>() > 1 << 24) {
            user_error("comm calibration {}: {}: expected a positive integer, got {}", path, key, j[key].dump());
        }
        return j[key].get<int>();
    };
    c.world_size = count("world_size");
    c.nnodes = count("nnodes");
    if (j.contains("collectives")) {
        if (!j["collectives"].is_string() ||
            (j["collectives"].get<std::string>() != "gloo" && j["collectives"].get<std::string>() != "nccl")) {
            user_error("comm calibration {}: collectives: expected \"gloo\" or \"nccl\", got {}", path,
                       j["collectives"].dump());
        }
        c.collectives = j["collectives"].get<std::string>();
    }
    for (const auto& [group, kinds] : j["links"].items()) {
        if (group != "intra" && group != "inter") {
            user_error("comm calibration {}: links.{}: unknown group; expected intra or inter", path, group);
        }
        if (!kinds.is_object())
            user_error("comm calibration {}: links.{}: expected an object of collectives", path, group);
        auto& links = group == "intra" ? c.intra : c.inter;
        for (const auto& [kind, l] : kinds.items()) {
            if (kind != "all_reduce" && kind != "reduce_scatter" && kind != "all_gather") {
                user_error(
                    "comm calibration {}: links.{}.{}: unknown collective; expected all_reduce, reduce_scatter "
                    "or all_gather",
                    path, group, kind);
            }
            const Json* bw = l.is_object() && l.contains("bandwidth_gbs") ? &l["bandwidth_gbs"] : nullptr;
            const Json* lat = l.is_object() && l.contains("latency_us") ? &l["latency_us"] : nullptr;
            if (bw == nullptr || !bw->is_number() || bw->get<double>() <= 0.0 || lat == nullptr || !lat->is_number() ||
                lat->get<double>() < 0.0) {
                user_error(
                    "comm calibration {}: links.{}.{}: expected {{\"bandwidth_gbs\": a positive number, "
                    "\"latency_us\": a number >= 0}}, got {}",
                    path, group, kind, l.dump());
            }
            links[kind] = Link{bw->get<double>() * 1e9, lat->get<double>() * 1e-6};
        }
        if (!links.empty() && links.count("all_reduce") == 0) {
            user_error("comm calibration {}: links.{}: has no all_reduce (the link of the collectives not measured)",
                       path, group);
        }
    }
    if (c.intra.empty() && c.inter.empty()) user_error("comm calibration {}: links: no group measured", path);
    return c;
}

void apply_comm_calibration(Hardware& hw, const CommCalibration& c) {
    if (!c.intra.empty()) hw.intra = c.intra.at("all_reduce"), hw.intra_by_kind = c.intra;
    if (!c.inter.empty()) hw.inter = c.inter.at("all_reduce"), hw.inter_by_kind = c.inter;
}

StepTimer::StepTimer(const Hardware& hw, const Calibration* calibration, bool bf16, double slowdown, Json* trace,
                     int pid)
    : hw_(hw),
      cal_(calibration),
      peak_(bf16 ? hw.bf16_flops : hw.fp32_flops),
      slowdown_(slowdown),
      trace_(trace),
      pid_(pid) {}

double StepTimer::op_seconds(const StepEvent& e) const {
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
        // An op the file has not: a copy's speed.
        if (cal_->bandwidth > 0.0) return cal_->step_scale * e.bytes / cal_->bandwidth;
    }
    // CPU offload's optimizer: memory-bound loops over host memory (no calibration: it measures the device).
    if (e.on_host && hw_.host_bandwidth > 0.0) return e.bytes / hw_.host_bandwidth;
    const bool gemm = std::strncmp(e.what, "matmul", 6) == 0, attention = std::strncmp(e.what, "attention", 9) == 0;
    const double eff = gemm ? hw_.gemm_efficiency : attention ? hw_.attention_efficiency : 1.0;
    const double t_flops = peak_ > 0.0 ? e.flops / (peak_ * eff) : 0.0;
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
        if (trace_ != nullptr) open_.emplace_back(e.label, e.what, clock);
        return;
    }
    if (e.kind == StepEvent::kSpanEnd) {
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
        // CPU: the collective shares the cores with the compute beside it, so it runs at (1 - share) of its
        // link's speed and takes `share` of its time from the compute.
        const double d = collective_seconds(e, link_for(hw_, e.what, e.spans_nodes)) / (1.0 - hw_.comm_compute_share);
        double& free = channel_free_[e.channel];
        const double start = std::max(clock, free);
        free = start + d;
        done_[e.id] = free;
        if (trace_ != nullptr) {
            const int tid = track_.emplace(e.channel, static_cast<int>(track_.size()) + 1).first->second;
            emit(e.what, "comm", start, d, tid, e.bytes);
        }
        clock += hw_.comm_compute_share * d;  // CPU: the collective's cycles come out of the compute's
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
