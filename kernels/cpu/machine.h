// The CPU as a device: its compute threads, its clock and its dense fp32 peak, the CPU backend's MFU
// denominator (Backend::peak_flops). Clock and FMA pipes are measured rather than looked up: cpuinfo's
// clock is nominal (cores boost above it), and the pipes per core differ within one ISA (a Zen 4 runs
// AVX-512 on two 256-bit pipes, a Zen 5 on two 512-bit ones; some Xeons have one 512-bit FMA unit).
#pragma once

#include <string>

namespace trainer {

// Sets the run's thread count (0: OMP_NUM_THREADS if set, e.g. the launcher's share of the cores, else one per
// available core) and with it the GEMMs' partition (kernels/cpu/ops.h gemm); returns the count used.
int configure_threads(int threads);
// Changes the thread count only (>= 1), the partition kept, so the numbers stay the same bits; returns it.
int set_thread_count(int threads);

// The thread count that tracks the cores other processes leave (threads: 0 without OMP_NUM_THREADS).
// OpenMP's workers wait for each other at every parallel region's end; when another process takes a core,
// the one descheduled worker stalls all the others (a step 5-10x slower on a 2-core node with one busy
// process, the waiting workers spinning). Sampled at most every half second of wall time: the cores this
// process received (its CPU time over the wall time) plus the idle time of the cores it may run on
// (/proc/stat, within its affinity mask) is what it can use; the count follows that, between 1 and the
// starting count, when two samples in a row agree. The CPU kernels give the same bits on any thread count (the
// GEMMs' tiles stay those of the starting count), so a change does not change the numbers.
class ThreadGovernor {
   public:
    explicit ThreadGovernor(int max_threads);
    // Called between steps: the new thread count when it changed (configure_threads applied), else 0.
    int poll();
    int threads() const { return threads_; }

   private:
    bool sample(double* own_cores, double* idle_cores);
    int max_threads_, threads_, pending_ = 0;
    double last_wall_ = 0.0, last_cpu_ = 0.0, last_idle_ = 0.0;
};

// Core clock in Hz measured with a chain of dependent 64-bit integer multiplies: 3 cycles each on every x86-64
// core since Intel's Nehalem and AMD's Zen (Agner Fog's instruction tables), with a run-time operand no renamer
// folds. (A chain of dependent immediate adds is not one add a cycle: Intel cores since Golden Cove fold such
// chains and run them several times faster, which read as a clock of 10-20 GHz.) 0 where unsupported.
double measure_clock_hz();

// The largest "cpu MHz" of /proc/cpuinfo in Hz (nominal or current, not boosted); 0 where there is none.
double cpuinfo_clock_hz();

// fp32 FMA throughput (FLOP/s) of `threads` threads over about `seconds`: independent FMA chains on the
// widest vectors the CPU has (chosen at run time, whatever the build targets). The practical peak.
double measure_fma_peak(int threads, double seconds);

struct CpuPeak {
    double flops = 0.0;
    std::string how;  // the formula, printed next to MFU
};
// Dense fp32 peak of `threads` cores: threads x clock x FLOP/cycle, where FLOP/cycle = 2 (FMA) x the
// lanes of the widest vector ISA x the FMA pipes per core, the pipes (1 or 2) from a short one-core
// measurement of the FMA rate per cycle.
CpuPeak cpu_peak_flops(int threads);

}  // namespace trainer
