// The CPU's MFU denominator (kernels/cpu/machine.h): the peak the formula reports (cores x clock x FLOP a cycle)
// against the FMA rate the same cores reach, measured.
#include <algorithm>

#include "kernels/cpu/machine.h"
#include "test_util.h"

TEST_CASE("cpu peak: the reported fp32 peak is within 2x of the measured FMA rate on one core") {
    // The formula's clock comes from a chain of dependent multiplies and its FLOP a cycle from the FMA rate over
    // that clock, rounded to whole pipes: a clock read wrong (a chain the core folds) or pipes counted wrong
    // moves it away from what the FMAs do. Best of a few measurements of each, so a busy moment elsewhere on a
    // shared machine slows one and not the result.
    if (test_util::sanitized) {
        WARN("skipped: a sanitizer build's FMA loops run instrumented, far below the cores' rate");
        return;
    }
    double measured = 0.0, reported = 0.0;
    for (int trial = 0; trial < 3; ++trial) {
        measured = std::max(measured, trainer::measure_fma_peak(1, 0.1));
        reported = std::max(reported, trainer::cpu_peak_flops(1).flops);
    }
    INFO(trainer::cpu_peak_flops(1).how << "; measured FMA rate " << measured / 1e9 << " GFLOP/s");
    CHECK(reported < 2.0 * measured);
    CHECK(reported > 0.5 * measured);
}

TEST_CASE("cpu peak: the measured clock is near the clock the kernel reports") {
    // /proc/cpuinfo's "cpu MHz" is the nominal or current clock; cores boost above it, by less than 2x on every
    // x86 server and desktop part, and a virtual machine's is the host's.
    const double mhz = trainer::cpuinfo_clock_hz() / 1e6;
    const double hz = trainer::measure_clock_hz();
    if (mhz <= 0.0 || hz <= 0.0) {
        WARN("skipped: no cpu MHz in /proc/cpuinfo or no clock measurement on this architecture");
        return;
    }
    INFO("measured " << hz / 1e9 << " GHz, /proc/cpuinfo " << mhz / 1e3 << " GHz");
    CHECK(hz > 0.6 * mhz * 1e6);
    CHECK(hz < 2.0 * mhz * 1e6);
}
