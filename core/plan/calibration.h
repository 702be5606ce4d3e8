// Measured inputs of the time model: op times (trainer bench-kernels --calibration-out) and links
// (trainer bench-comm --calibration-out).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/plan/hardware.h"

namespace trainer {

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
    int cores = 0;            // CPU: the cores of the machine that measured them (0: not recorded)
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

}  // namespace trainer
