// The strategies in process, without the binary: the model's hook sequence driven by hand over a group of
// one (for FSDP's gather refcount, prefetch, limit_all_gathers and memory invariants, read from the
// process-wide memory counters) and over three Gloo ranks as threads (gathered parameters, reduce-scattered
// gradients, the global gradient norm, and DDP's all-reduce).
#include <atomic>
#include <cmath>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "base/common.h"
#include "base/layout.h"
#include "base/memory.h"
#include "core/optimizer.h"
#include "kernels/backend.h"
#include "kernels/element.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/tcp_store.h"
#include "parallel/strategy/strategy.h"
#include "parallel/strategy/wrap_policy.h"
#include "rank_threads.h"
#include "test_util.h"

using namespace trainer;

namespace {

// tiny.json (tied head, parameter-free norms: the head unit holds nothing) with `n_layers` blocks.
TrainConfig tiny_config(int n_layers, WrappingStrategy wrap, ShardingStrategy sharding) {
    Json doc = Json::parse(test_util::read_file(test_util::source_dir() + "/configs/tiny.json"));
    doc["model"]["n_layers"] = n_layers;
    TrainConfig c = validate_config(doc);
    c.fsdp.wrapping_strategy = wrap;
    c.fsdp.sharding_strategy = sharding;
    return c;
}

FsdpOptions fsdp_options(const TrainConfig& c, const ParamLayout& layout) {
    FsdpOptions o;
    o.groups = fsdp_unit_groups(layout, c.fsdp);
    o.keep_params_for_step = c.fsdp.sharding_strategy == ShardingStrategy::kShardGradOp;
    o.forward_prefetch = c.fsdp.forward_prefetch;
    o.backward_prefetch = c.fsdp.backward_prefetch;
    o.limit_all_gathers = c.fsdp.limit_all_gathers;
    o.in_place_when_alone = false;  // a group of one stands in for a shard group: gather as with many ranks
    return o;                       // fp32 on the wire: gathered units are exactly padded x 4 bytes
}

// Unit u's initial parameters: small integers, exact in fp32, different in every unit and element.
std::vector<float> unit_values(const ParamLayout& layout, int u) {
    std::vector<float> v(layout.units()[u].numel);
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(u * 1000 + static_cast<int>(i % 997));
    return v;
}

int64_t live(MemCategory c) { return memory_snapshot().current[static_cast<int>(c)]; }

// Bytes of the FSDP units gathered now, beyond a baseline taken before the step.
struct Gathered {
    int64_t base = live(MemCategory::kGatheredUnits);
    int64_t operator()() const { return live(MemCategory::kGatheredUnits) - base; }
};

// Padded bytes of each FSDP unit on a group of `ranks` ranks (fp32), by the index of its first layout unit.
std::vector<int64_t> unit_bytes(const ParamLayout& layout, const FsdpOptions& o, int ranks) {
    std::vector<int64_t> bytes(layout.num_units(), 0);
    for (const auto& g : o.groups) {
        size_t n = 0;
        for (int u : g) n += layout.units()[u].numel;
        const size_t padded = (n + ranks - 1) / ranks * ranks;
        for (int u : g) bytes[u] = static_cast<int64_t>(padded * sizeof(float));
    }
    return bytes;
}

// The model's hooks for one micro-batch with a tied head (Model::forward_blocks, head, backward_blocks),
// calling `probe(event, unit)` after each; `grad_value(u)` is written into unit u's gradients.
void micro_batch(Strategy& s, const ParamLayout& layout, Backend& backend,
                 const std::function<void(const std::string&, int)>& probe,
                 const std::function<float(int)>& grad_value) {
    const int emb = layout.embedding_unit(), head = layout.head_unit(), L = head - 1;
    auto write_grads = [&](int u) {
        const size_t n = layout.units()[u].numel;
        if (n == 0) return;
        std::vector<float> g(n, grad_value(u));
        std::vector<float> cur(n);
        backend.copy_device_to_host(cur.data(), s.unit_grads(u), n * sizeof(float));
        for (size_t i = 0; i < n; ++i) g[i] += cur[i];  // backward kernels accumulate
        backend.copy_host_to_device(s.unit_grads(u), g.data(), n * sizeof(float));
    };
    s.begin_forward(true);
    s.before_forward(emb);
    probe("before_forward", emb);
    s.after_forward(emb);
    probe("after_forward", emb);
    for (int l = 0; l < L; ++l) {
        const int u = layout.block_unit(l);
        s.before_forward(u);
        probe("before_forward", u);
        s.after_forward(u);
        probe("after_forward", u);
    }
    // The tied head: its forward and backward hold the embedding's unit too.
    s.before_forward(head);
    s.before_forward(emb);
    s.before_backward(head);
    s.before_backward(emb);
    probe("head", head);
    write_grads(head);
    write_grads(emb);
    s.after_backward(head);
    s.after_forward(emb);
    s.after_forward(head);
    for (int l = L - 1; l >= 0; --l) {
        const int u = layout.block_unit(l);
        s.before_backward(u);
        probe("before_backward", u);
        write_grads(u);
        s.after_backward(u);
        probe("after_backward", u);
    }
    s.after_backward(emb);
    probe("after_backward", emb);
}

// FULL_SHARD (fsdp) or DDP over `comm`, every unit loaded with unit_values, at the start of a step of one
// micro-batch.
std::unique_ptr<Strategy> started_step(bool fsdp, const TrainConfig& c, const ParamLayout& layout, Backend& backend,
                                       Communicator& comm, const CpuOffloadConfig& offload = {}) {
    FsdpOptions o = fsdp_options(c, layout);
    o.offload = offload;
    auto s = fsdp ? make_fsdp_strategy(&backend, layout, &comm, &comm, nullptr, o, "fsdp")
                  : make_ddp_strategy(&backend, layout, &comm, false, "ddp", {}, offload);
    for (int u = 0; u < layout.num_units(); ++u) s->load_full_unit_params(u, unit_values(layout, u).data());
    s->params_loaded();
    s->zero_grads();
    s->begin_step(1);
    s->begin_micro_batch(0);
    return s;
}

}  // namespace

