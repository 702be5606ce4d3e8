// `trainer bench-comm` and the measured links in `trainer plan`: the fit recovers a link from ring times, the
// calibration file is checked key by key, the plan times each collective on its measured link, and two ranks over
// Gloo measure and write a file the plan takes.
#include <fmt/format.h>

#include <string>
#include <vector>

#include "base/common.h"
#include "base/config.h"
#include "base/files.h"
#include "core/plan/bench_comm.h"
#include "core/plan/step_time.h"
#include "test_util.h"

using namespace trainer;

namespace {

// Samples of `kind` on `group_size` ranks timed exactly as `link` would take them, sizes 4 KiB to 64 MiB.
std::vector<CommSample> ring_samples(const std::string& kind, int group_size, const Link& link, double noise = 0.0) {
    std::vector<CommSample> out;
    int i = 0;
    for (double whole = 4096; whole <= 64.0 * 1024 * 1024; whole *= 4, ++i) {
        CommSample s;
        s.group = "intra", s.kind = kind, s.group_size = group_size;
        s.bytes = kind == "all_reduce" ? whole : whole / group_size;
        const RingCost c = ring_cost(kind, s.bytes, group_size);
        s.seconds = (c.steps * link.latency + c.bytes / link.bandwidth) * (1.0 + (i % 2 ? noise : -noise));
        out.push_back(s);
    }
    return out;
}

void write(const std::string& path, const std::string& text) { write_text_file(path, text, "test file"); }

// A calibration file with these links within a node (GB/s, us): all_reduce, reduce_scatter, all_gather.
std::string calibration(double ar, double rs, double ag, double latency_us) {
    return fmt::format(
        R"({{"format": "trainer-comm-calibration", "collectives": "gloo", "world_size": 2, "nnodes": 1,
            "links": {{"intra": {{"all_reduce": {{"bandwidth_gbs": {}, "latency_us": {}}},
                                "reduce_scatter": {{"bandwidth_gbs": {}, "latency_us": {}}},
                                "all_gather": {{"bandwidth_gbs": {}, "latency_us": {}}}}}}}}})",
        ar, latency_us, rs, latency_us, ag, latency_us);
}

}  // namespace

TEST_CASE("bench-comm: the fit recovers a ring's bandwidth and latency") {
    for (const char* kind : {"all_reduce", "reduce_scatter", "all_gather"}) {
        for (int n : {2, 4, 8}) {
            INFO(kind << " on " << n << " ranks");
            const Link l = fit_link(ring_samples(kind, n, {3e9, 40e-6}));
            CHECK(l.bandwidth == Approx(3e9).epsilon(1e-9));
            CHECK(l.latency == Approx(40e-6).epsilon(1e-9));
            // Alternating +-5% noise: the bandwidth within it; the latency, which rests on the two or three
            // latency-bound calls alone, within 10%.
            const Link noisy = fit_link(ring_samples(kind, n, {3e9, 40e-6}, 0.05));
            CHECK(noisy.bandwidth == Approx(3e9).epsilon(0.05));
            CHECK(noisy.latency == Approx(40e-6).epsilon(0.1));
        }
    }
    // Times measured over Gloo on a 400 Mbit/s lab link (an all-reduce of two ranks, 4 KiB to 16 MiB) whose
    // latency-bound calls jittered 4x: the bandwidth is the large calls' (0.048-0.0497 GB/s bus bandwidth), not
    // pulled above every one of them by the small ones (a fit on the relative error alone gave 0.0558).
    std::vector<CommSample> lab;
    const double lab_us[] = {1679.3, 1887.3, 1883.4, 5426.0, 21560.2, 84643.5, 349831.6};
    for (int i = 0; i < 7; ++i) {
        CommSample x;
        x.group = "inter", x.kind = "all_reduce", x.group_size = 2;
        x.bytes = 4096.0 * (1 << (2 * i)), x.seconds = lab_us[i] * 1e-6;
        lab.push_back(x);
    }
    const Link measured = fit_link(lab);
    CHECK(measured.bandwidth > 0.047e9);
    CHECK(measured.bandwidth < 0.0505e9);
    for (const CommSample& x : lab) {
        if (x.bytes < 1e6) continue;
        const RingCost c = ring_cost(x.kind, x.bytes, x.group_size);
        CHECK(c.steps * measured.latency + c.bytes / measured.bandwidth == Approx(x.seconds).epsilon(0.05));
    }
    // A latency that fits below 0 is 0 and the bandwidth alone is fitted: times of bytes / 2 GB/s, 10% less
    // below 1 MB.
    std::vector<CommSample> s = ring_samples("all_gather", 2, {2e9, 0.0});
    for (CommSample& x : s) x.seconds *= x.bytes < 1e6 ? 0.9 : 1.0;
    const Link clamped = fit_link(s);
    CHECK(clamped.latency == 0.0);
    CHECK(clamped.bandwidth == Approx(2e9).epsilon(0.2));
    // Times that do not grow with the bytes fit no bandwidth: refused, naming the collective and group.
    for (CommSample& x : s) x.seconds = 1e-3 * (x.bytes < 1e6 ? 2.0 : 1.0);
    try {
        (void)fit_link(s);
        FAIL("a flat series was fitted");
    } catch (const UserError& e) {
        CHECK(std::string(e.what()).find("all_gather times of the intra group do not grow") != std::string::npos);
    }
}

