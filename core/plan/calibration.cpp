// Measured op times and links (see calibration.h).
#include "core/plan/calibration.h"

#include <cstdint>

#include "base/common.h"
#include "base/json.h"

namespace trainer {

Calibration read_calibration(const std::string& path) {
    const Json j = read_json_file(path, "calibration");
    const std::string what = "calibration " + path;
    if (!j.is_object() || json_field<std::string>(j, "format", "", what) != "trainer-calibration" ||
        !j.contains("ops") || !j["ops"].is_array()) {
        user_error("calibration {}: not a file of trainer bench-kernels --calibration-out", path);
    }
    Calibration c;
    c.path = path;
    c.bandwidth = json_field<double>(j, "bandwidth", 0.0, what);
    c.peak_flops = json_field<double>(j, "peak_flops", 0.0, what);
    c.step_scale = json_field<double>(j, "step_scale", 1.0, what);
    // Counts: integers a process can hold, else refused by name.
    const auto count = [&](const char* key, int64_t fallback) {
        const int64_t v = json_field<int64_t>(j, key, fallback, what);
        if (v < 0 || v > 1 << 24) user_error("calibration {}: {}: {}; expected a count up to 2^24", path, key, v);
        return static_cast<int>(v);
    };
    c.threads = count("threads", 0);
    c.ranks_per_node = count("ranks_per_node", 1);
    if (c.ranks_per_node < 1) user_error("calibration {}: ranks_per_node: expected at least 1", path);
    c.cores = count("cores", 0);
    for (size_t i = 0; i < j["ops"].size(); ++i) {
        const Json& e = j["ops"][i];
        const std::string at = fmt::format("{} ops[{}]", what, i);
        Calibration::Entry entry{json_field<std::string>(e, "op", "", at), json_field<double>(e, "flops", 0.0, at),
                                 json_field<double>(e, "bytes", 0.0, at), json_field<double>(e, "seconds", 0.0, at)};
        if (entry.op.empty() || entry.seconds <= 0.0 || (entry.flops <= 0.0 && entry.bytes <= 0.0)) {
            user_error("calibration {}: an entry without an op, its work or a positive time: {}", path, e.dump());
        }
        c.entries.push_back(entry);
    }
    return c;
}

CommCalibration read_comm_calibration(const std::string& path) {
    const Json j = read_json_file(path, "comm calibration");
    if (!j.is_object() ||
        json_field<std::string>(j, "format", "", "comm calibration " + path) != "trainer-comm-calibration" ||
        !j.contains("links") || !j["links"].is_object()) {
        user_error("comm calibration {}: not a file of trainer bench-comm --calibration-out", path);
    }
    CommCalibration c;
    c.path = path;
    // The world it was measured on (bench-comm writes them; a file written by hand may leave them out).
    const auto count = [&](const char* key) {
        if (!j.contains(key)) return 0;
        if (!j[key].is_number_integer() || j[key].get<int64_t>() < 1 || j[key].get<int64_t>() > 1 << 24) {
            user_error("comm calibration {}: {}: expected a positive integer, got {}", path, key, j[key].dump());
        }
        return j[key].get<int>();
    };
    c.world_size = count("world_size");
    c.nnodes = count("nnodes");
    if (j.contains("collectives")) {
        if (!j["collectives"].is_string() ||
            (j["collectives"].get<std::string>() != "gloo" && j["collectives"].get<std::string>() != "nccl")) {
            user_error("comm calibration {}: collectives: expected \"gloo\" or \"nccl\", got {}", path,
                       j["collectives"].dump());
        }
        c.collectives = j["collectives"].get<std::string>();
    }
    for (const auto& [group, kinds] : j["links"].items()) {
        if (group != "intra" && group != "inter") {
            user_error("comm calibration {}: links.{}: unknown group; expected intra or inter", path, group);
        }
        if (!kinds.is_object())
            user_error("comm calibration {}: links.{}: expected an object of collectives", path, group);
        auto& links = group == "intra" ? c.intra : c.inter;
        for (const auto& [kind, l] : kinds.items()) {
            if (kind != "all_reduce" && kind != "reduce_scatter" && kind != "all_gather") {
                user_error(
                    "comm calibration {}: links.{}.{}: unknown collective; expected all_reduce, reduce_scatter "
                    "or all_gather",
                    path, group, kind);
            }
            const Json* bw = l.is_object() && l.contains("bandwidth_gbs") ? &l["bandwidth_gbs"] : nullptr;
            const Json* lat = l.is_object() && l.contains("latency_us") ? &l["latency_us"] : nullptr;
            if (bw == nullptr || !bw->is_number() || bw->get<double>() <= 0.0 || lat == nullptr || !lat->is_number() ||
                lat->get<double>() < 0.0) {
                user_error(
                    "comm calibration {}: links.{}.{}: expected {{\"bandwidth_gbs\": a positive number, "
                    "\"latency_us\": a number >= 0}}, got {}",
                    path, group, kind, l.dump());
            }
            links[kind] = Link{bw->get<double>() * 1e9, lat->get<double>() * 1e-6};
        }
        if (!links.empty() && links.count("all_reduce") == 0) {
            user_error("comm calibration {}: links.{}: has no all_reduce (the link of the collectives not measured)",
                       path, group);
        }
    }
    if (c.intra.empty() && c.inter.empty()) user_error("comm calibration {}: links: no group measured", path);
    return c;
}

void apply_comm_calibration(Hardware& hw, const CommCalibration& c) {
    if (!c.intra.empty()) hw.intra = c.intra.at("all_reduce"), hw.intra_by_kind = c.intra;
    if (!c.inter.empty()) hw.inter = c.inter.at("all_reduce"), hw.inter_by_kind = c.inter;
}

}  // namespace trainer
