// FLOPs per token and the metrics file (see metrics.h).
#include "core/metrics.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "base/common.h"

namespace trainer {

double flops_per_token(const ModelConfig& m, const ParamLayout& layout) {
    const double T = m.max_sequence_length - 1;
    return 6.0 * static_cast<double>(layout.matmul_numel()) + 12.0 * m.n_layers * m.d_model * T;
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
    }
    const std::string line = record.dump() + "\n";
    std::fwrite(line.data(), 1, line.size(), f_);
    std::fflush(f_);
}

}  // namespace trainer