TEST_CASE("bench-comm: a comm calibration file is read key by key and refused with the key that is wrong") {
    test_util::TempDir dir;
    const std::string path = dir.path("links.json");
    write(path, calibration(2.0, 1.0, 4.0, 30));
    const CommCalibration c = read_comm_calibration(path);
    CHECK(c.collectives == "gloo");
    CHECK(c.world_size == 2);
    CHECK(c.inter.empty());
    CHECK(c.intra.at("all_reduce").bandwidth == Approx(2e9));
    CHECK(c.intra.at("reduce_scatter").bandwidth == Approx(1e9));
    CHECK(c.intra.at("all_gather").latency == Approx(30e-6));
    // Applied: the all-reduce's link is the group's, each kind takes its own, a group not measured is the entry's.
    Hardware hw = *find_hardware("a100-40gb");
    const Link inter = hw.inter;
    apply_comm_calibration(hw, c);
    CHECK(hw.intra.bandwidth == Approx(2e9));
    CHECK(link_for(hw, "reduce_scatter", false).bandwidth == Approx(1e9));
    CHECK(link_for(hw, "broadcast", false).bandwidth == Approx(2e9));
    CHECK(link_for(hw, "reduce_scatter", true).bandwidth == inter.bandwidth);

    const struct {
        std::string text, error;
    } bad[] = {
        {R"({"format": "trainer-calibration", "ops": []})", "not a file of trainer bench-comm --calibration-out"},
        {R"({"format": "trainer-comm-calibration", "links": {"nvlink": {}}})", "links.nvlink: unknown group"},
        {R"({"format": "trainer-comm-calibration", "links": {"intra": {"all_to_all": {}}}})",
         "links.intra.all_to_all: unknown collective"},
        {R"({"format": "trainer-comm-calibration", "links": {"intra": {"all_reduce": {"bandwidth_gbs": -1,
             "latency_us": 3}}}})",
         "links.intra.all_reduce: expected {\"bandwidth_gbs\": a positive number"},
        {R"({"format": "trainer-comm-calibration", "links": {"intra": {"all_reduce": {"bandwidth_gbs": 1}}}})",
         "links.intra.all_reduce: expected"},
        {R"({"format": "trainer-comm-calibration", "links": {"intra": {"all_gather": {"bandwidth_gbs": 1,
             "latency_us": 3}}}})",
         "links.intra: has no all_reduce"},
        {R"({"format": "trainer-comm-calibration", "links": {}})", "links: no group measured"},
        {R"({"format": "trainer-comm-calibration", "world_size": "2", "links": {}})",
         "world_size: expected a positive integer, got \"2\""},
        {R"({"format": "trainer-comm-calibration", "collectives": "mpi", "links": {}})",
         "collectives: expected \"gloo\" or \"nccl\", got \"mpi\""},
        {R"({"format": "trainer-comm-calibration", "links": )", "not valid JSON"},
        {R"({"format": 7, "links": {}})", "format is 7; expected a string"},
        {R"(["trainer-comm-calibration"])", "not a file of trainer bench-comm --calibration-out"},
    };
    for (const auto& b : bad) {
        INFO(b.text);
        write(path, b.text);
        try {
            (void)read_comm_calibration(path);
            FAIL("accepted");
        } catch (const UserError& e) {
            CHECK(std::string(e.what()).find(path) != std::string::npos);
            CHECK(std::string(e.what()).find(b.error) != std::string::npos);
        }
    }
    const auto missing = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware",
                                                 "a100-40gb", "--comm-calibration", dir.path("none.json")});
    CHECK(missing.exit_code == 1);
    CHECK(missing.err.find("comm calibration " + dir.path("none.json") + ": cannot be read") != std::string::npos);
}