TEST_CASE("strategy: FULL_SHARD gathers each unit around its hooks and prefetches the next and frees it after") {
    const TrainConfig c = tiny_config(4, WrappingStrategy::kByBlock, ShardingStrategy::kFullShard);
    const ParamLayout layout(c);
    auto backend = make_backend(Device::kCpu);
    auto local = make_local_communicator(backend.get());
    const FsdpOptions o = fsdp_options(c, layout);
    const auto bytes = unit_bytes(layout, o, 1);
    const int emb = layout.embedding_unit(), head = layout.head_unit();
    const int64_t root = bytes[emb];  // by_block: the embedding and the (empty) head are the root
    const Gathered gathered;
    auto s = make_fsdp_strategy(backend.get(), layout, local.get(), local.get(), nullptr, o, "fsdp");
    const int64_t grads_base = live(MemCategory::kGradients);  // beyond the sharded gradients
    for (int u = 0; u < layout.num_units(); ++u) s->load_full_unit_params(u, unit_values(layout, u).data());
    s->params_loaded();
    s->zero_grads();
    s->begin_step(1);
    s->begin_micro_batch(0);
    int checks = 0;
    micro_batch(
        *s, layout, *backend,
        [&](const std::string& event, int u) {
            CAPTURE(event, u);
            if (event == "before_forward" || event == "before_backward" || event == "head") {
                // Inside its hooks a unit's parameters are gathered and are what was loaded.
                const auto want = unit_values(layout, u);
                std::vector<float> got(want.size());
                backend->copy_device_to_host(got.data(), s->unit_params(u), want.size() * sizeof(float));
                CHECK(got == want);
                ++checks;
            }
            if (event == "before_forward" && u != emb) {
                // This block and the prefetched next one; the root stays for the whole step.
                const int64_t next = u + 1 < head ? bytes[u + 1] : 0;
                CHECK(gathered() == root + bytes[u] + next);
            }
            if (event == "after_forward" && u != emb) {
                // Freed after use: what is left is the root and the prefetched next block.
                CHECK_THROWS_AS(s->unit_params(u), InternalError);
                CHECK(gathered() == root + (u + 1 < head ? bytes[u + 1] : 0));
            }
            if (event == "before_backward") {
                // Backward prefetch of the block below; this unit's unsharded gradients are live.
                CHECK(gathered() == root + bytes[u] + (u - 1 > emb ? bytes[u - 1] : 0));
                CHECK(live(MemCategory::kGradients) - grads_base >= bytes[u]);
            }
            if (event == "after_backward" && u != emb) {
                // Reduced (handed to the reduce-scatter), then freed.
                CHECK_THROWS_AS(s->unit_grads(u), InternalError);
                CHECK(gathered() == root + (u - 1 > emb ? bytes[u - 1] : 0));
            }
        },
        [](int u) { return static_cast<float>(u + 1); });
    CHECK(checks == 2 + 2 * 4);  // the embedding (forward), the head, every block in forward and backward
    s->finish_backward();
    // Group of one: the reduced shard is the gradient itself; the shards cover every unit once.
    size_t covered = 0;
    for (const ShardView& v : s->owned_shards()) {
        std::vector<float> g(v.end - v.begin);
        backend->copy_device_to_host(g.data(), v.grad, g.size() * sizeof(float));
        CHECK(g == std::vector<float>(g.size(), static_cast<float>(v.unit + 1)));
        covered += v.end - v.begin;
    }
    CHECK(covered == layout.total_numel());
    CHECK(live(MemCategory::kGradients) - grads_base == 0);  // no unsharded gradients outlive the step
    s->after_optimizer_step();
    CHECK(gathered() == 0);
    // A release without its acquire is a bug the strategy refuses.
    CHECK_THROWS_AS(s->after_forward(layout.block_unit(0)), InternalError);
}

