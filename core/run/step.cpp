// The step skeleton shared by the loop and the dry run (see step.h).
#include "core/run/step.h"

#include "base/stop.h"
#include "base/trace.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

StepSlots reserve_step_slots(RankExchange& exchange) {
    StepSlots s;
    s.masked = exchange.reserve("masked_instances");
    s.stop_votes = exchange.reserve("stop_votes", stop::kVotes);
    return s;
}

OptimizerStepResult run_step(Strategy& strategy, Model& model, AdamW& optimizer, Backend& backend,
                             RankExchange& exchange, const StepPlan& plan) {
    const trace::Span span("step", plan.label);
    const LossSums loss =
        accumulate_gradients(strategy, model, plan.accumulation, plan.micro, plan.dloss_scale, plan.micro_batch);
    {
        const trace::Span sum("comm", "loss all_reduce");
        exchange.clear();
        const RankExchange::Slot sums = exchange.reserve("loss", 2);
        exchange.at(sums)[0] = loss.ce;
        exchange.at(sums)[1] = loss.z;
        if (plan.fill) plan.fill(exchange);
        exchange.sum([&](double* v, int n) { strategy.all_reduce_sum(v, n); }, plan.dry ? 0 : strategy.world_size());
    }
    if (plan.after_exchange) plan.after_exchange(exchange);
    const trace::Span opt("optimizer", "optimizer step");
    const OptimizerStepResult r = optimizer.step(strategy, plan.step, plan.total_steps);
    backend.synchronize();
    return r;
}

}  // namespace trainer
