// LoRA adapters in PEFT's format (see peft.h).
#include "core/weights/peft.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "base/common.h"
#include "base/files.h"
#include "base/lora.h"
#include "kernels/element.h"

namespace trainer {

namespace {

// The Hugging Face module a LoRA module of block l is.
std::string hf_module(const ModelConfig& m, int l, const LoraModule& mod) {
    if (!m.rope) {
        const std::string h = fmt::format("transformer.h.{}.", l);
        if (mod.name == "c_attn" || mod.name == "c_proj") return h + "attn." + mod.name;
        return h + (mod.name == "c_fc" ? "mlp.c_fc" : "mlp.c_proj");
    }
    const bool attention = mod.linear == LoraLinear::kAttProj || mod.linear == LoraLinear::kAttnOut;
    return fmt::format("model.layers.{}.{}.{}", l, attention ? "self_attn" : "mlp", mod.name);
}

// Each adapter parameter of the layout: its PEFT name, its unit and spec.
struct PeftParam {
    std::string name;
    int unit = 0;
    const ParamSpec* spec = nullptr;
};
std::vector<PeftParam> peft_params(const TrainConfig& config, const ParamLayout& layout) {
    TRAINER_CHECK(layout.has_adapters(), "PEFT names of a layout without adapters");
    std::vector<PeftParam> v;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (const LoraModule& mod : lora_modules(config.model, config.lora.targets)) {
            for (const char* ab : {"lora_A", "lora_B"}) {
                PeftParam p;
                p.name = "base_model.model." + hf_module(config.model, l, mod) + "." + ab + ".weight";
                const std::string ours = fmt::format("transformer.blocks.{}.{}.{}.weight", l, mod.name, ab);
                TRAINER_CHECK(layout.find(ours, &p.unit, &p.spec), "no adapter parameter {}", ours);
                v.push_back(std::move(p));
            }
        }
    }
    if (lora_head_module(config.model, config.lora.targets)) {
        for (const char* ab : {"lora_A", "lora_B"}) {
            PeftParam p;
            p.name = fmt::format("base_model.model.lm_head.{}.weight", ab);
            const std::string ours = fmt::format("lm_head.{}.weight", ab);
            TRAINER_CHECK(layout.find(ours, &p.unit, &p.spec), "no adapter parameter {}", ours);
            v.push_back(std::move(p));
        }
    }
    return v;
}

// W (rows x in) += scaling B A, B (rows x r), A (r x in), summed in double.
void merge_into(float* W, const float* A, const float* B, int64_t rows, int64_t in, int r, double scaling) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        for (int64_t k = 0; k < in; ++k) {
            double s = 0.0;
            for (int j = 0; j < r; ++j) s += static_cast<double>(B[i * r + j]) * A[j * in + k];
            W[i * in + k] = static_cast<float>(W[i * in + k] + scaling * s);
        }
    }
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> to_peft_tensors(const TrainConfig& config, const ParamLayout& layout,
                                                            const std::vector<std::vector<float>>& units) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const PeftParam& p : peft_params(config, layout)) {
        Tensor t;
        t.shape = p.spec->shape;
        const float* src = units.at(p.unit).data() + p.spec->offset;
        t.data.assign(src, src + p.spec->numel);
        out.emplace_back(p.name, std::move(t));
    }
    return out;
}

void from_peft_tensors(const TrainConfig& config, const ParamLayout& layout,
                       const std::map<std::string, Tensor>& tensors, const std::string& file,
                       std::vector<std::vector<float>>& units) {
    std::set<std::string> used;
    for (const PeftParam& p : peft_params(config, layout)) {
        const auto it = tensors.find(p.name);
        if (it == tensors.end()) {
            user_error("lora.init_from {}: no tensor {} (the adapter of lora.targets {} {})", file, p.name,
                       fmt::join(config.lora.targets, ", "),
                       p.spec->layer >= 0 ? fmt::format("in block {}", p.spec->layer) : std::string("on the LM head"));
        }
        if (it->second.shape != p.spec->shape) {
            user_error("lora.init_from {}: tensor {} has shape [{}]; this run's (lora.r {}) is [{}]", file, p.name,
                       fmt::join(it->second.shape, ", "), config.lora.r, fmt::join(p.spec->shape, ", "));
        }
        std::copy(it->second.data.begin(), it->second.data.end(), units.at(p.unit).begin() + p.spec->offset);
        used.insert(p.name);
    }
    for (const auto& [name, t] : tensors) {
        if (used.count(name) == 0) {
            user_error(
                "lora.init_from {}: tensor {} is no adapter of this run (lora.targets {}); adapt the same "
                "modules as the adapter does",
                file, name, fmt::join(config.lora.targets, ", "));
        }
    }
}

