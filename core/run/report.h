// What a training run shows while it runs: counts in K/M/B, the progress bar, every rank's peak memory (the
// metrics records' peak_memory_bytes_per_rank) and the trace file of each rank.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "base/choices.h"
#include "base/json.h"
#include "base/memory.h"

namespace trainer {

class Backend;
class Communicator;
class ParamLayout;
struct TrainConfig;

// 1.18B, 124.44M, 8.2K, 512.
std::string human_count(double x);

// A bar and the remaining time on the console's last line, redrawn after each step; clear() before printing a
// line. Drawn on a terminal only; mpirun hands its ranks a pseudo-terminal whatever its own output is (often a
// log file), so never under mpirun.
class ProgressBar {
   public:
    explicit ProgressBar(long total);
    void clear();
    void draw(long step, double eta_s);

   private:
    long total_;
    bool enabled_;
    bool drawn_ = false;
};

// Every rank's peak memory so far by category, plus the accounted device total, the host total (CPU
// offload), the measured peak resident memory, the backend's pool high-water mark (device memory on GPUs,
// the host pool on the CPU), and what no category counts: the device pool beyond the device total on GPUs
// (`on_device`), resident memory beyond both totals on the CPU (where the host categories live in the same
// memory). Gathered over `comm` (a collective: every rank calls it).
Json gather_peak_memory(Communicator& comm, const Backend& backend, bool on_device);

// "peak memory 5.9 MiB (params 0.6, grads 0.6, optimizer 1.2, activations 3.6)[, host ...], resident 19.6 MiB":
// this rank's peaks by category, for the run's closing line.
std::string peak_memory_text(const MemorySnapshot& mem);

// What a run's header says when it starts (print_run_header): the figures a run knows once it is built.
struct RunHeader {
    std::string run_name;
    size_t parameters = 0, matmul_parameters = 0, adapter_parameters = 0;  // adapters: 0 without LoRA
    int units = 0, layers = 0, d_model = 0, threads = 0;
    std::string strategy, device, compute, collectives;  // compute: the precision, attention kernel, CUDA graphs
    long instances = 0, sequence = 0, predicted = 0, steps = 0, global_batch = 0, micro_batch = 0, accumulation = 0;
    std::vector<std::string> notes;  // the data's warmup note, the downstream evaluators' description
    bool fp8_on_cpu = false;         // amp_fp8 emulated on the CPU
    bool lora_on_random_base = false;
    unsigned long long seed = 0;
    double flops_per_token = 0.0, peak_flops = 0.0;
    std::string peak_how;
    std::string offload;  // what CPU offload keeps in host memory, or ""
    double host_mib = 0.0;
    std::string gemms;  // the backend's GEMM library, or ""
};
// What the config, the layout and the backend say of it; the run fills in the rest.
RunHeader run_header(const TrainConfig& config, const ParamLayout& layout, const Backend& backend, Device device);
// Prints it (rank 0): the run, its data, its FLOP count and the MFU peak, its memory levers and GEMMs.
void print_run_header(const RunHeader& h);

// Where rank `rank` of `world` writes its trace: `path` itself for one rank, else path with ".rank<r>" before its
// extension.
std::string trace_path(const std::string& path, int rank, int world);

}  // namespace trainer
