// Dry runs of a training step (see dry_run.h).
#include "core/plan/dry_run.h"

#include <optional>

#include "base/common.h"
#include "base/layout.h"
#include "base/trace.h"
#include "core/model/model.h"
#include "core/optimizer.h"
#include "core/run/step.h"
#include "core/weights/async_save.h"
#include "kernels/backend.h"
#include "parallel/setup.h"

namespace trainer {

DryRunStep dry_run_step(const TrainConfig& config, const RankEnv& env, Device device, StepEventSink* timer) {
    DryRunStep r;
    // The step's events (not the initialisation's), in order: to the timer where there is one, else kept.
    bool live = false, in_optimizer = false;
    const auto record = [&](const StepEvent& e) {
        if (!live) return;
        if (timer != nullptr) return timer->add(e, in_optimizer);
        r.events.push_back(e);
    };
    // The device's ops and copies, and (on_host) the ops of CPU offload's optimizer, which runs on the host.
    const auto op_event = [&record](const OpCost& c, bool on_host) {
        StepEvent e;
        e.what = c.op, e.flops = c.flops, e.bytes = c.bytes, e.on_host = on_host, e.id = c.ticket;
        if (std::strcmp(c.op, "copy_async") == 0) e.kind = StepEvent::kCopy;
        if (std::strcmp(c.op, "host_wait") == 0 || std::strcmp(c.op, "device_wait") == 0) e.kind = StepEvent::kCopyWait;
        record(e);
    };
    const auto on_op = [&op_event](const OpCost& c) { op_event(c, false); };
    const auto on_host_op = [&op_event](const OpCost& c) { op_event(c, true); };
    const auto on_call = [&record](const CollectiveCall& c) {
        StepEvent e;
        e.kind = c.wait ? StepEvent::kWait : StepEvent::kIssue;
        e.what = c.kind, e.bytes = static_cast<double>(c.bytes), e.group_size = c.group_size;
        e.spans_nodes = c.spans_nodes, e.node_flows = c.node_flows, e.id = c.id, e.channel = c.channel;
        record(e);
    };
    // The model's and the strategy's trace spans, in order with the ops, so a predicted step can be drawn.
    struct Spans final : trace::SpanObserver {
        explicit Spans(std::function<void(const StepEvent&)> record) : record(std::move(record)) {}
        void begin(const char* category, std::string_view name) override {
            StepEvent e;
            e.kind = StepEvent::kSpanBegin, e.what = category, e.label = std::string(name);
            record(e);
        }
        void end() override {
            StepEvent e;
            e.kind = StepEvent::kSpanEnd;
            record(e);
        }
        std::function<void(const StepEvent&)> record;
    } spans(record);
    const MemorySnapshot before = memory_snapshot();
    memory_reset_peaks();
    {
        auto backend =
            make_dry_backend(on_op, gemm_operands_bf16_for(config, device), gemms_read_aliases_for(config, device));
        const ParamLayout layout(config);
        World world = make_dry_world(config, env, device, backend.get(), layout, on_call);
        Strategy& strategy = *world.strategy;  // its parameters are never loaded: nothing is there to read
        const long micro = config.device_train_microbatch_size, L = config.model.max_sequence_length;
        Model model(config, layout, backend.get(), &strategy,
                    static_cast<int>(std::max(micro, config.device_eval_batch_size)));
        // CPU offload's optimizer runs on the host: its ops are the host's (copies and waits stay the device's).
        auto host = make_dry_backend(on_host_op);
        AdamW optimizer(config, layout, backend.get(), config.cpu_offload.optimizer_state ? host.get() : nullptr);
        // save_async: the host snapshot a checkpoint is written from (held for the whole run).
        std::optional<CheckpointSnapshot> snapshot;
        if (config.async_saves()) snapshot.emplace(backend.get(), strategy);
        live = true;  // the step's work only, not the initialisation's
        const std::vector<int32_t> tokens(static_cast<size_t>(micro) * L, 0);
        struct Observing {  // the spans of this thread go to `spans` until the step is done (or throws)
            explicit Observing(trace::SpanObserver* o) { trace::observe_spans(o); }
            ~Observing() { trace::observe_spans(nullptr); }
        } observing(&spans);
        // The loop's step (core/run/step.h), with the slots every step of the loop exchanges beside the loss.
        StepPlan plan;
        plan.accumulation = config.accumulation_steps(env.world_size), plan.micro = static_cast<int>(micro);
        plan.dloss_scale = static_cast<float>(env.world_size / config.global_predicted_tokens());
        plan.dry = true;
        plan.micro_batch = [&](long) { return MicroBatchTokens(tokens.data()); };
        plan.fill = [](RankExchange& ex) { reserve_step_slots(ex); };
        plan.after_exchange = [&](const RankExchange&) {
            r.optimizer_begin = r.events.size();
            in_optimizer = true;
        };
        RankExchange exchange;
        run_step(strategy, model, optimizer, *backend, exchange, plan);
        const MemorySnapshot after = memory_snapshot();
        for (int c = 0; c < kNumMemCategories; ++c) r.peak[c] = after.peak[c] - before.current[c];
        r.total_peak = after.total_peak - before.total_current;
        r.host_peak = after.host_peak - before.host_current;
    }
    memory_restore_peaks(before);
    return r;
}

}  // namespace trainer