TEST_CASE("strategy: limit_all_gathers holds back a prefetch while two units besides the root are gathered") {
    for (bool limit : {true, false}) {
        CAPTURE(limit);
        // by_block_and_size: the tied embedding is its own unit, re-gathered at the head; at the last
        // block's backward the embedding and that block are gathered, so the prefetch of the block below
        // waits under the limit.
        TrainConfig c = tiny_config(3, WrappingStrategy::kByBlockAndSize, ShardingStrategy::kFullShard);
        c.fsdp.limit_all_gathers = limit;
        const ParamLayout layout(c);
        auto backend = make_backend(Device::kCpu);
        auto local = make_local_communicator(backend.get());
        const FsdpOptions o = fsdp_options(c, layout);
        const auto bytes = unit_bytes(layout, o, 1);
        const int emb = layout.embedding_unit(), last = layout.block_unit(2), below = layout.block_unit(1);
        const Gathered gathered;
        auto s = make_fsdp_strategy(backend.get(), layout, local.get(), local.get(), nullptr, o, "fsdp");
        s->zero_grads();
        s->begin_step(1);
        s->begin_micro_batch(0);
        bool probed = false;
        micro_batch(
            *s, layout, *backend,
            [&](const std::string& event, int u) {
                if (event != "before_backward" || u != last) return;
                probed = true;
                // The root holds only the empty head: what is gathered is the embedding, this block and,
                // without the limit, the block below.
                CHECK(gathered() == bytes[emb] + bytes[last] + (limit ? 0 : bytes[below]));
            },
            [](int) { return 1.0f; });
        CHECK(probed);
        s->finish_backward();
        s->after_optimizer_step();
        CHECK(gathered() == 0);
    }
}

