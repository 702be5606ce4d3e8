// The parts of a training step (see step_parts.h).
#include "core/plan/step_parts.h"

#include "base/common.h"

namespace trainer {

StepSpan step_span(std::string_view category, std::string_view name) {
    if (category == "optimizer") return StepSpan::kOptimizer;
    if (name.find("embedding") != std::string_view::npos) return StepSpan::kEmbedding;
    if (name.find("head") != std::string_view::npos) return StepSpan::kHead;
    if (name.find("block.") != std::string_view::npos) return StepSpan::kBlock;
    return StepSpan::kOther;
}

namespace {

// The parts, in step_part_order's order: each one's index there.
enum Part : size_t { kEmbedding, kLinear, kAttention, kPointwise, kLora, kCopies, kHead, kOptimizer, kOther };

}  // namespace

const std::vector<std::string>& step_part_order() {
    static const std::vector<std::string> order = {
        "embedding",     "Linear layers", "attention", "norms and pointwise ops", "LoRA adapters", "copies and casts",
        "head and loss", "optimizer",     "other"};
    return order;
}

size_t step_part_index(StepSpan where, std::string_view op) {
    const auto starts = [op](std::string_view prefix) { return op.substr(0, prefix.size()) == prefix; };
    switch (where) {
        case StepSpan::kEmbedding:
            return kEmbedding;
        case StepSpan::kHead:
            return kHead;
        case StepSpan::kOptimizer:
            return kOptimizer;
        case StepSpan::kBlock:
            if (starts("matmul_") || op == "fp8_cast") return kLinear;
            if (starts("attention_") || starts("rope_") || starts("kv_heads_")) return kAttention;
            if (starts("lora_")) return kLora;
            if (starts("cast_") || starts("copy") || op == "round_to_bf16" || op == "fill_zero" || op == "sum" ||
                op == "scale_inplace")
                return kCopies;
            return kPointwise;
        case StepSpan::kOther:
            break;
    }
    return starts("adamw_") || starts("squared_norm") ? kOptimizer : kOther;
}

const std::string& step_part(StepSpan where, std::string_view op) {
    return step_part_order()[step_part_index(where, op)];
}

std::string describe_step_parts(const std::map<std::string, double>& seconds, double total) {
    std::vector<std::string> items;
    for (const std::string& part : step_part_order()) {
        const auto at = seconds.find(part);
        if (at != seconds.end() && total > 0.0) {
            items.push_back(fmt::format("{} {:.1f}%", part, 100.0 * at->second / total));
        }
    }
    return fmt::format("{}", fmt::join(items, "; "));
}

}  // namespace trainer
