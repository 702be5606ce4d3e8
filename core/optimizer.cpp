// AdamW with global-norm clipping and OLMo's schedules (see optimizer.h).
#include "core/optimizer.h"

#include <algorithm>
#include <cmath>

#include "base/common.h"

namespace trainer {

double scheduled_lr(const OptimizerConfig& opt, const SchedulerConfig& sched, long step, long total_steps) {
    const double lr = opt.learning_rate;
    if (sched.name == SchedulerName::kConstant) return lr;
    // Steps as doubles: whole-step settings give exactly the integer arithmetic; fractional ones (OLMo's token
    // units) the same formulas on tokens seen, divided by the tokens of a step.
    const double warmup = sched.t_warmup, at = static_cast<double>(step);
    const double warmup_min = sched.warmup_min_lr ? *sched.warmup_min_lr : 0.1 * lr;
    if (at < warmup) return warmup_min + (lr - warmup_min) * at / warmup;
    if (sched.name == SchedulerName::kInverseSqrtWithWarmup) return lr * std::sqrt(warmup / std::max(warmup, at));
    const double t_max = sched.t_max ? *sched.t_max : static_cast<double>(total_steps);
    const double eta_min = lr * sched.alpha_f;
    if (at >= t_max) return eta_min;
    const double s = at - warmup;
    const double span = t_max - warmup;
    if (sched.name == SchedulerName::kLinearWithWarmup) return lr - (lr - eta_min) * (s / span);
    return eta_min + (lr - eta_min) * (1.0 + std::cos(M_PI * s / span)) / 2.0;
}

double scheduled_max_grad_norm(const TrainConfig& config, long step) {
    if (!config.max_grad_norm) return -1.0;
    const auto& s = config.scheduler;
    if (s.grad_clip_warmup_steps && static_cast<double>(step) <= *s.grad_clip_warmup_steps) {
        return *config.max_grad_norm * *s.grad_clip_warmup_factor;
    }
    return *config.max_grad_norm;
}

double clip_coefficient(double grad_norm, double max_norm) {
    if (max_norm < 0.0) return 1.0;
    return std::min(1.0, max_norm / (grad_norm + 1e-6));
}

namespace {

// The first unit, in layout order, whose gradient has a non-finite element, and its first such parameter:
// "unit U (parameter P)". Collective: every rank walks the same units and parameters (an empty part
// adds 0), each sum over ranks through the strategy's gradient-norm reduction.
std::string first_non_finite_gradient(Strategy& strategy, Backend& backend, const std::vector<ShardView>& shards,
                                      const ParamLayout& layout) {
    std::vector<const ShardView*> by_unit(layout.units().size(), nullptr);
    for (const auto& s : shards) by_unit.at(s.unit) = &s;
    auto global_sq = [&](const ShardView* s, Range part) {
        double local = 0.0;
        if (s != nullptr) {
            part = intersect(part, {s->begin, s->end});
            if (!part.empty()) local = backend.squared_norm_multi({{s->grad + (part.begin - s->begin), part.size()}});
        }
        return strategy.global_grad_sq(local);
    };
    for (size_t u = 0; u < by_unit.size(); ++u) {
        const Unit& unit = layout.units()[u];
        if (std::isfinite(global_sq(by_unit[u], {0, unit.numel}))) continue;
        for (const ParamSpec& p : unit.params) {
            if (!std::isfinite(global_sq(by_unit[u], {p.offset, p.offset + p.numel})))
                return fmt::format("unit {} (parameter {})", unit.name, p.name);
        }
        return fmt::format("unit {}", unit.name);
    }
    return "in no unit: each unit's sum is finite, their total overflowed";
}

}  // namespace

AdamW::AdamW(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Backend* host)
    : config_(config), layout_(layout), backend_(backend), host_(host) {}

OptimizerStepResult AdamW::step(Strategy& strategy, long step, long total_steps) {
    const std::vector<ShardView> shards = strategy.owned_shards();
    // Where the shards live, the same for all (a strategy offloads all or none): the backend that runs there.
    const bool on_host = !shards.empty() && shards.front().on_host;
    Backend* backend = on_host ? host_ : backend_;
    TRAINER_CHECK(backend != nullptr, "the optimizer state is in host memory but no host backend was given");
    // The norm on the device, where the gradients were reduced (offloaded too: the host only updates).
    std::vector<std::pair<const float*, size_t>> grads;
    for (const auto& s : shards) {
        TRAINER_CHECK(s.on_host == on_host, "unit {}: some shards are offloaded and some are not", s.unit);
        grads.emplace_back(s.device_grad, s.end - s.begin);
    }
    OptimizerStepResult r;
    r.grad_norm = std::sqrt(strategy.global_grad_sq(backend_->squared_norm_multi(grads)));
    const double clip_coef = clip_coefficient(r.grad_norm, scheduled_max_grad_norm(config_, step));
    r.lr = scheduled_lr(config_.optimizer, config_.scheduler, step, total_steps);
    if (!std::isfinite(r.grad_norm)) {
        user_error(
            "step {}: the gradient norm is {}; the first gradient that is not finite is {} (nothing was updated "
            "or saved); lower optimizer.learning_rate or check the data",
            step, r.grad_norm, first_non_finite_gradient(strategy, *backend, shards, layout_));
    }
    const auto& o = config_.optimizer;
    std::vector<Backend::AdamwRange> ranges;
    for (const auto& s : shards) {
        for (const DecaySegment& seg : layout_.decay_segments(s.unit)) {
            // Intersect the parameter range with the shard: a parameter split across ranks keeps its group.
            const Range part = intersect({seg.begin, seg.end}, {s.begin, s.end});
            if (part.empty()) continue;
            const size_t o0 = part.begin - s.begin;
            ranges.push_back({s.param + o0, s.grad + o0, s.exp_avg + o0, s.exp_avg_sq + o0,
                              s.param_bf16 != nullptr ? s.param_bf16 + o0 : nullptr, part.size(),
                              seg.decay ? static_cast<float>(o.weight_decay) : 0.0f});
        }
    }
    backend->adamw_update_multi(ranges, static_cast<float>(r.lr), static_cast<float>(o.beta1),
                                static_cast<float>(o.beta2), static_cast<float>(o.eps), step,
                                static_cast<float>(clip_coef));
    strategy.after_optimizer_step();
    return r;
}

}  // namespace trainer