TEST_CASE("strategy: SHARD_GRAD_OP keeps every gathered unit for the step and frees them after the optimizer") {
    const TrainConfig c = tiny_config(3, WrappingStrategy::kByBlock, ShardingStrategy::kShardGradOp);
    const ParamLayout layout(c);
    auto backend = make_backend(Device::kCpu);
    auto local = make_local_communicator(backend.get());
    const FsdpOptions o = fsdp_options(c, layout);
    const auto bytes = unit_bytes(layout, o, 1);
    int64_t all = 0;
    for (const auto& g : o.groups) all += g.empty() ? 0 : bytes[g.front()];
    const Gathered gathered;
    auto s = make_fsdp_strategy(backend.get(), layout, local.get(), local.get(), nullptr, o, "fsdp");
    s->zero_grads();
    s->begin_step(2);
    for (int k = 0; k < 2; ++k) {
        s->begin_micro_batch(k);
        micro_batch(
            *s, layout, *backend,
            [&](const std::string& event, int u) {
                // After a unit's first forward it stays: at the end of the first forward, everything.
                if (event == "after_forward" && u == layout.block_unit(2)) CHECK(gathered() == all);
            },
            [](int) { return 1.0f; });
        CHECK(gathered() == all);
    }
    s->finish_backward();
    // Two micro-batches accumulated into the unsharded gradients, reduced once (grad_sync batch).
    for (const ShardView& v : s->owned_shards()) {
        std::vector<float> g(v.end - v.begin);
        backend->copy_device_to_host(g.data(), v.grad, g.size() * sizeof(float));
        CHECK(g == std::vector<float>(g.size(), 2.0f));
    }
    s->after_optimizer_step();
    CHECK(gathered() == 0);
}

TEST_CASE("strategy: FSDP alone computes on its shard in place and gathers and reduces nothing") {
    for (bool mixed : {false, true}) {
        CAPTURE(mixed);
        const TrainConfig c = tiny_config(3, WrappingStrategy::kByBlock, ShardingStrategy::kFullShard);
        const ParamLayout layout(c);
        auto backend = make_backend(Device::kCpu);
        auto local = make_local_communicator(backend.get());
        FsdpOptions o = fsdp_options(c, layout);
        o.in_place_when_alone = true;
        o.precision.bf16_params = mixed;
        const auto bytes = unit_bytes(layout, o, 1);
        const Gathered gathered;
        const int64_t comm_base = live(MemCategory::kCommunication);
        auto s = make_fsdp_strategy(backend.get(), layout, local.get(), local.get(), nullptr, o, "fsdp");
        const int64_t grads_base = live(MemCategory::kGradients);
        for (int u = 0; u < layout.num_units(); ++u) s->load_full_unit_params(u, unit_values(layout, u).data());
        s->params_loaded();
        s->zero_grads();
        s->begin_step(1);
        s->begin_micro_batch(0);
        std::vector<float*> shard_params(layout.num_units(), nullptr);
        for (const ShardView& v : s->owned_shards()) shard_params[v.unit] = v.param;
        micro_batch(
            *s, layout, *backend,
            [&](const std::string& event, int u) {
                CAPTURE(event, u);
                if (event != "before_forward" && event != "before_backward") return;
                if (mixed) {
                    // The bf16 shard widened: the unit's compute copy, and nothing on the wire.
                    CHECK(gathered() >= bytes[u]);
                    std::vector<float> got(layout.units()[u].numel), want = unit_values(layout, u);
                    for (float& x : want) x = bf16_to_float(float_to_bf16(x));  // what mixed precision computes on
                    backend->copy_device_to_host(got.data(), s->unit_params(u), got.size() * sizeof(float));
                    CHECK(got == want);
                } else {
                    CHECK(s->unit_params(u) == shard_params[u]);
                    CHECK(gathered() == 0);
                }
                CHECK(live(MemCategory::kGradients) == grads_base);  // no unsharded gradient buffer
                CHECK(live(MemCategory::kCommunication) == comm_base);
            },
            [](int u) { return static_cast<float>(u + 1); });
        s->finish_backward();
        for (const ShardView& v : s->owned_shards()) {
            std::vector<float> g(v.end - v.begin);
            backend->copy_device_to_host(g.data(), v.grad, g.size() * sizeof(float));
            CHECK(g == std::vector<float>(g.size(), static_cast<float>(v.unit + 1)));
        }
        s->after_optimizer_step();
        CHECK(gathered() == 0);
    }
}