TEST_CASE("plan: measured links time each collective on its own link") {
    test_util::TempDir dir;
    // OLMo-1B on 4 ranks of an A100 node, a step of 8 micro-batches: DDP all-reduces, FSDP gathers and
    // reduce-scatters.
    const std::vector<std::string> batch = {"--set", "global_train_batch_size=64", "--set",
                                            "device_train_microbatch_size=2"};
    const std::vector<std::string> base = test_util::olmo_1b_on_4_a100s(batch);
    const std::vector<std::string> ddp = {"--strategy", "ddp", "--set", "ddp.grad_sync_mode=micro_batch"};
    const std::vector<std::string> fsdp = {
        "--strategy", "fsdp", "--set", "fsdp.wrapping_strategy=by_block", "--set", "fsdp.grad_sync_mode=micro_batch"};
    auto row = [&](std::vector<std::string> strategy, const std::vector<std::string>& extra) {
        strategy.insert(strategy.end(), extra.begin(), extra.end());
        return test_util::config_row(base, strategy)["predicted_step_ms"].get<double>();
    };
    // Every kind at 2 GB/s and 30 us: the plan of the file is the plan of a hardware file with that link.
    const std::string same = dir.path("same.json"), slow_rs = dir.path("slow_rs.json");
    write(same, calibration(2.0, 2.0, 2.0, 30));
    write(slow_rs, calibration(2.0, 0.5, 2.0, 30));
    const std::vector<std::string> link2 = test_util::olmo_1b_on_4_a100s(
        batch,
        test_util::edited_hardware(dir.path("link2.json"), "a100-40gb",
                                   {{"name", "link2"}, {"intra_node", {{"bandwidth_gbs", 2}, {"latency_us", 30}}}}));
    const auto row_on_link2 = [&](std::vector<std::string> strategy) {
        return test_util::config_row(link2, strategy)["predicted_step_ms"].get<double>();
    };
    for (const auto& strategy : {ddp, fsdp}) {
        CHECK(row(strategy, {"--comm-calibration", same}) == Approx(row_on_link2(strategy)).epsilon(1e-9));
    }
    // A slow reduce-scatter moves FSDP's step, not DDP's (it all-reduces); the config key works as the flag.
    CHECK(row(ddp, {"--set", "plan.comm_calibration=" + slow_rs}) == Approx(row_on_link2(ddp)).epsilon(1e-9));
    const double fsdp_slow = row(fsdp, {"--set", "plan.comm_calibration=" + slow_rs});
    CHECK(fsdp_slow > row_on_link2(fsdp) * 1.2);
    // The table says where its links come from, and a world other than the measured one is noted.
    const auto table = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware",
                                               "a100-40gb", "--nproc-per-node", "2", "--comm-calibration", slow_rs});
    INFO(table.out << table.err);
    CHECK(table.out.find("links within a node 2 GB/s, 30 us, all_gather 2 GB/s, reduce_scatter 0.5 GB/s (measured: " +
                         slow_rs + ")") != std::string::npos);
    CHECK(table.err.find("measured on") == std::string::npos);
    const auto other = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware",
                                               "a100-40gb", "--nnodes", "2", "--nproc-per-node", "2", "--set",
                                               "device_train_microbatch_size=2", "--comm-calibration", slow_rs});
    CHECK(other.exit_code == 0);
    CHECK(other.err.find("were measured on 1 node(s) x 2 rank(s); this plan is for 2 x 2") != std::string::npos);
    CHECK(other.err.find("has no link between nodes: the hardware entry's is used") != std::string::npos);
    CHECK(other.err.find("were measured over gloo; a cpu run") == std::string::npos);
    const auto gpu = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--device", "cuda",
                                             "--nproc-per-node", "2", "--comm-calibration", slow_rs});
    CHECK(gpu.exit_code == 0);
    CHECK(gpu.err.find("were measured over gloo; a cuda run's collectives are nccl's") != std::string::npos);
}

