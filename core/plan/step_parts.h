// The parts of a training step (bench-kernels' measured "where a step's time goes" and `trainer plan`'s predicted
// one): each op call is put in a part by the model's trace spans around it and by the op itself.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace trainer {

// What a trace span (base/trace.h) of the step says of the ops inside it, from its category ("forward",
// "backward", "recompute", "optimizer", ...) and name ("forward block.3", "head forward+backward", ...).
enum class StepSpan { kOther, kEmbedding, kBlock, kHead, kOptimizer };
StepSpan step_span(std::string_view category, std::string_view name);

// The open spans of a thread, innermost last; `where` is the innermost that says something (kOther where none).
class StepSpans {
   public:
    void begin(std::string_view category, std::string_view name) { open_.push_back(step_span(category, name)); }
    void end() {
        if (!open_.empty()) open_.pop_back();
    }
    StepSpan where() const {
        for (auto s = open_.rbegin(); s != open_.rend(); ++s) {
            if (*s != StepSpan::kOther) return *s;
        }
        return StepSpan::kOther;
    }

   private:
    std::vector<StepSpan> open_;
};

// The part an op call belongs to, from where it is called and the op (a Backend member, or a dry backend's cost
// name): "embedding"; in a block, "Linear layers" (its GEMMs, bf16 or FP8, with FP8's operand casts), "attention"
// (with RoPE and the shared heads' expansion), "LoRA adapters", "copies and casts" (gathered units unpacked, weights
// cast for the GEMMs) or "norms and pointwise ops" (the rest: norms, activations, residual adds); "head and loss"
// (the final norm, the LM head's GEMMs, the loss); "optimizer" (the gradient norm and AdamW, which bench-kernels'
// step runs outside any span); or "other". One of step_part_order's strings; step_part_index its index there.
size_t step_part_index(StepSpan where, std::string_view op);
const std::string& step_part(StepSpan where, std::string_view op);

// Every part step_part gives, in the order a step runs them (the order their tables print in).
const std::vector<std::string>& step_part_order();

// `seconds` of each part as "name share%" items of their share of `total`, in step_part_order, joined by "; ".
std::string describe_step_parts(const std::map<std::string, double>& seconds, double total);

}  // namespace trainer
