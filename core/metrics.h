// Throughput accounting: FLOPs per token (the device's peak comes from its Backend) and the run's
// JSON-lines output.
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"

namespace trainer {

// Training FLOPs per predicted token: 6N + 12 * n_layers * d_model * T (PaLM / llm.c accounting; N is
// layout.matmul_numel(): the LM head counts, embedding lookups do not). With LoRA, 4 a frozen parameter (forward and
// input gradient: no weight gradient) and 6 an adapter's.
double flops_per_token(const ModelConfig& m, const ParamLayout& layout);

// Stragglers: the ranks whose compute time a step (the step less its waits on collectives, the same window on every
// rank) exceeds `factor` times the lower median of every rank's, slowest first. The lower median, so that of two
// ranks the slow one is measured against the other.
std::vector<int> find_stragglers(const std::vector<double>& compute_per_rank, double factor);
// The lower median: element (n - 1) / 2 of the sorted values (0 when there are none).
double lower_median(std::vector<double> values);

// One JSON object per line, flushed after each, so a killed run leaves whole lines.
class MetricsWriter {
   public:
    explicit MetricsWriter(const std::optional<std::string>& path, bool append);
    ~MetricsWriter();
    void write(const Json& record);
    // Whether write() writes anything (a path was given: rank 0 with metrics_file).
    bool writes() const { return !path_.empty(); }

   private:
    std::string path_;
    bool append_ = false;
    std::FILE* f_ = nullptr;
};

}  // namespace trainer