TEST_CASE("bench-comm: two ranks over Gloo measure their links and the plan takes the file") {
    test_util::TempDir dir;
    const std::string out = dir.path("links.json");
    const auto r = test_util::launch(2, {"bench-comm", "--config", "configs/tiny.json", "--max-size", "64MiB",
                                         "--seconds-per-size", "0.02", "--calibration-out", out});
    INFO(r.out << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("| intra | reduce_scatter | 2 | 64 MiB |") != std::string::npos);
    CHECK(r.out.find("intra all_gather: ") != std::string::npos);
    const Json file = Json::parse(test_util::read_file(out));
    CHECK(file["collectives"] == "gloo");
    CHECK(file["world_size"] == 2);
    CHECK(file["samples"].size() == 3 * 8);  // 4 KiB to 64 MiB of each collective
    for (const char* kind : {"all_reduce", "reduce_scatter", "all_gather"}) {
        INFO(kind);
        CHECK(file["links"]["intra"][kind]["bandwidth_gbs"].get<double>() > 0.0);
        CHECK(file["links"]["intra"][kind]["latency_us"].get<double>() >= 0.0);
    }
    const CommCalibration c = read_comm_calibration(out);
    CHECK(c.intra.size() == 3);

    // One process has no links to measure; a size too small to fit two sizes is refused.
    const auto alone = test_util::run_trainer({"bench-comm", "--config", "configs/tiny.json"});
    CHECK(alone.exit_code == 1);
    CHECK(alone.err.find("bench-comm measures the links between ranks") != std::string::npos);
    const auto tiny = test_util::launch(2, {"bench-comm", "--config", "configs/tiny.json", "--max-size", "4KiB"});
    CHECK(tiny.exit_code != 0);
    CHECK(tiny.err.find("--max-size 4096: needs at least 16 KiB") != std::string::npos);
    const auto unwritable = test_util::launch(
        2, {"bench-comm", "--config", "configs/tiny.json", "--calibration-out", dir.path("no/such/dir/links.json")});
    CHECK(unwritable.exit_code != 0);
    CHECK(unwritable.err.find("bench-comm --calibration-out " + dir.path("no/such/dir/links.json") +
                              ": cannot be written") != std::string::npos);
}

TEST_CASE("bench-comm: on two launcher nodes it measures each node's group and the world between them") {
    test_util::TempDir dir;
    const std::string out = dir.path("links.json");
    test_util::launch_nodes(2, 2,
                            {"bench-comm", "--config", "configs/tiny.json", "--max-size", "64MiB", "--seconds-per-size",
                             "0.01", "--calibration-out", out},
                            dir.path("node"));
    const Json file = Json::parse(test_util::read_file(out));
    CHECK(file["world_size"] == 4);
    CHECK(file["nnodes"] == 2);
    CHECK(file["samples"].size() == 2 * 3 * 8);  // two groups, three collectives, 4 KiB to 64 MiB
    for (const Json& s : file["samples"]) CHECK(s["group_size"] == (s["group"] == "intra" ? 2 : 4));
    const CommCalibration c = read_comm_calibration(out);
    CHECK(c.intra.size() == 3);
    CHECK(c.inter.size() == 3);
    // The plan of the same world takes both groups' links and has nothing to say of the file.
    const auto plan = test_util::run_trainer({"plan", "--all", "--config", "configs/tiny.json", "--hardware",
                                              "a100-40gb", "--nnodes", "2", "--nproc-per-node", "2", "--set",
                                              "device_train_microbatch_size=2", "--comm-calibration", out});
    INFO(plan.out << plan.err);
    CHECK(plan.exit_code == 0);
    CHECK(plan.err.find("plan: ") == std::string::npos);
    CHECK(plan.out.find("between nodes " + fmt::format("{:.4g} GB/s", c.inter.at("all_reduce").bandwidth / 1e9)) !=
          std::string::npos);
}
