// --trace-file: each rank writes a Chrome trace whose step spans are the steps the metrics time (whose
// utilisation shares it measures), tiled by their children (data, micro-batches with every unit's forward,
// backward and recompute, the gradient settling, the loss, the optimizer), with every collective on its
// communicator's track, bytes included; scripts/merge_traces.py joins the ranks; an unwritable path is
// refused before the run; the plan draws its predicted step with the same spans; and a device's hooks
// mirror the spans on the device's own track.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "base/trace.h"
#include "test_util.h"

using namespace trainer;

namespace {

std::vector<Json> spans_of(const std::string& path) {
    const Json trace = Json::parse(test_util::read_file(path));
    std::vector<Json> out;
    for (const Json& e : trace.at("traceEvents")) {
        if (e.at("ph") == "X") out.push_back(e);
    }
    return out;
}

}  // namespace

TEST_CASE("trace: every unit and collective of every step on 2 ranks with the step time accounted") {
    test_util::TempDir dir;
    const std::string metrics = dir.path("m.jsonl"), trace = dir.path("trace.json");
    const int steps = 3, micro_batches = 2, layers = 3;
    const auto r = test_util::launch(2, {"--config",
                                         "configs/tiny.json",
                                         "--data",
                                         test_util::fixture("olmo_tiny_tokens.u16"),
                                         "--max-duration",
                                         std::to_string(steps),
                                         "--strategy",
                                         "fsdp",
                                         "--wrapping-strategy",
                                         "by_block",
                                         "--set",
                                         "model.n_layers=" + std::to_string(layers),
                                         "--set",
                                         "device_train_microbatch_size=2",
                                         "--set",
                                         "activation_checkpointing=one_in_two",
                                         "--metrics-file",
                                         metrics,
                                         "--trace-file",
                                         trace});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    const auto rows = test_util::read_metrics(metrics);
    REQUIRE(rows.size() == steps);
    // A trace measures the utilisation of every step: on the CPU the ops' time, and the host's waits for
    // the Gloo collectives.
    for (const Json& row : rows) {
        CHECK(row["device_busy_fraction"].get<double>() > 0.0);
        CHECK(row["device_comm_wait_fraction"].get<double>() ==
              Approx(row["comm_wait_ms"].get<double>() / row["step_time_ms"].get<double>()).margin(1e-9));
        CHECK(row["device_busy_fraction"].get<double>() + row["device_comm_wait_fraction"].get<double>() <= 1.0);
    }
    for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        const std::vector<Json> spans = spans_of(dir.path("trace.rank" + std::to_string(rank) + ".json"));
        std::map<std::string, int> count;
        std::set<std::string> collectives;
        int compute_tid = -1;
        for (const Json& s : spans) {
            const std::string name = s.at("name"), cat = s.at("cat");
            ++count[name];
            CHECK(s.at("pid").get<int>() == rank);
            if (cat == "step") compute_tid = s.at("tid").get<int>();
            if (cat == "comm" && s.contains("args")) {
                collectives.insert(name);
                CHECK(s.at("args").at("bytes").get<int64_t>() >= 0);
            }
        }
        // Every unit's forward and backward in every micro-batch of every step; one_in_two recomputes blocks 0
        // and 2.
        const int passes = steps * micro_batches;
        CHECK(count["forward embedding"] == passes);
        CHECK(count["head forward+backward"] == passes);
        CHECK(count["backward embedding"] == passes);
        for (int l = 0; l < layers; ++l) {
            CAPTURE(l);
            CHECK(count["forward block." + std::to_string(l)] == passes);
            CHECK(count["backward block." + std::to_string(l)] == passes);
            CHECK(count["recompute block." + std::to_string(l)] == (l % 2 == 0 ? passes : 0));
        }
        CHECK(count["optimizer step"] == steps);
        CHECK(count["read micro-batch"] == passes);
        // FSDP's collectives, run on the Gloo worker's track: gathers, reduce-scatters, the loss and norm sums.
        CHECK(collectives == std::set<std::string>{"all_gather", "all_reduce", "reduce_scatter"});
        for (const Json& s : spans) {
            if (s.at("cat") == "comm" && s.contains("args")) CHECK(s.at("tid").get<int>() != compute_tid);
        }
        // Each step span is the step the metrics time, and its children account for the steps' time: summed
        // over the steps, so that the thread descheduled between two spans once (two ranks, their Gloo workers
        // and another test share the two cores) does not fail it, while code outside every span, which every
        // step runs, still does.
        int step = 0;
        double covered_total = 0.0, dur_total = 0.0;
        for (const Json& s : spans) {
            if (s.at("cat") != "step") continue;
            const double begin = s.at("ts"), dur = s.at("dur"), measured = rows.at(step++).at("step_time_ms");
            if (rank == 0) CHECK(std::abs(dur / 1e3 - measured) <= 0.05 * measured);  // the metrics are rank 0's
            std::vector<std::pair<double, double>> inside;
            for (const Json& c : spans) {
                if (c.at("tid") != s.at("tid") || &c == &s) continue;
                const double b = c.at("ts"), d = c.at("dur");
                if (b >= begin && b + d <= begin + dur && d < dur) inside.push_back({b, b + d});
            }
            double covered = 0.0;  // the union of the spans inside the step
            std::sort(inside.begin(), inside.end());
            double reach = begin;
            for (const auto& [b, e] : inside) {
                if (e <= reach) continue;
                covered += e - std::max(b, reach);
                reach = e;
            }
            covered_total += covered;
            dur_total += dur;
        }
        CHECK(step == steps);
        CHECK(covered_total >= 0.95 * dur_total);
    }
    // The merge script joins both ranks into one trace.
    const std::string merged = dir.path("merged.json");
    const std::string cmd = "python3 " + test_util::source_dir() + "/scripts/merge_traces.py " + merged + " " +
                            dir.path("trace.rank0.json") + " " + dir.path("trace.rank1.json") + " > /dev/null";
    REQUIRE(std::system(cmd.c_str()) == 0);
    std::set<int> pids;
    const Json all = Json::parse(test_util::read_file(merged));
    for (const Json& e : all.at("traceEvents")) pids.insert(e.at("pid").get<int>());
    CHECK(pids == std::set<int>{0, 1});
}