Json peft_adapter_config(const TrainConfig& config, const std::string& base) {
    std::vector<std::string> targets;
    for (const std::string& t : config.lora.targets) targets.push_back(t == "c_proj" ? "attn.c_proj" : t);
    return {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"base_model_name_or_path", base.empty() ? Json(nullptr) : Json(base)},
            {"r", config.lora.r},
            {"lora_alpha", config.lora.alpha},
            {"lora_dropout", config.lora.dropout},
            {"use_rslora", config.lora.use_rslora},
            {"target_modules", targets},
            {"bias", "none"},
            {"fan_in_fan_out", !config.model.rope},  // GPT-2's Conv1D layers store (in, out)
            {"modules_to_save", nullptr},
            {"init_lora_weights", true},
            {"layers_to_transform", nullptr},
            {"layers_pattern", nullptr},
            {"rank_pattern", Json::object()},
            {"alpha_pattern", Json::object()},
            {"use_dora", false},
            {"inference_mode", true},
            {"revision", nullptr}};
}

void write_peft_adapter_files(const TrainConfig& config, const ParamLayout& layout,
                              const std::vector<std::vector<float>>& units, const std::string& dir,
                              const std::string& what) {
    const auto tensors = to_peft_tensors(config, layout, units);
    std::vector<TensorRef> refs;
    for (const auto& [name, t] : tensors) refs.push_back({name, t.shape, t.data.data()});
    write_safetensors(dir + "/adapter_model.safetensors", refs, {{"format", "pt"}});
    write_text_file(dir + "/adapter_config.json",
                    peft_adapter_config(config, config.init_from.value_or("")).dump(2) + "\n", what);
}

void write_peft_adapter(const TrainConfig& config, const ParamLayout& layout,
                        const std::vector<std::vector<float>>& units, const std::string& dir) {
    write_new_directory(dir, "export --adapter", [&](const std::string& tmp) {
        write_peft_adapter_files(config, layout, units, tmp, "export --adapter");
    });
}

void read_peft_adapter(const TrainConfig& config, const ParamLayout& layout, const std::string& path,
                       std::vector<std::vector<float>>& units) {
    std::string file = path;
    if (is_directory_path(path)) {
        file = path + "/adapter_model.safetensors";
        const std::string cfg_path = path + "/adapter_config.json";
        if (path_exists(cfg_path)) {
            const std::string what = "lora.init_from " + cfg_path;
            const Json c = parse_json(read_file(cfg_path, "lora.init_from"), what);
            require_json_object(c, what);
            const auto differs = [&](const char* key, const Json& ours, const char* our_key) {
                if (c.contains(key) && !c[key].is_null() && c[key] != ours) {
                    user_error("lora.init_from {}: its {} is {}, this run's {} is {}; set {} to match", cfg_path, key,
                               c[key].dump(), our_key, ours.dump(), our_key);
                }
            };
            if (json_field<std::string>(c, "peft_type", "LORA", what) != "LORA")
                user_error("lora.init_from {}: peft_type {}; expected LORA", cfg_path, json_text(c["peft_type"]));
            differs("r", config.lora.r, "lora.r");
            const double alpha = json_field<double>(c, "lora_alpha", config.lora.alpha, what);
            if (std::fabs(alpha - config.lora.alpha) > 1e-9 * std::fabs(config.lora.alpha)) {
                user_error(
                    "lora.init_from {}: its lora_alpha is {}, this run's lora.alpha is {}; set lora.alpha to "
                    "match",
                    cfg_path, json_text(c["lora_alpha"]), config.lora.alpha);
            }
            differs("use_rslora", config.lora.use_rslora, "lora.use_rslora");
            if (json_field<bool>(c, "use_dora", false, what))
                user_error("lora.init_from {}: a DoRA adapter (use_dora); expected LoRA", cfg_path);
        }
    }
    if (!path_exists(file))
        user_error("lora.init_from {}: no such file (a PEFT adapter directory or its safetensors)", file);
    const std::map<std::string, Tensor> tensors = read_safetensors(file);
    require_finite(tensors, "lora.init_from " + file);
    from_peft_tensors(config, layout, tensors, file, units);
}

