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
