// The hardware a plan predicts for: one GPU's (or this CPU's) peaks and memory, the shares of its roofline the
// ops reach without a calibration, and the links between ranks and to host memory. Entries are data,
// configs/hardware/<name>.json (where each number comes from: docs/plan.md), read at run time; a user copies
// one and edits it for a machine without an entry.
#pragma once

#include <map>
#include <string>

namespace trainer {

struct Link {
    double bandwidth = 0.0;  // bytes/s each rank sends and receives (NCCL's bus bandwidth)
    double latency = 0.0;    // seconds per ring step
};

struct Hardware {
    std::string name, description;
    std::string path;                           // the file it was read from
    double bf16_flops = 0.0, fp32_flops = 0.0;  // dense peak of one device
    double fp8_flops = 0.0;                     // its dense FP8 peak (0: no FP8, before compute capability 8.9)
    double bandwidth = 0.0;                     // device memory, bytes/s
    double memory_gib = 0.0;                    // device memory
    // Shares of the roofline that ops reach without a calibration: GEMMs, attention, the rest (memory-bound).
    double gemm_efficiency = 0.7, attention_efficiency = 0.5, memory_efficiency = 0.8;
    double op_overhead = 5e-6;             // seconds per op (a kernel launch)
    double gemm_overhead = 0.0;            // seconds more per GEMM op, whatever its size (docs/plan.md)
    double attention_efficiency_64 = 0.0;  // attention at heads of 64 (0: attention_efficiency at every size)
    Link intra, inter;                     // within a node, between nodes
    // The links a node has to the others, shared by its ranks' concurrent collectives across nodes (one NIC a
    // node); 0: each rank has its own (a NIC a GPU, as on InfiniBand GPU nodes), nothing shared.
    int inter_node_links = 0;
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

// The folder of the hardware files: configs/hardware of an installed trainer or of the source tree.
std::string hardware_dir();
// An entry by name (hardware_dir()/<name>.json) or by path (a name with a '/' or ending in .json), read once
// and kept; nullptr for a name without a file. A file that cannot be read or holds a bad field is a
// UserError naming the file and the field.
const Hardware* find_hardware(const std::string& name_or_path);
// The names of hardware_dir()'s entries, comma-separated.
std::string hardware_names();
// The entry of a GPU as its driver names it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", ...), from the
// entries' gpu_names (every word of "all" in the name, none of "none"); nullptr for a GPU without one.
const Hardware* hardware_for_gpu(const std::string& device_name);

}  // namespace trainer
