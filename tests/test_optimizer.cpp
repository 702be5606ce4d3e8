// The optimizer's schedules and clipping against OLMo's formulas computed by hand.
#include <cmath>

#include "core/optimizer.h"
#include "test_util.h"

using namespace trainer;

TEST_CASE("optimizer: OLMo schedules") {
    OptimizerConfig o;
    o.learning_rate = 1.0;
    SchedulerConfig s;
    s.t_warmup = 10;
    s.alpha_f = 0.1;
    s.name = SchedulerName::kCosineWithWarmup;
    CHECK(scheduled_lr(o, s, 0, 110) == Approx(0.1));               // warmup starts at 0.1 x lr
    CHECK(scheduled_lr(o, s, 5, 110) == Approx(0.1 + 0.9 * 0.5));   // linear warmup
    CHECK(scheduled_lr(o, s, 10, 110) == Approx(1.0));              // peak
    CHECK(scheduled_lr(o, s, 60, 110) == Approx(0.1 + 0.9 * 0.5));  // half way down the cosine
    CHECK(scheduled_lr(o, s, 110, 110) == Approx(0.1));             // eta_min = alpha_f x lr
    CHECK(scheduled_lr(o, s, 500, 110) == Approx(0.1));
    s.name = SchedulerName::kLinearWithWarmup;
    CHECK(scheduled_lr(o, s, 35, 110) == Approx(1.0 - 0.9 * 0.25));
    s.name = SchedulerName::kInverseSqrtWithWarmup;
    CHECK(scheduled_lr(o, s, 40, 110) == Approx(std::sqrt(10.0 / 40.0)));
    s.name = SchedulerName::kConstant;
    CHECK(scheduled_lr(o, s, 3, 110) == 1.0);
    s.name = SchedulerName::kCosineWithWarmup;
    s.warmup_min_lr = 0.0;
    CHECK(scheduled_lr(o, s, 0, 110) == 0.0);
    s.t_max = 60;
    CHECK(scheduled_lr(o, s, 35, 110) == Approx(0.1 + 0.9 * 0.5));
}

TEST_CASE("optimizer: clipping coefficient and clip warmup") {
    CHECK(clip_coefficient(0.5, 1.0) == 1.0);
    CHECK(clip_coefficient(4.0, 1.0) == Approx(1.0 / (4.0 + 1e-6)));
    CHECK(clip_coefficient(4.0, -1.0) == 1.0);  // clipping off
    TrainConfig c;
    c.max_grad_norm = 1.0;
    c.scheduler.grad_clip_warmup_steps = 1000;
    c.scheduler.grad_clip_warmup_factor = 10.0;
    CHECK(scheduled_max_grad_norm(c, 1000) == 10.0);
    CHECK(scheduled_max_grad_norm(c, 1001) == 1.0);
    c.max_grad_norm.reset();
    CHECK(scheduled_max_grad_norm(c, 5) < 0.0);
}

namespace {

// The references, written as their sources define them (steps and t_max in steps, lr the peak).
// OLMo (olmo/optim.py): Scheduler._linear_warmup, from warmup_min_lr (None: 0.1 x lr).
double olmo_linear_warmup(double lr, double warmup_min, double step, double warmup) {
    return warmup_min + (lr - warmup_min) * std::min(step, warmup) / warmup;
}
// OLMo CosWithWarmup.
double olmo_cos_with_warmup(double lr, double warmup_min, double step, double max_steps, double warmup,
                            double alpha_f) {
    const double eta_min = lr * alpha_f;
    if (step < warmup) return olmo_linear_warmup(lr, warmup_min, step, warmup);
    if (step >= max_steps) return eta_min;
    step -= warmup, max_steps -= warmup;
    return eta_min + (lr - eta_min) * (1 + std::cos(M_PI * step / max_steps)) / 2;
}
// OLMo InvSqrtWithWarmup.
double olmo_inv_sqrt_with_warmup(double lr, double warmup_min, double step, double warmup) {
    if (step < warmup) return olmo_linear_warmup(lr, warmup_min, step, warmup);
    return lr * std::sqrt(warmup / std::max(warmup, step));
}
// OLMo CosLinearEnvelope.
double olmo_cos_linear_envelope(double lr, double warmup_min, double step, double max_steps, double warmup,
                                double alpha_f) {
    const double eta_min = lr * alpha_f;
    if (step < warmup) return olmo_linear_warmup(lr, warmup_min, step, warmup);
    if (step >= max_steps) return eta_min;
    step -= warmup, max_steps -= warmup;
    const double linear_envelope = 1 - step / max_steps;
    const double cosine_schedule = (lr - eta_min) * (1 + std::cos(M_PI * step / max_steps)) / 2;
    return eta_min + linear_envelope * cosine_schedule;
}
// OLMo ConstantWithWarmupScheduler.
double olmo_constant_with_warmup(double lr, double warmup_min, double step, double warmup) {
    return step < warmup ? olmo_linear_warmup(lr, warmup_min, step, warmup) : lr;
}
// Python's round(): halves to even.
double python_round(double x) {
    const double f = std::floor(x);
    if (x - f != 0.5) return std::floor(x + 0.5);
    return std::fmod(f, 2.0) == 0.0 ? f : f + 1.0;
}
// OLMo-core (olmo_core/optim/scheduler.py) WSD with warmup and decay_fraction, its _linear_warmup and _linear_decay.
double olmo_core_wsd(double lr, double current, double t_max, double warmup, double decay_fraction,
                     double warmup_min_lr, double decay_min_lr) {
    if (current <= warmup) return warmup_min_lr + (lr - warmup_min_lr) * std::min(current, warmup) / warmup;
    const double decay = python_round(t_max * decay_fraction);
    if (current >= t_max - decay) return decay_min_lr + (lr - decay_min_lr) * std::min(t_max - current, decay) / decay;
    return lr;
}
// llm.c (llmc/schedulers.h) get_learning_rate_wsd after its warmup, its decay from decay_point to train_num_batches.
double llmc_wsd_after_warmup(double max_lr, int step, int train_num_batches, int decay_point,
                             double final_learning_rate_frac) {
    if (step < decay_point) return max_lr;
    const double decay_ratio = double(step - decay_point) / (train_num_batches - decay_point);
    const double min_lr = max_lr * final_learning_rate_frac;
    return min_lr + (1.0 - std::sqrt(decay_ratio)) * (max_lr - min_lr);
}

// Trains `steps` steps of the tiny model with the schedule `sets` and returns each step's (step, lr).
std::vector<std::pair<long, double>> run_schedule(const std::vector<std::string>& sets, int steps) {
    test_util::TempDir dir;
    std::vector<std::string> args = {"--config",       "configs/tiny.json",
                                     "--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                     "--threads",      "1",
                                     "--max-duration", std::to_string(steps),
                                     "--metrics-file", dir.path("m.jsonl"),
                                     "--set",          "optimizer.learning_rate=0.003"};
    for (const std::string& s : sets) args.insert(args.end(), {"--set", s});
    const test_util::RunResult r = test_util::run_trainer(args);
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    std::vector<std::pair<long, double>> lrs;
    for (const Json& row : test_util::read_metrics(dir.path("m.jsonl"))) {
        if (row.contains("lr")) lrs.emplace_back(row["step"].get<long>(), row["lr"].get<double>());
    }
    REQUIRE(lrs.size() == static_cast<size_t>(steps));
    return lrs;
}

void check_lrs(const std::vector<std::pair<long, double>>& lrs, const std::function<double(double)>& reference) {
    for (const auto& [step, lr] : lrs) {
        const double ref = reference(static_cast<double>(step));
        CAPTURE(step, lr, ref);
        CHECK(std::fabs(lr - ref) <= 1e-7 * std::fabs(ref));
    }
}

}  // namespace

