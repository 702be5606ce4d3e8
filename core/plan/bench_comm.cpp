// `trainer bench-comm` (see bench_comm.h).
#include "core/plan/bench_comm.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/memory.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/rank_env.h"
#include "parallel/setup.h"

namespace trainer {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kKinds[] = {"all_reduce", "reduce_scatter", "all_gather"};

// Rank 0's value on every rank (a host buffer: complete on return on Gloo and NCCL alike).
double from_rank0(Communicator& comm, double v) {
    comm.broadcast(&v, 1, CommDType::kFloat64, 0).wait();
    return v;
}

// The ranks' mean of v.
double mean_over_ranks(Communicator& comm, double v) {
    comm.all_reduce(&v, 1, CommDType::kFloat64).wait();
    return v / comm.size();
}

// Seconds a call of `calls` issued back to back takes, from a barrier to the last one done.
double time_calls(Communicator& comm, Backend& backend, int calls, const std::function<CommHandle()>& call) {
    comm.barrier().wait();
    backend.synchronize();
    const auto t0 = Clock::now();
    std::vector<CommHandle> handles;
    handles.reserve(static_cast<size_t>(calls));
    for (int i = 0; i < calls; ++i) handles.push_back(call());
    for (const CommHandle& h : handles) h.wait();
    backend.synchronize();
    return seconds_since(t0) / calls;
}

std::string size_name(double bytes) {
    if (bytes >= 1024.0 * 1024.0) return fmt::format("{:.4g} MiB", bytes / (1024.0 * 1024.0));
    if (bytes >= 1024.0) return fmt::format("{:.4g} KiB", bytes / 1024.0);
    return fmt::format("{:.0f} B", bytes);
}

// Times all_reduce, reduce_scatter and all_gather on `comm` for each of `sizes` (bytes of the whole buffer:
// an all-reduce's, a reduce-scatter's input, an all-gather's output; rounded down to whole fp32 elements of
// every rank's shard), over `backend`'s memory, for about `seconds_per_size` each. Every rank of the group
// calls it alike: the repetitions are rank 0's choice, broadcast.
std::vector<CommSample> time_collectives(Communicator& comm, Backend& backend, const std::string& group,
                                         const std::vector<size_t>& sizes, double seconds_per_size) {
    const int n = comm.size();
    const size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    const size_t max_elems = std::max<size_t>(largest / sizeof(float) / n * n, n);
    DeviceBuffer buf(&backend, max_elems * sizeof(float), MemCategory::kCommunication);
    DeviceBuffer shard(&backend, max_elems / n * sizeof(float), MemCategory::kCommunication);
    backend.fill_zero(buf.data(), buf.bytes());
    backend.fill_zero(shard.data(), shard.bytes());
    std::vector<CommSample> samples;
    for (const char* kind : kKinds) {
        for (const size_t size : sizes) {
            // Whole fp32 elements of every rank's shard.
            const size_t elems = std::max<size_t>(size / sizeof(float) / n * n, n), per = elems / n;
            const std::string k = kind;
            const std::function<CommHandle()> call = [&, k, elems, per]() -> CommHandle {
                if (k == "all_reduce") return comm.all_reduce(buf.f32(), elems, CommDType::kFloat32);
                if (k == "reduce_scatter") {
                    return comm.reduce_scatter(buf.f32(), buf.f32() + comm.rank() * per, per, CommDType::kFloat32);
                }
                return comm.all_gather(shard.f32(), buf.f32(), per, CommDType::kFloat32);
            };
            (void)time_calls(comm, backend, 2, call);  // warm-up: connections, NCCL's channels, the pages
            // Three trials of equal calls, about seconds_per_size in all, each averaged over the ranks (they wait
            // for one another, so their times differ by when each saw the last finish); the fastest trial, since
            // what else runs on the machine only adds time, and the link is measured as it runs alone.
            const double once = from_rank0(comm, time_calls(comm, backend, 1, call));
            const int calls = static_cast<int>(std::clamp(seconds_per_size / 3.0 / std::max(once, 1e-7), 1.0, 1000.0));
            std::vector<double> trials;
            for (int t = 0; t < 3; ++t) trials.push_back(mean_over_ranks(comm, time_calls(comm, backend, calls, call)));
            CommSample s;
            s.group = group, s.kind = kind, s.group_size = n;
            s.seconds = *std::min_element(trials.begin(), trials.end());
            s.bytes = static_cast<double>((k == "all_reduce" ? elems : per) * sizeof(float));
            samples.push_back(s);
        }
    }
    return samples;
}

}  // namespace