std::string tensors_checksum(const std::map<std::string, Tensor>& tensors) {
    uint64_t h = 0x6c6f72615f626173ull;
    const auto mix_in = [&h](uint64_t x) { h = mix64(h ^ x); };
    for (const auto& [name, t] : tensors) {
        for (unsigned char c : name) mix_in(c);
        for (int64_t d : t.shape) mix_in(static_cast<uint64_t>(d));
        // Chunks hashed in parallel, their hashes mixed in order: the same value on any thread count.
        const size_t n = t.data.size(), chunk = size_t(1) << 16, chunks = (n + chunk - 1) / chunk;
        std::vector<uint64_t> part(chunks);
#pragma omp parallel for schedule(static)
        for (long long c = 0; c < static_cast<long long>(chunks); ++c) {
            uint64_t p = static_cast<uint64_t>(c) * 0x9e3779b97f4a7c15ull;
            const size_t end = std::min(n, static_cast<size_t>(c + 1) * chunk);
            for (size_t i = static_cast<size_t>(c) * chunk; i < end; ++i) {
                uint32_t bits = 0;
                std::memcpy(&bits, &t.data[i], sizeof bits);
                p = (p ^ bits) * 0x100000001b3ull + (p >> 29);
            }
            part[c] = p;
        }
        for (uint64_t p : part) mix_in(p);
    }
    return fmt::format("{:016x}", h);
}

void merge_lora(const TrainConfig& config, const ParamLayout& layout, std::vector<std::vector<float>>& units) {
    const char* linears[] = {"att_proj", "attn_out", "ff_proj", "ff_out"};
    const double scaling = config.lora.scaling();
    const int r = config.lora.r;
    for (int l = 0; l < layout.num_layers(); ++l) {
        for (const LoraModule& mod : lora_modules(config.model, config.lora.targets)) {
            const std::string p = fmt::format("transformer.blocks.{}.", l);
            int wu = -1, au = -1, bu = -1;
            const ParamSpec *ws = nullptr, *as = nullptr, *bs = nullptr;
            TRAINER_CHECK(layout.find(p + linears[static_cast<int>(mod.linear)] + ".weight", &wu, &ws) &&
                              layout.find(p + mod.name + ".lora_A.weight", &au, &as) &&
                              layout.find(p + mod.name + ".lora_B.weight", &bu, &bs),
                          "merge_lora: block {} module {}", l, mod.name);
            merge_into(units.at(wu).data() + ws->offset + mod.row_begin * mod.in, units.at(au).data() + as->offset,
                       units.at(bu).data() + bs->offset, mod.rows(), mod.in, r, scaling);
        }
    }
    if (const auto head = lora_head_module(config.model, config.lora.targets)) {
        int wu = -1, au = -1, bu = -1;
        const ParamSpec *ws = nullptr, *as = nullptr, *bs = nullptr;
        TRAINER_CHECK(layout.find("transformer.ff_out.weight", &wu, &ws) &&
                          layout.find("lm_head.lora_A.weight", &au, &as) &&
                          layout.find("lm_head.lora_B.weight", &bu, &bs),
                      "merge_lora: the LM head");
        merge_into(units.at(wu).data() + ws->offset, units.at(au).data() + as->offset, units.at(bu).data() + bs->offset,
                   head->rows(), head->in, r, scaling);
    }
}

}  // namespace trainer
