// Mapping between the trainer's OLMo-named flat units and Hugging Face tensors (see hf_names.h).
#include "core/weights/hf_names.h"

#include <cstring>
#include <functional>
#include <set>

#include "base/common.h"

namespace trainer {
namespace {

// One Hugging Face tensor as a view of trainer parameter rows: rows [row_begin, row_end) of `param`
// (a 1-D parameter counts as one row of numel), optionally transposed.
struct HfEntry {
    std::string hf_name;
    std::string param;
    int64_t row_begin = 0, row_end = -1;  // -1: all rows
    bool transpose = false;
};

std::vector<HfEntry> hf_entries(const TrainConfig& config) {
    const ModelConfig& m = config.model;
    const std::string family = hf_family(m, "Hugging Face names");
    const int64_t C = m.d_model, KV = m.kv_size(), P = m.ff_proj_size();
    std::vector<HfEntry> e;
    if (family == "gpt2") {
        e.push_back({"transformer.wte.weight", "transformer.wte.weight"});
        e.push_back({"transformer.wpe.weight", "transformer.wpe.weight"});
        for (int l = 0; l < m.n_layers; ++l) {
            const std::string h = fmt::format("transformer.h.{}.", l), b = fmt::format("transformer.blocks.{}.", l);
            e.push_back({h + "ln_1.weight", b + "attn_norm.weight"});
            e.push_back({h + "ln_1.bias", b + "attn_norm.bias"});
            e.push_back({h + "attn.c_attn.weight", b + "att_proj.weight", 0, -1, true});
            e.push_back({h + "attn.c_attn.bias", b + "att_proj.bias"});
            e.push_back({h + "attn.c_proj.weight", b + "attn_out.weight", 0, -1, true});
            e.push_back({h + "attn.c_proj.bias", b + "attn_out.bias"});
            e.push_back({h + "ln_2.weight", b + "ff_norm.weight"});
            e.push_back({h + "ln_2.bias", b + "ff_norm.bias"});
            e.push_back({h + "mlp.c_fc.weight", b + "ff_proj.weight", 0, -1, true});
            e.push_back({h + "mlp.c_fc.bias", b + "ff_proj.bias"});
            e.push_back({h + "mlp.c_proj.weight", b + "ff_out.weight", 0, -1, true});
            e.push_back({h + "mlp.c_proj.bias", b + "ff_out.bias"});
        }
        e.push_back({"transformer.ln_f.weight", "transformer.ln_f.weight"});
        e.push_back({"transformer.ln_f.bias", "transformer.ln_f.bias"});
    } else {
        // OlmoForCausalLM; Olmo2ForCausalLM with its QK-norms and its norms after the sublayers (named post_*:
        // OLMo's attn_norm and ff_norm) and the final norm, each a weight; LlamaForCausalLM with its norms before
        // the sublayers (input_layernorm and post_attention_layernorm: OLMo's attn_norm and ff_norm) and the final
        // norm. k_proj and v_proj are n_kv_heads heads each.
        const bool olmo2 = family == "olmo2", llama = family == "llama";
        e.push_back({"model.embed_tokens.weight", "transformer.wte.weight"});
        for (int l = 0; l < m.n_layers; ++l) {
            const std::string h = fmt::format("model.layers.{}.", l), b = fmt::format("transformer.blocks.{}.", l);
            if (llama) e.push_back({h + "input_layernorm.weight", b + "attn_norm.weight"});
            e.push_back({h + "self_attn.q_proj.weight", b + "att_proj.weight", 0, C});
            e.push_back({h + "self_attn.k_proj.weight", b + "att_proj.weight", C, C + KV});
            e.push_back({h + "self_attn.v_proj.weight", b + "att_proj.weight", C + KV, C + 2 * KV});
            e.push_back({h + "self_attn.o_proj.weight", b + "attn_out.weight"});
            if (olmo2) {
                e.push_back({h + "self_attn.q_norm.weight", b + "q_norm.weight"});
                e.push_back({h + "self_attn.k_norm.weight", b + "k_norm.weight"});
                e.push_back({h + "post_attention_layernorm.weight", b + "attn_norm.weight"});
            }
            if (llama) e.push_back({h + "post_attention_layernorm.weight", b + "ff_norm.weight"});
            e.push_back({h + "mlp.up_proj.weight", b + "ff_proj.weight", 0, P / 2});
            e.push_back({h + "mlp.gate_proj.weight", b + "ff_proj.weight", P / 2, P});
            e.push_back({h + "mlp.down_proj.weight", b + "ff_out.weight"});
            if (olmo2) e.push_back({h + "post_feedforward_layernorm.weight", b + "ff_norm.weight"});
        }
        if (olmo2 || llama) e.push_back({"model.norm.weight", "transformer.ln_f.weight"});
        if (!m.weight_tying) e.push_back({"lm_head.weight", "transformer.ff_out.weight"});
    }
    return e;
}

// Shape of an entry as Hugging Face stores it.
std::vector<int64_t> hf_shape(const HfEntry& e, const ParamSpec& p) {
    std::vector<int64_t> shape = p.shape;
    if (e.row_end >= 0) shape[0] = e.row_end - e.row_begin;
    if (e.transpose) std::swap(shape[0], shape[1]);
    return shape;
}

std::string shape_str(const std::vector<int64_t>& s) {
    std::string out = "(";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
    return out + (s.size() == 1 ? ",)" : ")");
}

// Copies between a Hugging Face tensor (hf, row-major in hf_shape) and the trainer's rows of a parameter.
void copy_entry(const HfEntry& e, const ParamSpec& p, float* unit, float* hf, bool to_hf, int64_t rows_limit = -1) {
    const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
    const int64_t r0 = e.row_end >= 0 ? e.row_begin : 0;
    int64_t r1 = e.row_end >= 0 ? e.row_end : p.shape[0];
    if (rows_limit >= 0) r1 = r0 + rows_limit;
    const int64_t rows = r1 - r0;
    float* base = unit + p.offset + r0 * cols;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
            float& ours = base[r * cols + c];
            float& theirs = e.transpose ? hf[c * rows + r] : hf[r * cols + c];
            if (to_hf)
                theirs = ours;
            else
                ours = theirs;
        }
    }
}

}  // namespace