TEST_CASE("strategy: FULL_SHARD and DDP over 3 Gloo ranks gather what was loaded and reduce gradients to the mean") {
    const TrainConfig c = tiny_config(2, WrappingStrategy::kByBlock, ShardingStrategy::kFullShard);
    const ParamLayout layout(c);
    // Rank r writes (r + 1) * (u + 1) into unit u's gradients: the mean over 3 ranks is 2 (u + 1).
    double want_sq = 0.0;
    for (int u = 0; u < layout.num_units(); ++u)
        want_sq += static_cast<double>(layout.units()[u].numel) * 4.0 * (u + 1) * (u + 1);
    for (bool fsdp : {true, false}) {
        CAPTURE(fsdp);
        test_util::run_ranks(3, [&](int rank, Communicator& comm) {
            auto backend = make_backend(Device::kCpu);
            auto s = started_step(fsdp, c, layout, *backend, comm);
            RANK_EXPECT(s->rank() == rank && s->world_size() == 3, "rank " << rank << " of " << s->world_size());
            micro_batch(
                *s, layout, *backend,
                [&](const std::string& event, int u) {
                    if (event != "before_forward") return;
                    const auto want = unit_values(layout, u);
                    std::vector<float> got(want.size());
                    backend->copy_device_to_host(got.data(), s->unit_params(u), want.size() * sizeof(float));
                    RANK_EXPECT(got == want, "rank " << rank << ": unit " << u << " gathered wrong parameters");
                },
                [&](int u) { return static_cast<float>((rank + 1) * (u + 1)); });
            s->finish_backward();
            double local_sq = 0.0;
            for (const ShardView& v : s->owned_shards()) {
                std::vector<float> g(v.end - v.begin);
                backend->copy_device_to_host(g.data(), v.grad, g.size() * sizeof(float));
                const float want = 2.0f * static_cast<float>(v.unit + 1);
                RANK_EXPECT(g == std::vector<float>(g.size(), want),
                            "rank " << rank << ": unit " << v.unit << " shard gradient is not the mean " << want);
                for (float x : g) local_sq += static_cast<double>(x) * x;
            }
            const double global_sq = s->global_grad_sq(local_sq);
            RANK_EXPECT(global_sq == want_sq,
                        "rank " << rank << ": global squared norm " << global_sq << ", expected " << want_sq);
            RANK_EXPECT(s->all_reduce_sum(rank + 1.0) == 6.0, "rank " << rank << ": loss sum over ranks");
            s->barrier();
            s->after_optimizer_step();
        });
    }
}

