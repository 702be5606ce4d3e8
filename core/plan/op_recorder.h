// The compute ops of a real training step, as the step issues them: a backend that forwards every call to another
// (kernels/forwarding_backend.h) and records each compute op it passes on, keyed by the op and its shape, with its
// FLOPs and bytes (the dry backend's cost model), how many times the step ran it and, where it is given a timer, how
// long one call takes on the backend it forwards to. bench-kernels times a step's ops this way, so its rows are the
// model's own sequence: a new op, or an op the model starts to call at another shape, has its row without anyone
// writing one.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/config.h"
#include "base/trace.h"
#include "core/plan/step_parts.h"
#include "kernels/backend.h"
#include "kernels/forwarding_backend.h"

namespace trainer {

// One distinct op of a step: a Backend member at one shape.
struct RecordedOp {
    std::string op;     // the Backend member, e.g. "matmul_forward"
    std::string shape;  // its sizes, e.g. "M 8188, K 2048, N 6144"
    double flops = 0.0, bytes = 0.0;
    // The dry backend's name of each cost the call reports, in order (a fused op reports its parts'), and each one's
    // bytes.
    std::vector<std::string> cost_ops;
    std::vector<double> cost_bytes;
    // Their one name where they have one (a fused op has none): what `trainer plan` prices the op by in a
    // calibration file.
    std::string cost_op() const;
    long calls = 0;  // calls in the step; 0: a part of a fused op the step runs, recorded for the plan
    // Those calls by the part of the step that made them (step_part), in the order first made; a key that two
    // parts call at the same shape (the LM head's GEMM as wide as a block's) has both.
    std::vector<std::pair<std::string, long>> part_calls;
    double seconds = -1.0;          // one call, where the recorder had a timer
    double ceiling_seconds = -1.0;  // GEMMs on a backend with a bf16 Linear reference: the reference at this shape
    using Gemm = GemmShape;
    std::optional<Gemm> gemm;
    std::string key() const;  // op, shape and costs: equal keys are the same work
};

// Runs one call again and again and returns the mean seconds of one (bench-kernels' timer).
using OpTimer = std::function<double(const std::function<void()>&)>;

class OpRecorder final : public ForwardingBackend {
   public:
    // Forwards to `inner`; with `timer`, times each op (and each GEMM's bf16 Linear reference, where `inner` has
    // one) the first time it sees its key, on the buffers of that call, before running the call itself. The
    // repeated calls leave the step's values unlike a real step's: a timed step computes nothing to keep.
    // The recorder observes the calling thread's trace spans while it lives (step_part), so it is made and used on
    // the thread that runs the step.
    explicit OpRecorder(Backend& inner, OpTimer timer = {});
    ~OpRecorder() override;
    // The step's ops in the order first called, each once.
    const std::vector<RecordedOp>& ops() const { return ops_; }

    // A row op is recorded at its shape, timed where this is the first call of its key and there is a timer, and
    // run on the inner backend, unless it is a part of a fused op; the other ops are forwarded only (generation's
    // are no part of a training step; copies, casts and sums are priced by their bytes, not timed as rows).
    void dispatch(const OpCall& call, const std::function<void(Backend&)>& run) override;
    // A fused op's parts are recorded without counting them as the step's calls, and timed alone where new, for
    // the plan, which prices a fused op by its parts.
    void fused_parts(const std::function<void()>& parts) override;

   private:
    void time_ceiling(RecordedOp& r);

    // The trace spans open on the recording thread (trace::observe_spans), passed on to the observer that was
    // there before, if any.
    struct Spans final : trace::SpanObserver {
        void begin(const char* category, std::string_view name) override;
        void end() override;
        trace::SpanObserver* previous = nullptr;
        StepSpans open;
    };

    OpTimer timer_;
    Spans spans_;
    std::unique_ptr<Backend> costs_backend_;  // the dry backend: each call's costs
    std::vector<OpCost> costs_;
    std::vector<RecordedOp> ops_;
    std::map<std::string, size_t> by_key_;
    bool in_parts_ = false;
    DeviceBuffer ref_in_, ref_w_, ref_out_, ref_dout_, ref_din_, ref_dw_;  // the ceilings' bf16 operands
    size_t ref_mk_ = 0, ref_nk_ = 0, ref_mn_ = 0;
};

}  // namespace trainer
