// FLOPs per token and the metrics file (see metrics.h).
#include "core/metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "base/common.h"
#include "base/files.h"

namespace trainer {

double flops_per_token(const ModelConfig& m, const ParamLayout& layout) {
    const double T = m.predicted_positions();
    const double attention = 12.0 * m.n_layers * m.d_model * T;
    if (!layout.has_adapters()) return 6.0 * static_cast<double>(layout.matmul_numel()) + attention;
    // LoRA: the frozen base's backward computes input gradients only (2 of its 6 FLOPs a parameter are skipped).
    const double adapters = static_cast<double>(layout.trainable_numel());
    return 4.0 * (static_cast<double>(layout.matmul_numel()) - adapters) + 6.0 * adapters + attention;
}

double lower_median(std::vector<double> values) {
    if (values.empty()) return 0.0;
    std::sort(values.begin(), values.end());
    return values[(values.size() - 1) / 2];
}

std::vector<int> find_stragglers(const std::vector<double>& compute_per_rank, double factor) {
    if (compute_per_rank.size() < 2) return {};
    const double median = lower_median(compute_per_rank);
    std::vector<int> slow;
    if (!(median > 0.0)) return slow;
    for (size_t r = 0; r < compute_per_rank.size(); ++r)
        if (compute_per_rank[r] > factor * median) slow.push_back(static_cast<int>(r));
    std::stable_sort(slow.begin(), slow.end(), [&](int a, int b) { return compute_per_rank[a] > compute_per_rank[b]; });
    return slow;
}

MetricsWriter::MetricsWriter(const std::optional<std::string>& path, bool append) : append_(append) {
    if (!path) return;
    path_ = *path;
    // Checked now, opened at the first record: a run that fails before its first step leaves an existing
    // metrics file as it was.
    const auto parent = std::filesystem::path(path_).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    const std::string dir = parent.empty() ? "." : parent.string();
    const bool exists = std::filesystem::exists(path_, ec);
    if (ec || (exists ? ::access(path_.c_str(), W_OK) : ::access(dir.c_str(), W_OK)) != 0) {
        user_error("metrics_file {}: cannot be written ({})", path_, std::strerror(errno ? errno : EACCES));
    }
}

MetricsWriter::~MetricsWriter() {
    if (f_) std::fclose(f_);
}

void MetricsWriter::write(const Json& record) {
    if (path_.empty()) return;
    if (!f_) {
        f_ = std::fopen(path_.c_str(), append_ ? "a" : "w");
        if (!f_) user_error("metrics_file {}: cannot be written ({})", path_, std::strerror(errno));
        std::fseek(f_, 0, SEEK_END);  // where a record starts, for the truncation below
    }
    const std::string line = record.dump() + "\n";
    // No record cut in half: the file ends with the last whole one, as a resumed run appends to it.
    if (const int e = append_whole(f_, line)) {
        user_error(
            "metrics_file {}: a record could not be written ({}); the run stops here, its checkpoints as "
            "they were",
            path_, std::strerror(e));
    }
}

}  // namespace trainer
