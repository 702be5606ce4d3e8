// What a training run shows while it runs: counts in K/M/B, the progress bar, every rank's peak memory (the
// metrics records' peak_memory_bytes_per_rank) and the trace file of each rank.
#pragma once

#include <string>

#include "base/json.h"
#include "base/memory.h"

namespace trainer {

class Backend;
class Communicator;

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

// Where rank `rank` of `world` writes its trace: `path` itself for one rank, else path with ".rank<r>" before its
// extension.
std::string trace_path(const std::string& path, int rank, int world);

}  // namespace trainer