TEST_CASE("trace: an unwritable trace path is refused before training") {
    test_util::TempDir dir;
    const auto r =
        test_util::run_trainer({"--config", "configs/tiny.json", "--data", test_util::fixture("olmo_tiny_tokens.u16"),
                                "--max-duration", "1", "--trace-file", dir.path("no/such/folder/t.json")});
    CHECK(r.exit_code != 0);
    CHECK(r.err.find("trace_file") != std::string::npos);
    CHECK(r.out.find("step 1/1") == std::string::npos);
}

TEST_CASE("trace: trainer plan --trace-file draws the predicted step with the measured spans") {
    // FULL_SHARD by_block on 2 ranks of tiny: the plan's predicted trace has the measured trace's spans (but
    // the data reads, which a dry run does not do), its step lasts the predicted step time, and its
    // collectives carry their bytes on the communicators' tracks.
    test_util::TempDir dir;
    const std::string cal = dir.path("cal.json");
    REQUIRE(test_util::run_trainer({"bench-kernels", "--config", "configs/tiny.json", "--threads", "1", "--reps", "2",
                                    "--calibration-out", cal})
                .exit_code == 0);
    const std::vector<std::string> config = {"--config",   "configs/tiny.json",
                                             "--strategy", "fsdp",
                                             "--set",      "fsdp.wrapping_strategy=by_block",
                                             "--set",      "device_train_microbatch_size=2"};
    std::vector<std::string> plan = {"plan",         "--nproc-per-node",        "2", "--calibration", cal, "--json",
                                     "--trace-file", dir.path("predicted.json")};
    plan.insert(plan.end(), config.begin(), config.end());
    const auto p = test_util::run_trainer(plan);
    INFO(p.out << p.err);
    REQUIRE(p.exit_code == 0);
    double predicted_ms = 0.0;
    std::stringstream rows(p.out);
    for (std::string line; std::getline(rows, line);) {
        const Json row = Json::parse(line);
        if (row["is_config"].get<bool>()) predicted_ms = row["predicted_step_ms"];
    }
    REQUIRE(predicted_ms > 0.0);
    std::vector<std::string> run = {"--data",         test_util::fixture("olmo_tiny_tokens.u16"),
                                    "--max-duration", "1",
                                    "--trace-file",   dir.path("measured.json")};
    run.insert(run.end(), config.begin(), config.end());
    REQUIRE(test_util::launch(2, run).exit_code == 0);
    auto names = [](const std::vector<Json>& spans, std::set<std::string>* comm) {
        std::set<std::string> out;
        for (const Json& s : spans) {
            if (s.at("cat") == "comm" && s.contains("args")) {
                comm->insert(s.at("name").get<std::string>());
            } else if (s.at("cat") != "data") {
                out.insert(s.at("name").get<std::string>());
            }
        }
        return out;
    };
    std::set<std::string> predicted_comm, measured_comm;
    const std::vector<Json> predicted = spans_of(dir.path("predicted.json"));
    std::set<std::string> predicted_names = names(predicted, &predicted_comm);
    std::set<std::string> measured_names = names(spans_of(dir.path("measured.rank0.json")), &measured_comm);
    predicted_names.erase("step");  // the measured step span is named by its number
    measured_names.erase("step 1");
    CHECK(predicted_names == measured_names);
    CHECK(predicted_comm == measured_comm);
    for (const Json& s : predicted) {
        if (s.at("cat") == "step") CHECK(s.at("dur").get<double>() / 1e3 == Approx(predicted_ms).epsilon(1e-6));
        if (s.at("cat") == "comm" && s.contains("args")) CHECK(s.at("tid").get<int>() >= 1);
    }
}

