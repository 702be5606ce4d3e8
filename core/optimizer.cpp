// AdamW with global-norm clipping and OLMo's schedules (see optimizer.h).
#include "core/optimizer.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "base/common.h"

namespace trainer {

namespace {

// Cosine from lr at the warmup's end to eta_min at t_max (OLMo's CosWithWarmup after its warmup).
double cosine_after_warmup(double lr, double eta_min, double at, double warmup, double t_max) {
    if (at >= t_max) return eta_min;
    return eta_min + (lr - eta_min) * (1.0 + std::cos(M_PI * (at - warmup) / (t_max - warmup))) / 2.0;
}

// OLMo's InvSqrtWithWarmup after its warmup.
double inverse_sqrt_after_warmup(double lr, double at, double warmup) {
    return lr * std::sqrt(warmup / std::max(warmup, at));
}

// WSD's decay length in steps: t_decay, or decay_fraction (default 0.1) of t_max. OLMo-core rounds the share to its
// unit, half to even as Python's round(); t_max from token units is a fractional step count, whose share stays
// as it is (the rounding to a token is below a step).
double wsd_decay_steps(const SchedulerConfig& sched, double t_max) {
    if (sched.t_decay) return *sched.t_decay;
    const double share = t_max * sched.decay_fraction.value_or(0.1);
    return t_max == std::floor(t_max) ? std::nearbyint(share) : share;
}

}  // namespace

double scheduled_lr(const OptimizerConfig& opt, const SchedulerConfig& sched, long step, long total_steps) {
    const double lr = opt.learning_rate;
    if (sched.name == SchedulerName::kConstant) return lr;
    // Steps as doubles: whole-step settings give exactly the integer arithmetic; fractional ones (OLMo's token
    // units) the same formulas on tokens seen, divided by the tokens of a step.
    const double warmup = sched.t_warmup, at = static_cast<double>(step);
    const double warmup_min = sched.warmup_min_lr ? *sched.warmup_min_lr : 0.1 * lr;
    if (at < warmup) return warmup_min + (lr - warmup_min) * at / warmup;
    const double t_max = sched.t_max ? *sched.t_max : static_cast<double>(total_steps);
    const double eta_min = lr * sched.alpha_f;
    switch (sched.name) {
        case SchedulerName::kConstant:
        case SchedulerName::kConstantWithWarmup:
            return lr;
        case SchedulerName::kInverseSqrtWithWarmup:
            return inverse_sqrt_after_warmup(lr, at, warmup);
        case SchedulerName::kMaxScheduler:
            return std::max(cosine_after_warmup(lr, eta_min, at, warmup, t_max),
                            inverse_sqrt_after_warmup(lr, at, warmup));
        case SchedulerName::kLinearWithWarmup:
            if (at >= t_max) return eta_min;
            return lr - (lr - eta_min) * ((at - warmup) / (t_max - warmup));
        case SchedulerName::kCosineLinearEnvelope: {
            // The cosine's distance above eta_min, scaled down linearly to nothing at t_max.
            if (at >= t_max) return eta_min;
            const double x = (at - warmup) / (t_max - warmup);
            return eta_min + (1.0 - x) * (lr - eta_min) * (1.0 + std::cos(M_PI * x)) / 2.0;
        }
        case SchedulerName::kCosineWithWarmup:
            return cosine_after_warmup(lr, eta_min, at, warmup, t_max);
        case SchedulerName::kWsd: {
            // Stable at lr until the decay's last t_decay steps before t_max, then down to eta_min.
            if (at >= t_max) return eta_min;
            const double decay = wsd_decay_steps(sched, t_max), into = at - (t_max - decay);
            if (into < 0.0 || decay <= 0.0) return lr;
            const double x = into / decay;
            const double left = sched.decay_shape == DecayShape::kOneMinusSqrt ? 1.0 - std::sqrt(x) : 1.0 - x;
            return eta_min + (lr - eta_min) * left;
        }
    }
    return lr;
}

double scheduled_max_grad_norm(const TrainConfig& config, long step) {
    if (!config.max_grad_norm) return -1.0;
    const auto& s = config.scheduler;
    if (s.grad_clip_warmup_steps && static_cast<double>(step) <= *s.grad_clip_warmup_steps) {
        return *config.max_grad_norm * *s.grad_clip_warmup_factor;
    }
    return *config.max_grad_norm;
}

std::string divergence_advice(const OptimizerConfig& opt) {
    if (opt.eps == 0.0) {
        return "set optimizer.eps above 0 (AdamW divides by zero where a parameter has had no gradient, as the "
               "embedding rows of tokens not seen yet) or lower optimizer.learning_rate";
    }
    return "lower optimizer.learning_rate";
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

AdamW::AdamW(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Backend* host, size_t stream_chunk)
    : config_(config), layout_(layout), backend_(backend), host_(host), stream_chunk_(stream_chunk) {
    TRAINER_CHECK(stream_chunk_ > 0, "AdamW: the offload stream chunk must be positive");
}

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
        grads.emplace_back(s.grad, s.end - s.begin);
    }
    OptimizerStepResult r;
    r.grad_norm = std::sqrt(strategy.global_grad_sq(backend_->squared_norm_multi(grads)));
    const float clip_coef = static_cast<float>(clip_coefficient(r.grad_norm, scheduled_max_grad_norm(config_, step)));
    r.lr = scheduled_lr(config_.optimizer, config_.scheduler, step, total_steps);
    if (!std::isfinite(r.grad_norm)) {
        user_error(
            "step {}: the gradient norm is {}; the first gradient that is not finite is {} (nothing was updated "
            "or saved); {} or check the data",
            step, r.grad_norm, first_non_finite_gradient(strategy, *backend_, shards, layout_),
            divergence_advice(config_.optimizer));
    }
    const auto& o = config_.optimizer;
    const auto update = [&](const std::vector<Backend::AdamwRange>& ranges) {
        backend->adamw_update_multi(ranges, static_cast<float>(r.lr), static_cast<float>(o.beta1),
                                    static_cast<float>(o.beta2), static_cast<float>(o.eps), step, clip_coef);
    };
    if (!on_host) {
        std::vector<Backend::AdamwRange> ranges;
        for (const auto& s : shards) append_ranges(ranges, s, 0, s.end - s.begin, s.grad);
        update(ranges);
    } else {
        update_streaming(shards, update);
    }
    strategy.after_optimizer_step();
    return r;
}

