// Measured op times and links (see calibration.h).
#include "core/plan/calibration.h"

#include <cstdint>

#include "base/common.h"
#include "base/json.h"

namespace trainer {

Calibration read_calibration(const std::string& path) {
    const Json j = read_json_file(path, "calibration");
    if (j.value("format", "") != "trainer-calibration" || !j.contains("ops") || !j["ops"].is_array()) {
        user_error("calibration {}: not a file of trainer bench-kernels --calibration-out", path);
    }
    Calibration c;
    c.path = path;
    c.bandwidth = j.value("bandwidth", 0.0);
    c.peak_flops = j.value("peak_flops", 0.0);
    c.step_scale = j.value("step_scale", 1.0);
    c.threads = j.value("threads", 0);
    c.ranks_per_node = j.value("ranks_per_node", 1);
    if (c.ranks_per_node < 1) user_error("calibration {}: ranks_per_node: expected at least 1", path);
    c.cores = j.value("cores", 0);
    if (c.cores < 0) user_error("calibration {}: cores: {}; expected at least 1 (or absent)", path, c.cores);
    for (const Json& e : j["ops"]) {
        Calibration::Entry entry{e.value("op", ""), e.value("flops", 0.0), e.value("bytes", 0.0),
                                 e.value("seconds", 0.0)};
        if (entry.op.empty() || entry.seconds <= 0.0 || (entry.flops <= 0.0 && entry.bytes <= 0.0)) {
            user_error("calibration {}: an entry without an op, its work or a positive time: {}", path, e.dump());
        }
        c.entries.push_back(entry);
    }
    return c;
}

CommCalibration read_comm_calibration(const std::string& path) {
    const Json j = read_json_file(path, "comm calibration");
    if (!j.is_object() || j.value("format", "") != "trainer-comm-calibration" || !j.contains("links") ||
        !j["links"].is_object()) {
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