Link fit_link(const std::vector<CommSample>& samples) {
    TRAINER_CHECK(!samples.empty(), "fit_link: no samples");
    // Weighted least squares of t = a * steps + b * bytes (a the latency, b 1/bandwidth), each time weighted by
    // 1/sigma^2 for a noise sigma of kRelative of the time plus its latency part: a host's scheduling jitter is of
    // the order of a call's latency (a latency-bound call of 4 KiB may take 4x as long in one run as in another),
    // while a bandwidth-bound call repeats to a few percent. So the small calls settle the latency and the large
    // ones the bandwidth; equal relative weights let a jittery 4 KiB call pull the bandwidth 10-15% above what
    // every large call measured. The first pass weighs every time by its relative error alone (no latency yet),
    // the next ones by the noise of the latency fitted before.
    constexpr double kRelative = 0.03;
    double a = 0.0, b = 0.0;
    for (int pass = 0; pass < 4; ++pass) {
        double ss = 0.0, sx = 0.0, xx = 0.0, st = 0.0, xt = 0.0;
        for (const CommSample& s : samples) {
            const RingCost c = ring_cost(s.kind, s.bytes, s.group_size);
            const double sigma = pass == 0 ? s.seconds : kRelative * s.seconds + a * c.steps;
            const double w = 1.0 / (sigma * sigma);
            ss += w * c.steps * c.steps, sx += w * c.steps * c.bytes, xx += w * c.bytes * c.bytes;
            st += w * c.steps * s.seconds, xt += w * c.bytes * s.seconds;
        }
        const double det = ss * xx - sx * sx;
        a = det > 0.0 ? (st * xx - xt * sx) / det : 0.0, b = det > 0.0 ? (ss * xt - sx * st) / det : 0.0;
        if (a < 0.0 || det <= 0.0) a = 0.0, b = xx > 0.0 ? xt / xx : 0.0;
    }
    if (b <= 0.0) {
        user_error(
            "bench-comm: the {} times of the {} group do not grow with the bytes ({} sizes, {} to {}): no bandwidth "
            "fits; measure larger sizes (--max-size)",
            samples[0].kind, samples[0].group, samples.size(), size_name(samples.front().bytes),
            size_name(samples.back().bytes));
    }
    return Link{1.0 / b, a};
}