void AdamW::append_ranges(std::vector<Backend::AdamwRange>& out, const ShardView& s, size_t a, size_t b,
                          const float* grad) const {
    for (const DecaySegment& seg : layout_.decay_segments(s.unit)) {
        // Intersect the parameter range with the window: a parameter split across ranks keeps its group.
        const Range part = intersect({seg.begin, seg.end}, {s.begin + a, s.begin + b});
        if (part.empty()) continue;
        const size_t o0 = part.begin - s.begin;
        out.push_back({s.param + o0, grad + (o0 - a), s.exp_avg + o0, s.exp_avg_sq + o0,
                       s.param_bf16 != nullptr ? s.param_bf16 + o0 : nullptr, part.size(),
                       seg.decay ? static_cast<float>(config_.optimizer.weight_decay) : 0.0f});
    }
}

void AdamW::update_streaming(const std::vector<ShardView>& shards,
                             const std::function<void(const std::vector<Backend::AdamwRange>&)>& update) {
    // The shards' gradients in chunks of at most stream_chunk_ elements, each copied into one of two pinned
    // slots: the next chunk's copy runs while the host updates this one (a slot is written again only
    // after the update that read it has returned), and each updated chunk starts up to the device at once.
    size_t largest = 0;
    for (const auto& s : shards) largest = std::max(largest, s.end - s.begin);
    const size_t chunk = std::min(stream_chunk_, largest);
    if (chunk == 0) return;
    if (staging_.bytes() < 2 * chunk * sizeof(float)) {
        staging_ = DeviceBuffer(backend_, 2 * chunk * sizeof(float), MemCategory::kHostGradients);
    }
    struct Piece {
        const ShardView* shard;
        size_t a, b;  // elements [a, b) of the shard
    };
    std::vector<Piece> pieces;
    for (const auto& s : shards) {
        for (size_t a = 0; a < s.end - s.begin; a += chunk)
            pieces.push_back({&s, a, std::min(a + chunk, s.end - s.begin)});
    }
    const auto slot = [&](size_t i) { return staging_.f32() + (i % 2) * chunk; };
    const auto send = [&](size_t i) {
        const Piece& p = pieces[i];
        return backend_->copy_async(slot(i), p.shard->grad + p.a, (p.b - p.a) * sizeof(float));
    };
    uint64_t next = send(0);
    std::vector<Backend::AdamwRange> ranges;
    for (size_t i = 0; i < pieces.size(); ++i) {
        const uint64_t ticket = next;
        if (i + 1 < pieces.size()) next = send(i + 1);
        backend_->host_wait(ticket);
        ranges.clear();
        append_ranges(ranges, *pieces[i].shard, pieces[i].a, pieces[i].b, slot(i));
        update(ranges);
        if (pieces[i].shard->upload) pieces[i].shard->upload(pieces[i].a, pieces[i].b);
    }
}

}  // namespace trainer
