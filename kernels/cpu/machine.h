// The CPU as a device: its compute threads, its clock and its dense fp32 peak, the CPU backend's MFU
// denominator (Backend::peak_flops). Clock and FMA pipes are measured rather than looked up: cpuinfo's
// clock is nominal (cores boost above it), and the pipes per core differ within one ISA (a Zen 4 runs
// AVX-512 on two 256-bit pipes, a Zen 5 on two 512-bit ones; some Xeons have one 512-bit FMA unit).
#pragma once

#include <string>

namespace trainer {

// Sets the OpenMP and BLAS thread counts (0: OMP_NUM_THREADS if set, e.g. the launcher's share of the
// cores, else one per available core); returns the count used.
int configure_threads(int threads);

// Core clock in Hz measured with a chain of dependent integer adds (one per cycle); 0 where unsupported.
double measure_clock_hz();

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
