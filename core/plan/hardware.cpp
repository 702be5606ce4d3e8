// Hardware entries read from their files (see hardware.h).
#include "core/plan/hardware.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/json.h"

namespace trainer {
namespace {

// One entry's file, each field checked for its type and range; every field is required, so a file copied
// and edited says everything the plan assumes.
class EntryReader {
   public:
    EntryReader(const Json& j, std::string path) : j_(j), path_(std::move(path)) {}

    const Json& field(const char* key) const {
        if (!j_.contains(key)) user_error("hardware file {}: {}: required, not set", path_, key);
        return j_[key];
    }
    double number(const char* key, double min, double max, bool nullable = false) const {
        const Json& v = field(key);
        if (nullable && v.is_null()) return 0.0;
        if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < min || v.get<double>() > max) {
            user_error("hardware file {}: {}: {}; expected a number in [{}, {}]{}", path_, key, json_text(v), min, max,
                       nullable ? " or null" : "");
        }
        return v.get<double>();
    }
    std::string text(const char* key) const {
        const Json& v = field(key);
        if (!v.is_string() || v.get_ref<const std::string&>().empty())
            user_error("hardware file {}: {}: {}; expected a non-empty string", path_, key, json_text(v));
        return v.get<std::string>();
    }
    // {"bandwidth_gbs": GB/s, "latency_us": microseconds}, or null where `nullable` (no such link).
    Link link(const char* key, bool nullable = false) const {
        const Json& v = field(key);
        if (nullable && v.is_null()) return {};
        const auto part = [&](const char* k, double min) {
            const Json* p = v.is_object() && v.contains(k) ? &v[k] : nullptr;
            if (p == nullptr || !p->is_number() || !std::isfinite(p->get<double>()) || p->get<double>() < min) {
                user_error(
                    "hardware file {}: {}: {}; expected {{\"bandwidth_gbs\": a positive number, \"latency_us\": a "
                    "number >= 0}}{}",
                    path_, key, json_text(v), nullable ? " or null" : "");
            }
            return p->get<double>();
        };
        const double bandwidth = part("bandwidth_gbs", 1e-9), latency = part("latency_us", 0.0);
        return Link{bandwidth * 1e9, latency / 1e6};
    }
    std::vector<std::string> words(const Json& v, const char* key) const {
        std::vector<std::string> out;
        if (!v.is_array()) user_error("hardware file {}: gpu_names.{}: expected a list of words", path_, key);
        for (const Json& w : v) {
            if (!w.is_string() || w.get_ref<const std::string&>().empty())
                user_error("hardware file {}: gpu_names.{}: {}; expected non-empty strings", path_, key, json_text(w));
            out.push_back(w.get<std::string>());
        }
        return out;
    }