std::string hf_family(const ModelConfig& m, const std::string& what) {
    if (!m.rope) {
        std::vector<std::string> diff;
        if (m.activation_type == ActivationType::kSwiglu)
            diff.push_back("model.activation_type must be gelu_tanh or gelu");
        if (!m.layer_norm_with_affine || !m.bias_for_layer_norm) {
            diff.push_back("model.layer_norm_with_affine and bias_for_layer_norm must be true");
        }
        if (!m.include_bias) diff.push_back("model.include_bias must be true");
        if (!m.weight_tying) diff.push_back("model.weight_tying must be true");
        if (m.n_kv_heads != m.n_heads)
            diff.push_back("model.n_kv_heads must equal n_heads (GPT-2 has no shared heads)");
        if (diff.empty()) return "gpt2";
        std::string msg = diff[0];
        for (size_t i = 1; i < diff.size(); ++i) msg += "; " + diff[i];
        user_error("{}: a model without RoPE maps to GPT2LMHeadModel, but {}", what, msg);
    }
    // OLMo-2's shape (RMSNorm with weights after the sublayers, QK-norm) is Olmo2ForCausalLM; the first OLMo's
    // (non-parametric LayerNorm before them) OlmoForCausalLM. Which one a RoPE model is meant to be is told by
    // norm_after.
    std::vector<std::string> diff;
    if (m.activation_type != ActivationType::kSwiglu) diff.push_back("model.activation_type must be swiglu");
    if (m.include_bias) diff.push_back("model.include_bias must be false");
    if (m.norm_after) {
        if (!m.rms_norm()) diff.push_back("model.layer_norm_type must be rms");
        if (!m.layer_norm_with_affine || m.bias_for_layer_norm) {
            diff.push_back("model.layer_norm_with_affine must be true and bias_for_layer_norm false");
        }
        if (!m.attention_layer_norm || !m.attention_layer_norm_with_affine) {
            diff.push_back("model.attention_layer_norm and attention_layer_norm_with_affine must be true");
        }
        if (diff.empty()) return "olmo2";
        user_error("{}: a RoPE model with norm_after maps to Olmo2ForCausalLM, but {}", what, fmt::join(diff, "; "));
    }
    if (m.attention_layer_norm) diff.push_back("model.attention_layer_norm must be false");
    // Norms before the sublayers: RMSNorm with a weight is LlamaForCausalLM's, OLMo's non-parametric LayerNorm
    // OlmoForCausalLM's.
    if (m.rms_norm()) {
        if (!m.layer_norm_with_affine || m.bias_for_layer_norm) {
            diff.push_back("model.layer_norm_with_affine must be true and bias_for_layer_norm false");
        }
        if (diff.empty()) return "llama";
        user_error("{}: a RoPE model with RMSNorm before the sublayers maps to LlamaForCausalLM, but {}", what,
                   fmt::join(diff, "; "));
    }
    if (m.layer_norm_with_affine) diff.push_back("model.layer_norm_with_affine must be false");
    if (diff.empty()) return "olmo";
    user_error(
        "{}: a RoPE model maps to OlmoForCausalLM (LayerNorm without parameters), LlamaForCausalLM (layer_norm_type "
        "rms) or Olmo2ForCausalLM (norm_after), but {}",
        what, fmt::join(diff, "; "));
}