TEST_CASE("optimizer: a non-finite gradient is named by unit and parameter on every rank and nothing is updated") {
    const TrainConfig c = tiny_config(2, WrappingStrategy::kByBlock, ShardingStrategy::kFullShard);
    const ParamLayout layout(c);
    // One element in the middle of unit 2's second parameter becomes NaN, on whichever rank owns it.
    const int bad_unit = 2;
    const ParamSpec& bad = layout.units()[bad_unit].params.at(1);
    const size_t bad_at = bad.offset + bad.numel / 2;
    const std::string want = "unit " + layout.units()[bad_unit].name + " (parameter " + bad.name + ")";
    for (bool fsdp : {true, false}) {
        CAPTURE(fsdp);
        test_util::run_ranks(3, [&](int rank, Communicator& comm) {
            auto backend = make_backend(Device::kCpu);
            auto s = started_step(fsdp, c, layout, *backend, comm);
            micro_batch(
                *s, layout, *backend, [](const std::string&, int) {}, [](int u) { return 0.5f * (u + 1); });
            s->finish_backward();
            std::vector<std::vector<float>> before;
            for (const ShardView& v : s->owned_shards()) {
                before.emplace_back(v.end - v.begin);
                backend->copy_device_to_host(before.back().data(), v.param, before.back().size() * sizeof(float));
                if (v.unit == bad_unit && bad_at >= v.begin && bad_at < v.end) v.grad[bad_at - v.begin] = NAN;
            }
            AdamW adamw(c, layout, backend.get(), nullptr);
            std::string message;
            try {
                adamw.step(*s, 7, 10);
            } catch (const UserError& e) {
                message = e.what();
            }
            RANK_EXPECT(message.find("step 7: the gradient norm is nan") != std::string::npos &&
                            message.find(want) != std::string::npos,
                        "rank " << rank << ": \"" << message << "\" does not name " << want);
            size_t k = 0;
            for (const ShardView& v : s->owned_shards()) {
                std::vector<float> after(v.end - v.begin);
                backend->copy_device_to_host(after.data(), v.param, after.size() * sizeof(float));
                RANK_EXPECT(after == before[k++], "rank " << rank << ": unit " << v.unit << " was updated");
            }
            s->barrier();
        });
    }
}

TEST_CASE("optimizer: CPU offload streams the gradients in chunks and updates bitwise as on the device") {
    const TrainConfig c = tiny_config(2, WrappingStrategy::kByBlock, ShardingStrategy::kFullShard);
    const ParamLayout layout(c);
    // Gradient element i of unit u at step t: different almost everywhere, so a chunk read at the wrong
    // offset or given the wrong decay group changes the update.
    const auto grad_at = [](int u, size_t i, long t) {
        return 0.001f * static_cast<float>(static_cast<long>(u * 7919 + i * 31 + t * 17) % 2003 - 1001);
    };
    for (bool fsdp : {true, false}) {
        CAPTURE(fsdp);
        test_util::run_ranks(2, [&](int rank, Communicator& comm) {
            auto backend = make_backend(Device::kCpu);
            // Two steps (the second reads the first's moments); then each shard's parameters and moments.
            const auto train = [&](bool offload, size_t chunk) {
                CpuOffloadConfig off;
                off.optimizer_state = offload;
                auto s = started_step(fsdp, c, layout, *backend, comm, off);
                AdamW adamw(c, layout, backend.get(), offload ? backend.get() : nullptr, chunk);
                for (long t = 1; t <= 2; ++t) {
                    if (t > 1) {
                        s->zero_grads();
                        s->begin_step(1);
                        s->begin_micro_batch(0);
                    }
                    micro_batch(
                        *s, layout, *backend, [](const std::string&, int) {}, [](int) { return 0.0f; });
                    s->finish_backward();
                    for (const ShardView& v : s->owned_shards()) {
                        RANK_EXPECT(v.on_host == offload, "rank " << rank << ": unit " << v.unit << " on_host");
                        for (size_t i = 0; i < v.end - v.begin; ++i) v.grad[i] = grad_at(v.unit, v.begin + i, t);
                    }
                    adamw.step(*s, t, 10);
                }
                std::vector<std::vector<float>> state;
                for (const ShardView& v : s->owned_shards()) {
                    for (const float* p : {v.param, v.exp_avg, v.exp_avg_sq})
                        state.emplace_back(p, p + (v.end - v.begin));
                }
                s->barrier();
                return state;
            };
            const auto want = train(false, AdamW::kStreamChunk);
            for (size_t chunk : {size_t(7), size_t(4096), AdamW::kStreamChunk}) {
                RANK_EXPECT(train(true, chunk) == want, "rank " << rank << ": offloaded AdamW streamed in chunks of "
                                                                << chunk << " differs from the update on the device");
            }
        });
    }
}