int run_comm_bench(const TrainConfig& config, const CommBenchOptions& o) {
    const RankEnv env = detect_rank_env();
    const ComputeTarget target = resolve_compute(config);
    const Device device = target.device;
    if (env.world_size < 2) {
        user_error(
            "bench-comm measures the links between ranks, and {} started one; start it on the world to measure: "
            "trainer launch --nproc-per-node N -- bench-comm ... (N >= 2), mpirun or srun",
            env.launcher == "none" ? "nothing" : env.launcher);
    }
    check_collectives_config(config, device);
    const int device_index = rank_device(config, env, device);
    const size_t max_bytes = o.max_bytes > 0           ? o.max_bytes
                             : device == Device::kCuda ? size_t{256} << 20
                                                       : size_t{64} << 20;
    if (max_bytes < 16384) user_error("bench-comm --max-size {}: needs at least 16 KiB (two sizes to fit)", max_bytes);
    std::vector<size_t> sizes;  // 4 KiB up by 4x, and the largest
    for (size_t s = 4096; s <= max_bytes; s *= 4) sizes.push_back(s);
    if (sizes.back() != max_bytes) sizes.push_back(max_bytes);
    if (env.rank == 0 && !o.calibration_out.empty()) {
        // Refuse an unwritable path now, not after the measurements.
        const std::string probe = o.calibration_out + ".tmp";
        std::FILE* f = std::fopen(probe.c_str(), "w");
        if (f == nullptr) {
            user_error("bench-comm --calibration-out {}: cannot be written ({})", o.calibration_out,
                       std::strerror(errno));
        }
        std::fclose(f);
        std::remove(probe.c_str());
    }
    silence_stdout_unless_rank0(env);
    (void)configure_threads(config.threads);
    auto backend = make_backend(device, backend_options(config, target, device_index));
    World world = connect_world(config, env, device, backend.get());
    const char* collectives = world.collectives == Collectives::kNccl ? "nccl" : "gloo";

    // The world's group: within a node on one node, else between nodes; on several nodes also each node's own.
    const bool spans = env.num_nodes() > 1;
    std::vector<CommSample> samples =
        time_collectives(*world.comm, *backend, spans ? "inter" : "intra", sizes, o.seconds_per_size);
    if (spans && env.local_world_size > 1) {
        std::unique_ptr<Communicator> node = connect_group(world, backend.get(), fmt::format("node{}", env.node_rank()),
                                                           env.local_rank, env.local_world_size);
        const std::vector<CommSample> local = time_collectives(*node, *backend, "intra", sizes, o.seconds_per_size);
        samples.insert(samples.end(), local.begin(), local.end());
    }

    std::printf(
        "bench-comm: %d node(s) x %d rank(s), %s on %s, fp32; time: a call's mean over back-to-back calls and the "
        "ranks; bus bandwidth as nccl-tests counts it (the bytes each rank sends over the time); size: the whole "
        "buffer\n\n",
        env.num_nodes(), env.local_world_size, collectives, choice_name(device));
    std::printf("| group | collective | ranks | size | time us | bus bandwidth GB/s | fit us | fit error |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    Json links = Json::object(), measured = Json::array();
    std::string summary;
    for (const char* group : {"intra", "inter"}) {
        for (const char* kind : kKinds) {
            std::vector<CommSample> of;
            for (const CommSample& s : samples) {
                if (s.group == group && s.kind == kind) of.push_back(s);
            }
            if (of.empty()) continue;
            const Link l = fit_link(of);
            for (const CommSample& s : of) {
                const RingCost c = ring_cost(s.kind, s.bytes, s.group_size);
                const double fit = c.steps * l.latency + c.bytes / l.bandwidth;
                const double whole = s.kind == std::string("all_reduce") ? s.bytes : s.bytes * s.group_size;
                std::printf("| %s | %s | %d | %s | %.1f | %.3g | %.1f | %+.1f%% |\n", group, kind, s.group_size,
                            size_name(whole).c_str(), s.seconds * 1e6, c.bytes / s.seconds / 1e9, fit * 1e6,
                            100.0 * (fit / s.seconds - 1.0));
                measured.push_back({{"group", group},
                                    {"collective", kind},
                                    {"group_size", s.group_size},
                                    {"bytes", s.bytes},
                                    {"seconds", s.seconds}});
            }
            links[group][kind] = {{"bandwidth_gbs", l.bandwidth / 1e9}, {"latency_us", l.latency * 1e6}};
            summary += fmt::format("\n  {} {}: {:.4g} GB/s, {:.4g} us a ring step", group, kind, l.bandwidth / 1e9,
                                   l.latency * 1e6);
        }
    }
    std::printf("\nfitted links (seconds = ring steps x latency + bytes each rank sends / bandwidth):%s\n",
                summary.c_str());
    if (!o.calibration_out.empty() && env.rank == 0) {
        const Json file = {{"format", "trainer-comm-calibration"},
                           {"collectives", collectives},
                           {"device", choice_name(device)},
                           {"world_size", env.world_size},
                           {"nnodes", env.num_nodes()},
                           {"dtype", "float32"},
                           {"links", links},
                           {"samples", measured}};
        write_text_file(o.calibration_out, file.dump(2) + "\n", "bench-comm --calibration-out");
        std::printf("written to %s (trainer plan --comm-calibration, plan.comm_calibration)\n",
                    o.calibration_out.c_str());
    }
    std::fflush(stdout);
    world.comm->barrier().wait();  // no rank leaves (closing its connections) while another still measures
    return 0;
}

}  // namespace trainer