std::vector<std::pair<std::string, Tensor>> to_hf_tensors(const TrainConfig& config, const ParamLayout& layout,
                                                          const std::vector<std::vector<float>>& units) {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const HfEntry& e : hf_entries(config)) {
        int u = 0;
        const ParamSpec* p = nullptr;
        TRAINER_CHECK(layout.find(e.param, &u, &p), "no parameter {}", e.param);
        Tensor t;
        t.shape = hf_shape(e, *p);
        size_t n = 1;
        for (int64_t d : t.shape) n *= static_cast<size_t>(d);
        t.data.resize(n);
        copy_entry(e, *p, const_cast<float*>(units[u].data()), t.data.data(), true);
        out.emplace_back(e.hf_name, std::move(t));
    }
    return out;
}

void from_hf_tensors(const TrainConfig& config, const ParamLayout& layout, const std::map<std::string, Tensor>& tensors,
                     const std::string& file, std::vector<std::vector<float>>& units) {
    const std::string family = hf_family(config.model, "--init-from " + file);
    std::set<std::string> used;
    // GPT-2 checkpoints are found both with and without the "transformer." prefix (GPT2LMHeadModel vs
    // GPT2Model); the attention-mask buffers some of them carry are not parameters and are skipped.
    auto lookup = [&](const std::string& name) -> const std::pair<const std::string, Tensor>* {
        auto it = tensors.find(name);
        if (it == tensors.end() && family == "gpt2" && name.rfind("transformer.", 0) == 0) {
            it = tensors.find(name.substr(std::strlen("transformer.")));
        }
        return it == tensors.end() ? nullptr : &*it;
    };
    for (const HfEntry& e : hf_entries(config)) {
        int u = 0;
        const ParamSpec* p = nullptr;
        TRAINER_CHECK(layout.find(e.param, &u, &p), "no parameter {}", e.param);
        const auto* found = lookup(e.hf_name);
        if (!found) user_error("--init-from {}: tensor \"{}\" is missing", file, e.hf_name);
        used.insert(found->first);
        std::vector<int64_t> want = hf_shape(e, *p);
        const Tensor& t = found->second;
        int64_t rows_limit = -1;
        const bool is_wte = e.param == "transformer.wte.weight";
        if (is_wte && t.shape.size() == 2 && t.shape[1] == want[1] && t.shape[0] == config.model.vocab_size &&
            t.shape[0] < want[0]) {
            rows_limit = t.shape[0];  // unpadded vocabulary: fill the first vocab_size rows
        } else if (t.shape != want) {
            user_error("--init-from {}: tensor \"{}\" has shape {}; the config expects {}", file, found->first,
                       shape_str(t.shape), shape_str(want));
        }
        copy_entry(e, *p, units[u].data(), const_cast<float*>(t.data.data()), false, rows_limit);
    }
    for (const auto& [name, t] : tensors) {
        if (used.count(name)) continue;
        const bool mask_buffer =
            family == "gpt2" && (name.size() > 9 && (name.compare(name.size() - 9, 9, "attn.bias") == 0 ||
                                                     name.find("attn.masked_bias") != std::string::npos));
        if (mask_buffer) continue;
        if (name == "lm_head.weight" && config.model.weight_tying) {
            // A tied head saved anyway must equal the embedding it is tied to.
            const auto* wte = lookup(family == "gpt2" ? "transformer.wte.weight" : "model.embed_tokens.weight");
            if (wte && wte->second.shape == t.shape && wte->second.data == t.data) continue;
            user_error(
                "--init-from {}: tensor \"lm_head.weight\" differs from the token embedding, but "
                "model.weight_tying is true",
                file);
        }
        user_error("--init-from {}: unexpected tensor \"{}\" (not a parameter of this model config)", file, name);
    }
}

}  // namespace trainer