namespace {
std::vector<std::string> g_ranges;  // "+name" at each push, "-" at each pop
}  // namespace

TEST_CASE("trace: spans push and pop a profiler's ranges (NVTX on the GPU) without a trace being recorded") {
    REQUIRE_FALSE(trace::enabled());
    g_ranges.clear();
    trace::set_range_hooks(
        {[](const char* name) { g_ranges.push_back(std::string("+") + name); }, [] { g_ranges.emplace_back("-"); }});
    CHECK(trace::active());  // span names are built: the ranges carry them
    {
        const trace::Span step("step", "step 1");
        const trace::Span unnamed("forward", "");  // a range without a name takes its category
    }
    trace::set_range_hooks({});
    CHECK_FALSE(trace::active());
    { const trace::Span after("step", "step 2"); }
    CHECK(g_ranges == std::vector<std::string>{"+step 1", "+forward", "-", "-"});
}

namespace {
// A device that "runs" each span 1 ms after its begin hook, until 1,005 us after its end hook.
struct FakeDevice {
    std::vector<std::string> ended;
};
std::deque<double> g_device_begin_us;  // each begin hook's clock (a deque: the tokens point into it)
}  // namespace

TEST_CASE("trace: device hooks mirror each span onto the device's own track") {
    REQUIRE_FALSE(trace::enabled());
    test_util::TempDir dir;
    FakeDevice device;
    g_device_begin_us.clear();
    trace::start(3);
    trace::set_device_hooks({&device,
                             [](void*) -> void* {
                                 g_device_begin_us.push_back(trace::now_us());
                                 return &g_device_begin_us.back();
                             },
                             [](void* ctx, void* token, const char* category, const std::string& name, int64_t bytes) {
                                 static_cast<FakeDevice*>(ctx)->ended.push_back(name);
                                 const double begin = *static_cast<double*>(token) + 1000.0;
                                 trace::add_span("cuda compute stream", category, name, bytes, begin,
                                                 trace::now_us() + 1005.0 - begin);
                             }});
    { const trace::Span span("forward", "forward block.0", 7); }
    trace::clear_device_hooks(nullptr);  // not the setter: the hooks stay
    { const trace::Span span("backward", "backward block.0"); }
    trace::clear_device_hooks(&device);
    { const trace::Span span("optimizer", "optimizer step"); }
    const std::string path = dir.path("t.json");
    trace::write(path);
    trace::stop();
    CHECK_FALSE(trace::enabled());
    CHECK(device.ended == std::vector<std::string>{"forward block.0", "backward block.0"});

    const Json trace = Json::parse(test_util::read_file(path));
    const int device_tid = test_util::trace_track(trace, "cuda compute stream");
    REQUIRE(device_tid >= 0);
    std::map<std::string, std::vector<Json>> by_name;
    for (const Json& s : spans_of(path)) by_name[s.at("name").get<std::string>()].push_back(s);
    REQUIRE(by_name["forward block.0"].size() == 2);  // the host's span and the device's
    REQUIRE(by_name["backward block.0"].size() == 2);
    REQUIRE(by_name["optimizer step"].size() == 1);  // hooks cleared: the host's only
    REQUIRE(g_device_begin_us.size() == 2);
    for (size_t i = 0; i < 2; ++i) {
        const char* name = i == 0 ? "forward block.0" : "backward block.0";
        CAPTURE(name);
        const Json& host = by_name[name][0].at("tid") == device_tid ? by_name[name][1] : by_name[name][0];
        const Json& dev = by_name[name][0].at("tid") == device_tid ? by_name[name][0] : by_name[name][1];
        CHECK(dev.at("tid").get<int>() == device_tid);
        CHECK(host.at("tid").get<int>() != device_tid);
        CHECK(dev.at("cat") == host.at("cat"));
        // The device's span is the hook's (within the trace's rounding of microseconds since the epoch), and
        // the hooks bracket the host's span: begin before its clock read, end after. No bound on how long apart:
        // a loaded machine may deschedule the thread between them.
        CHECK(std::fabs(dev.at("ts").get<double>() - (g_device_begin_us[i] + 1000.0)) <= 0.5);
        CHECK(dev.at("ts").get<double>() <= host.at("ts").get<double>() + 1000.0 + 0.5);
        CHECK(dev.at("ts").get<double>() + dev.at("dur").get<double>() >=
              host.at("ts").get<double>() + host.at("dur").get<double>() + 1000.0 - 0.5);
    }
    CHECK(by_name["forward block.0"][0].at("args").at("bytes") == 7);
    // A stopped trace records nothing more and starts empty again.
    { const trace::Span span("step", "after"); }
    trace::start(0);
    const std::string again = dir.path("t2.json");
    trace::write(again);
    trace::stop();
    CHECK(spans_of(again).empty());
}