TEST_CASE("optimizer: every step of a run has the learning rate of the schedule's reference formula", "[heavy]") {
    const double lr = 0.003;
    const int steps = 24;
    SECTION("wsd, linear: OLMo-core's WSD") {
        check_lrs(run_schedule({"scheduler.name=wsd", "scheduler.t_warmup=5", "scheduler.decay_fraction=0.25",
                                "scheduler.warmup_min_lr=0", "scheduler.alpha_f=0.1"},
                               steps),
                  [&](double s) { return olmo_core_wsd(lr, s, steps, 5, 0.25, 0.0, 0.1 * lr); });
    }
    SECTION("wsd, linear, OLMo-core's default decay_fraction") {
        check_lrs(run_schedule({"scheduler.name=wsd", "scheduler.t_warmup=3", "scheduler.warmup_min_lr=0",
                                "scheduler.alpha_f=0"},
                               steps),
                  [&](double s) { return olmo_core_wsd(lr, s, steps, 3, 0.1, 0.0, 0.0); });
    }
    SECTION("wsd, 1-sqrt: llm.c's decay after OLMo's warmup") {
        check_lrs(run_schedule({"scheduler.name=wsd", "scheduler.t_warmup=4", "scheduler.t_decay=8",
                                "scheduler.decay_shape=1-sqrt", "scheduler.alpha_f=0"},
                               steps),
                  [&](double s) {
                      return s < 4 ? olmo_linear_warmup(lr, 0.1 * lr, s, 4)
                                   : llmc_wsd_after_warmup(lr, static_cast<int>(s), steps, steps - 8, 0.0);
                  });
    }
    SECTION("max_scheduler: OLMo's MaxScheduler of its cosine and inverse square root") {
        check_lrs(run_schedule({"scheduler.name=max_scheduler", "scheduler.t_warmup=5", "scheduler.t_max=16"}, steps),
                  [&](double s) {
                      return std::max(olmo_cos_with_warmup(lr, 0.1 * lr, s, 16, 5, 0.1),
                                      olmo_inv_sqrt_with_warmup(lr, 0.1 * lr, s, 5));
                  });
    }
    SECTION("cosine_linear_envelope: OLMo's CosLinearEnvelope") {
        check_lrs(run_schedule({"scheduler.name=cosine_linear_envelope", "scheduler.t_warmup=5",
                                "scheduler.alpha_f=0.2", "scheduler.warmup_min_lr=0.0001"},
                               steps),
                  [&](double s) { return olmo_cos_linear_envelope(lr, 0.0001, s, steps, 5, 0.2); });
    }
    SECTION("constant_with_warmup: OLMo's ConstantWithWarmupScheduler") {
        check_lrs(run_schedule({"scheduler.name=constant_with_warmup", "scheduler.t_warmup=10"}, steps),
                  [&](double s) { return olmo_constant_with_warmup(lr, 0.1 * lr, s, 10); });
    }
}
