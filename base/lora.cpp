// LoRA's target modules (see lora.h).
#include "base/lora.h"

#include <algorithm>
#include <cmath>

#include "base/common.h"

namespace trainer {

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / r; }

namespace {

// Every module of the shape, in layout order.
std::vector<LoraModule> all_modules(const ModelConfig& m) {
    const int64_t C = m.d_model, KV = m.kv_size(), P = m.ff_proj_size(), H = m.ff_hidden_size();
    std::vector<LoraModule> v;
    auto add = [&](const char* name, LoraLinear linear, int64_t begin, int64_t end, int64_t in) {
        LoraModule mod;
        mod.name = name, mod.linear = linear, mod.row_begin = begin, mod.row_end = end, mod.in = in;
        mod.id = static_cast<int>(v.size());
        v.push_back(mod);
    };
    if (!m.rope) {
        add("c_attn", LoraLinear::kAttProj, 0, m.qkv_size(), C);
        add("c_proj", LoraLinear::kAttnOut, 0, C, C);
        add("c_fc", LoraLinear::kFfProj, 0, P, C);
        add("mlp.c_proj", LoraLinear::kFfOut, 0, C, H);
        return v;
    }
    add("q_proj", LoraLinear::kAttProj, 0, C, C);
    add("k_proj", LoraLinear::kAttProj, C, C + KV, C);
    add("v_proj", LoraLinear::kAttProj, C + KV, C + 2 * KV, C);
    add("o_proj", LoraLinear::kAttnOut, 0, C, C);
    if (m.activation_type == ActivationType::kSwiglu) {
        add("up_proj", LoraLinear::kFfProj, 0, P / 2, C);  // OLMo's ff_proj: x (up), then the gate
        add("gate_proj", LoraLinear::kFfProj, P / 2, P, C);
    } else {
        add("up_proj", LoraLinear::kFfProj, 0, P, C);  // a GELU MLP's one input Linear
    }
    add("down_proj", LoraLinear::kFfOut, 0, C, H);
    return v;
}

}  // namespace

// The LM head's adapter: its id follows every block module's (the dropout masks' key).
LoraModule head_module(const ModelConfig& m) {
    LoraModule mod;
    mod.name = "lm_head", mod.linear = LoraLinear::kHead, mod.row_begin = 0, mod.row_end = m.embedding_size;
    mod.in = m.d_model, mod.id = 15;
    return mod;
}

std::vector<std::string> lora_module_names(const ModelConfig& m) {
    std::vector<std::string> names;
    for (const LoraModule& mod : all_modules(m)) names.push_back(mod.name);
    if (!m.weight_tying) names.push_back("lm_head");
    return names;
}

std::vector<std::string> lora_default_targets(const ModelConfig& m) {
    if (!m.rope) return {"c_attn"};
    return {"q_proj", "v_proj"};
}

std::vector<LoraModule> lora_modules(const ModelConfig& m, const std::vector<std::string>& targets) {
    const std::vector<LoraModule> all = all_modules(m);
    const std::vector<std::string> names = lora_module_names(m);
    const std::vector<std::string> wanted = targets.empty() ? lora_default_targets(m) : targets;
    for (size_t i = 0; i < wanted.size(); ++i) {
        const std::string& t = wanted[i];
        if (t == "lm_head" && m.weight_tying) {
            user_error(
                "config lora.targets[{}]: \"lm_head\" is the token embedding here (model.weight_tying), and an "
                "adapter beside a tied head could not be merged into it alone; leave lm_head out, or untie the head",
                i);
        }
        if (std::find(names.begin(), names.end(), t) == names.end()) {
            const char* why = m.rope ? "" : " (a model without RoPE takes GPT-2's names)";
            user_error("config lora.targets[{}]: \"{}\" is no module of this model{}; expected one of {}", i, t, why,
                       fmt::join(names, ", "));
        }
        for (size_t j = 0; j < i; ++j) {
            if (wanted[j] == t) user_error("config lora.targets[{}]: \"{}\" is lora.targets[{}] too", i, t, j);
        }
    }
    std::vector<LoraModule> v;
    for (const LoraModule& mod : all) {
        if (std::find(wanted.begin(), wanted.end(), mod.name) != wanted.end()) v.push_back(mod);
    }
    return v;
}

std::optional<LoraModule> lora_head_module(const ModelConfig& m, const std::vector<std::string>& targets) {
    if (std::find(targets.begin(), targets.end(), "lm_head") == targets.end()) return std::nullopt;
    lora_modules(m, targets);  // refuses what lora_modules refuses (a tied head)
    return head_module(m);
}

}  // namespace trainer
