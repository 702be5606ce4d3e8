// The time model of `trainer plan`: a dry run's events (core/plan/plan.h) replayed on a clock. Each op takes its
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
#include "core/plan/plan.h"

namespace trainer {

struct Link {
    double bandwidth = 0.0;  // bytes/s each rank sends and receives (NCCL's bus bandwidth)
    double latency = 0.0;    // seconds per ring step
};

struct Hardware {
    std::string name, description;
    double bf16_flops = 0.0, fp32_flops = 0.0;  // dense peak of one device
    double bandwidth = 0.0;                     // device memory, bytes/s
    double memory_gib = 0.0;                    // device memory
    // Shares of the roofline that ops reach without a calibration: GEMMs, attention, the rest (memory-bound).
    double gemm_efficiency = 0.7, attention_efficiency = 0.5, memory_efficiency = 0.8;
    double op_overhead = 5e-6;   // seconds per op (a kernel launch)
    double gemm_overhead = 0.0;  // seconds more per GEMM op, whatever its size (see hopper() in step_time.cpp)
    double attention_efficiency_64 = 0.0;  // attention at heads of 64 (0: attention_efficiency at every size)
    Link intra, inter;                     // within a node, between nodes
    // Links measured per collective ("all_reduce", "reduce_scatter", "all_gather"; trainer bench-comm): where a
    // kind has one it takes the place of intra or inter for that kind.
    std::map<std::string, Link> intra_by_kind, inter_by_kind;
    // CPU offload: the link between a GPU and host memory (pinned copies each way, one at a time: the
    // backend's copy stream), and the rate one rank's host optimizer streams host memory at (the node's
    // host memory bandwidth shared by its GPUs, at the share such loops reach). 0: none (the CPU, where
    // host memory is the device's: its copies and host ops cost what the device's do).
    Link host_link;
    double host_bandwidth = 0.0;
    double comm_compute_share = 0.0;  // CPU: the share of the cores a collective takes from the compute (< 1)
    int cores = 0;                    // CPU: cores the node's ranks share (their threads beyond it slow every op)
};

// The share of the peak attention reaches at heads of `head_size`: the entry's attention_efficiency at 128 and
// above, its attention_efficiency_64 at 64 and below, geometric in between.
double attention_efficiency_at(const Hardware& hw, int head_size);

// The link a collective of `kind` takes: its measured one where the entry has it, else intra or inter.
const Link& link_for(const Hardware& hw, const std::string& kind, bool spans_nodes);

// A ring collective's cost on a link: `steps` latencies, and `bytes` that each rank sends (and receives) at the
// link's bandwidth. `bytes` is the call's as a dry run reports it (core/plan/plan.h): a reduce-scatter's or
// all-gather's shard, an all-reduce's or broadcast's buffer. A reduce-scatter or all-gather moves n-1 shards in
// n-1 steps, an all-reduce is both (2(n-1)/n of its buffer in 2(n-1) steps), a broadcast forwards its buffer
// along n-1 steps, a barrier takes log2(n) latencies.
struct RingCost {
    double steps = 0.0, bytes = 0.0;
};
RingCost ring_cost(const std::string& kind, double bytes, int group_size);

// The built-in entries (h100-sxm, h200, a100-40gb, a100-80gb, a100-40gb-pcie, cpu: this machine) and their names.
const Hardware* find_hardware(const std::string& name);
std::string hardware_names();
// The entry of a GPU as its driver names it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", ...); nullptr for
// a GPU without one (H100 PCIe and NVL, H200 NVL, A100 80GB PCIe, any other).
const Hardware* hardware_for_gpu(const std::string& device_name);

// Measured op times (trainer bench-kernels --calibration-out): each op's FLOPs, bytes and seconds.
struct Calibration {
    struct Entry {
        std::string op;
        double flops = 0.0, bytes = 0.0, seconds = 0.0;
    };
    std::vector<Entry> entries;
    double bandwidth = 0.0;   // the device's measured copy bandwidth (ops the file does not have)
    double peak_flops = 0.0;  // the device's peak as the benchmark's MFU counted it
    double step_scale = 1.0;  // a real step's time over the sum of its ops measured alone
    int threads = 0;          // threads the ops were measured with (CPU)
    int ranks_per_node = 1;   // ranks that measured at the same time on the node (bench-kernels under a launcher)
    std::string path;
};
Calibration read_calibration(const std::string& path);

// Links measured by trainer bench-comm --calibration-out: per group ("intra": within a node, "inter": a group
// spanning nodes) and collective kind, a bandwidth (bytes/s, the bus bandwidth) and a latency per ring step,
// fitted to ring_cost over the measured sizes; with the world they were measured on.
struct CommCalibration {
    std::map<std::string, Link> intra, inter;  // by kind; empty: that group was not measured
    std::string collectives;                   // "gloo" or "nccl"
    int world_size = 0, nnodes = 0;
    std::string path;
};
CommCalibration read_comm_calibration(const std::string& path);
// The measured links in place of the entry's, for each group the file has: each kind's own, and the
// all-reduce's as the link of the rest (broadcast, barrier).
void apply_comm_calibration(Hardware& hw, const CommCalibration& c);

struct StepTime {
    double total = 0.0;         // seconds of one optimizer step
    double compute = 0.0;       // the ops of forward and backward
    double exposed_comm = 0.0;  // the compute clock waiting for collectives (and, on a CPU, their cycles)
    double optimizer = 0.0;     // the optimizer step's ops and its waits
};

// The time model, fed a step's events in order (dry_run_step streams them, so a step of a thousand
// micro-batches is never held in memory): ops on the compute clock at their calibrated or roofline times,
// collectives queued on their communicator's link, waits where the strategy waits. `slowdown` multiplies
// every op's time (CPU ranks sharing cores beyond their count). With `trace`, the predicted step is
// appended to it as Chrome trace events (the step's spans on the compute track, each collective on its
// communicator's track), process `pid`.
class StepTimer {
   public:
    StepTimer(const Hardware& hw, const Calibration* calibration, bool bf16, double slowdown = 1.0,
              Json* trace = nullptr, int pid = 0);
    // The next event of the step; `optimizer`: it belongs to the optimizer step.
    void add(const StepEvent& e, bool optimizer);
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
