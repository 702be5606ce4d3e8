// The op recorder (see op_recorder.h).
#include "core/plan/op_recorder.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "base/common.h"

namespace trainer {

std::string RecordedOp::cost_op() const {
    for (const std::string& op : cost_ops) {
        if (op != cost_ops.front()) return "";
    }
    return cost_ops.empty() ? "" : cost_ops.front();
}

std::string RecordedOp::key() const { return fmt::format("{}|{}|{}|{}", op, shape, flops, bytes); }

void OpRecorder::Spans::begin(const char* category, std::string_view name) {
    open.begin(category, name);
    if (previous != nullptr) previous->begin(category, name);
}

void OpRecorder::Spans::end() {
    open.end();
    if (previous != nullptr) previous->end();
}

OpRecorder::OpRecorder(Backend& inner, OpTimer timer)
    : ForwardingBackend(inner),
      timer_(std::move(timer)),
      costs_backend_(make_dry_backend([this](const OpCost& c) { costs_.push_back(c); }, inner.gemm_operands_bf16(),
                                      inner.gemms_read_aliases())) {
    spans_.previous = trace::detail::t_observer;
    trace::observe_spans(&spans_);
}

OpRecorder::~OpRecorder() { trace::observe_spans(spans_.previous); }

void OpRecorder::dispatch(const OpCall& call, const std::function<void(Backend&)>& run) {
    if (!call.row) {
        if (!in_parts_) run(inner());
        return;
    }
    costs_.clear();
    run(*costs_backend_);
    RecordedOp r;
    r.op = call.op, r.shape = call.shape, r.gemm = call.gemm;
    for (const OpCost& c : costs_) r.flops += c.flops, r.bytes += c.bytes;
    for (const OpCost& c : costs_) r.cost_ops.emplace_back(c.op), r.cost_bytes.push_back(c.bytes);
    const auto [at, added] = by_key_.emplace(r.key(), ops_.size());
    if (added) {
        if (timer_) {
            r.seconds = timer_([&] { run(inner()); });
            if (r.gemm) time_ceiling(r);
        }
        ops_.push_back(std::move(r));
    }
    if (in_parts_) return;
    RecordedOp& op = ops_[at->second];
    ++op.calls;
    const std::string& part = step_part(spans_.open.where(), op.op);
    const auto same = [&part](const std::pair<std::string, long>& p) { return p.first == part; };
    if (const auto p = std::find_if(op.part_calls.begin(), op.part_calls.end(), same); p != op.part_calls.end()) {
        ++p->second;
    } else {
        op.part_calls.emplace_back(part, 1);
    }
    run(inner());
}

void OpRecorder::fused_parts(const std::function<void()>& parts) {
    in_parts_ = true;
    try {
        parts();
    } catch (...) {
        in_parts_ = false;
        throw;
    }
    in_parts_ = false;
}

// The peers' bf16 Linear at a GEMM's shape (Backend::linear_bf16_reference_*), on bf16 operands of its own that
// every shape shares: pseudo-random values in [0.001, 0.1) (zeros can run faster than data: a bf16 GEMM was seen
// 13% faster on zeros on an H200), one pattern uploaded, then tiled.
void OpRecorder::time_ceiling(RecordedOp& r) {
    if (!inner().has_linear_bf16_reference()) return;
    const auto [M, K, N, backward] = *r.gemm;
    const size_t mk = size_t(M) * K, nk = size_t(N) * K, mn = size_t(M) * N;
    if (mk > ref_mk_ || nk > ref_nk_ || mn > ref_mn_) {
        ref_mk_ = std::max(ref_mk_, mk), ref_nk_ = std::max(ref_nk_, nk), ref_mn_ = std::max(ref_mn_, mn);
        std::vector<uint16_t> pattern(size_t{1} << 16);
        uint64_t lcg = 0x9E3779B97F4A7C15ull;
        for (uint16_t& v : pattern) {
            lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
            const float f = static_cast<float>(0.001 + 0.099 * static_cast<double>(lcg >> 11) * 0x1.0p-53);
            uint32_t bits = 0;
            std::memcpy(&bits, &f, sizeof bits);
            v = static_cast<uint16_t>(bits >> 16);
        }
        const size_t pattern_bytes = pattern.size() * sizeof(uint16_t);
        DeviceBuffer pattern_dev(&inner(), pattern_bytes, MemCategory::kOther);
        inner().copy_host_to_device(pattern_dev.data(), pattern.data(), pattern_bytes);
        const auto filled = [&](size_t n) {
            DeviceBuffer b(&inner(), n * sizeof(uint16_t), MemCategory::kOther);
            for (size_t at = 0; at < b.bytes(); at += pattern_bytes) {
                inner().copy_device_to_device(static_cast<char*>(b.data()) + at, pattern_dev.data(),
                                              std::min(pattern_bytes, b.bytes() - at));
            }
            return b;
        };
        ref_in_ = filled(ref_mk_), ref_w_ = filled(ref_nk_), ref_out_ = filled(ref_mn_);
        ref_dout_ = filled(ref_mn_), ref_din_ = filled(ref_mk_), ref_dw_ = filled(ref_nk_);
    }
    // The first call says whether the backend has a GEMM for the shape (it runs nothing where not).
    const auto run = [&, M = M, K = K, N = N, backward = backward] {
        if (backward) {
            return inner().linear_bf16_reference_backward(ref_din_.bf16(), ref_dw_.bf16(), ref_dout_.bf16(),
                                                          ref_in_.bf16(), ref_w_.bf16(), M, K, N);
        }
        return inner().linear_bf16_reference_forward(ref_out_.bf16(), ref_in_.bf16(), ref_w_.bf16(), M, K, N);
    };
    if (run()) r.ceiling_seconds = timer_([&] { run(); });
}

}  // namespace trainer
