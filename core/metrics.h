// Throughput accounting: FLOPs per token, device peak (detected or measured), MFU, and the run's
// console and JSON-lines output.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "base/config.h"
#include "base/layout.h"

namespace trainer {

// Training FLOPs per predicted token: 6N + 12 * n_layers * d_model * T (PaLM / llm.c accounting; N is
// layout.matmul_numel(): the LM head counts, embedding lookups do not).
double flops_per_token(const ModelConfig& m, const ParamLayout& layout);

struct PeakFlops {
    double flops = 0.0;
    std::string how;  // the formula or the source, printed next to MFU
};
// Dense fp32 peak of `threads` CPU cores: cores x clock x FLOP/cycle from /proc/cpuinfo (vector width and
// FMA units of the detected ISA), or the configured peak_flops_per_device.
PeakFlops cpu_peak_flops(int threads, const std::optional<double>& configured);
// Core clock in Hz measured with a chain of dependent integer adds (one per cycle); 0 where unsupported.
double measure_clock_hz();
// Measures the fp32 FMA throughput of `threads` threads for about `seconds` (independent FMA chains on the
// widest vectors this build targets): the practical peak of this machine.
double measure_fma_peak(int threads, double seconds);

// One JSON object per line, flushed after each, so a killed run leaves whole lines.
class MetricsWriter {
   public:
    explicit MetricsWriter(const std::optional<std::string>& path, bool append);
    ~MetricsWriter();
    void write(const Json& record);

   private:
    std::string path_;
    bool append_ = false;
    std::FILE* f_ = nullptr;
};

}  // namespace trainer