   private:
    const Json& j_;
    std::string path_;
};

struct Entry {
    Hardware hw;
    std::vector<std::string> gpu_all, gpu_none;  // gpu_names: empty all: no GPU maps to it
};

Entry read_entry(const std::string& path) {
    const Json j = read_json_file(path, "hardware file");
    if (!j.is_object() || !j.contains("format") || j["format"] != "trainer-hardware") {
        user_error("hardware file {}: expected an object with \"format\": \"trainer-hardware\" (see {})", path,
                   hardware_dir());
    }
    const EntryReader r(j, path);
    Entry e;
    Hardware& h = e.hw;
    h.path = path;
    h.name = r.text("name");
    h.description = r.text("description");
    h.bf16_flops = r.number("bf16_tflops", 0, 1e9) * 1e12;
    h.fp32_flops = r.number("fp32_tflops", 0, 1e9) * 1e12;
    // Optional (entries written before it): 0 where the device has no FP8.
    if (j.contains("fp8_tflops") && !j["fp8_tflops"].is_null()) h.fp8_flops = r.number("fp8_tflops", 0, 1e9) * 1e12;
    h.bandwidth = r.number("memory_bandwidth_gbs", 0, 1e9) * 1e9;
    h.memory_gib = r.number("memory_gib", 0, 1e9);
    h.gemm_efficiency = r.number("gemm_efficiency", 1e-6, 1);
    h.attention_efficiency = r.number("attention_efficiency", 1e-6, 1);
    h.attention_efficiency_64 = r.number("attention_efficiency_64", 1e-6, 1, true);
    h.memory_efficiency = r.number("memory_efficiency", 1e-6, 1);
    h.op_overhead = r.number("op_overhead_us", 0, 1e9) / 1e6;
    h.gemm_overhead = r.number("gemm_overhead_us", 0, 1e9) / 1e6;
    h.intra = r.link("intra_node");
    h.inter = r.link("inter_node");
    // Optional (entries written before it have one link a rank).
    if (j.contains("inter_node_links") && !j["inter_node_links"].is_null())
        h.inter_node_links = static_cast<int>(r.number("inter_node_links", 1, 1 << 20));
    h.host_link = r.link("host_link", true);
    h.host_bandwidth = r.number("host_memory_bandwidth_gbs", 0, 1e9) * 1e9;
    h.comm_compute_share = r.number("comm_compute_share", 0, 0.99);
    const Json& cores = r.field("cores");
    h.cores = cores.is_null() ? 0 : static_cast<int>(r.number("cores", 1, 1 << 20));
    // cores null: this machine's, where the entry is one of CPUs (they share the node's cores).
    if (cores.is_null() && h.bf16_flops <= 0.0 && h.fp32_flops <= 0.0)
        h.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const Json& names = r.field("gpu_names");
    if (!names.is_null()) {
        if (!names.is_object() || !names.contains("all") || !names.contains("none"))
            user_error("hardware file {}: gpu_names: expected {{\"all\": [words], \"none\": [words]}} or null", path);
        e.gpu_all = r.words(names["all"], "all");
        e.gpu_none = r.words(names["none"], "none");
    }
    return e;
}

// Every entry read so far, by the name or path it was asked by.
std::map<std::string, std::unique_ptr<Entry>>& cache() {
    static std::map<std::string, std::unique_ptr<Entry>> c;
    return c;
}

bool is_path(const std::string& s) {
    return s.find('/') != std::string::npos || (s.size() > 5 && s.compare(s.size() - 5, 5, ".json") == 0);
}

const Entry* find_entry(const std::string& name_or_path) {
    auto& c = cache();
    if (const auto it = c.find(name_or_path); it != c.end()) return it->second.get();
    std::string path = name_or_path;
    if (!is_path(name_or_path)) {
        path = hardware_dir() + "/" + name_or_path + ".json";
        std::error_code ec;
        if (!std::filesystem::is_regular_file(path, ec)) return nullptr;
    }
    auto e = std::make_unique<Entry>(read_entry(path));
    if (!is_path(name_or_path) && e->hw.name != name_or_path)
        user_error("hardware file {}: name: \"{}\"; expected \"{}\", the file's name", path, e->hw.name, name_or_path);
    return (c[name_or_path] = std::move(e)).get();
}

// The names of the folder's entries, sorted.
std::vector<std::string> entry_names() {
    std::vector<std::string> names;
    std::error_code ec;
    for (const auto& f : std::filesystem::directory_iterator(hardware_dir(), ec)) {
        if (f.path().extension() == ".json") names.push_back(f.path().stem().string());
    }
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

std::string hardware_dir() { return trainer_data_dir("configs/hardware", "configs/hardware"); }

const Hardware* find_hardware(const std::string& name_or_path) {
    const Entry* e = find_entry(name_or_path);
    return e != nullptr ? &e->hw : nullptr;
}

std::string hardware_names() {
    std::string out;
    for (const std::string& n : entry_names()) out += (out.empty() ? "" : ", ") + n;
    return out.empty() ? "none: " + hardware_dir() + " holds no entry" : out;
}

const Hardware* hardware_for_gpu(const std::string& device_name) {
    const auto has = [&](const std::string& word) { return device_name.find(word) != std::string::npos; };
    for (const std::string& n : entry_names()) {
        const Entry* e = find_entry(n);
        if (e == nullptr || e->gpu_all.empty()) continue;
        if (std::all_of(e->gpu_all.begin(), e->gpu_all.end(), has) &&
            std::none_of(e->gpu_none.begin(), e->gpu_none.end(), has)) {
            return &e->hw;
        }
    }
    return nullptr;
}

const Link& link_for(const Hardware& hw, const std::string& kind, bool spans_nodes) {
    const auto& measured = spans_nodes ? hw.inter_by_kind : hw.intra_by_kind;
    const auto it = measured.find(kind);
    return it != measured.end() ? it->second : spans_nodes ? hw.inter : hw.intra;
}

double attention_efficiency_at(const Hardware& hw, int head_size) {
    if (hw.attention_efficiency_64 <= 0.0 || head_size >= 128) return hw.attention_efficiency;
    const double halvings = std::log2(128.0 / std::max(head_size, 64));  // 0 at 128, 1 at 64
    return hw.attention_efficiency * std::pow(hw.attention_efficiency_64 / hw.attention_efficiency, halvings);
}

}  // namespace trainer
