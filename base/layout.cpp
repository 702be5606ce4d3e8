// Builds the ParamLayout from the model config (see layout.h).
#include "base/layout.h"

#include "base/common.h"
#include "base/lora.h"

namespace trainer {
namespace {

void add(Unit& u, std::string name, std::vector<int64_t> shape, ParamKind kind, int layer, const OptimizerConfig& opt) {
    ParamSpec p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= static_cast<size_t>(d);
    p.offset = u.numel;
    p.kind = kind;
    p.layer = layer;
    switch (kind) {
        case ParamKind::kLinearWeight:
        case ParamKind::kLoraA:  // PEFT's adapters are Linear weights; AdamW decays them as it does every weight
        case ParamKind::kLoraB:
            p.decay = true;
            break;
        case ParamKind::kEmbedding:
            p.decay = opt.decay_embeddings;
            break;
        case ParamKind::kNormWeight:
        case ParamKind::kNormBias:
        case ParamKind::kLinearBias:
            p.decay = opt.decay_norm_and_bias;
            break;
    }
    u.numel += p.numel;
    u.params.push_back(std::move(p));
}

void add_norm(Unit& u, const std::string& prefix, int64_t width, int layer, const OptimizerConfig& opt, bool weight,
              bool bias) {
    if (weight) add(u, prefix + ".weight", {width}, ParamKind::kNormWeight, layer, opt);
    if (bias) add(u, prefix + ".bias", {width}, ParamKind::kNormBias, layer, opt);
}
void add_norm(Unit& u, const std::string& prefix, const ModelConfig& m, int layer, const OptimizerConfig& opt) {
    add_norm(u, prefix, m.d_model, layer, opt, m.norm_has_weight(), m.norm_has_bias());
}

void add_linear(Unit& u, const std::string& prefix, int64_t out, int64_t in, const ModelConfig& m, int layer,
                const OptimizerConfig& opt) {
    add(u, prefix + ".weight", {out, in}, ParamKind::kLinearWeight, layer, opt);
    if (m.include_bias) add(u, prefix + ".bias", {out}, ParamKind::kLinearBias, layer, opt);
}

}  // namespace

ParamLayout::ParamLayout(const TrainConfig& config) {
    const ModelConfig& m = config.model;
    const OptimizerConfig& opt = config.optimizer;
    const int64_t C = m.d_model;
    tied_ = m.weight_tying;

    Unit emb{"embedding", {}, 0};
    add(emb, "transformer.wte.weight", {m.embedding_size, C}, ParamKind::kEmbedding, -1, opt);
    wte_numel_ = emb.params.back().numel;
    if (!m.rope) {
        add(emb, "transformer.wpe.weight", {m.max_sequence_length, C}, ParamKind::kEmbedding, -1, opt);
        wpe_numel_ = emb.params.back().numel;
    }
    units_.push_back(std::move(emb));

    for (int l = 0; l < m.n_layers; ++l) {
        Unit b{fmt::format("block.{}", l), {}, 0};
        const std::string p = fmt::format("transformer.blocks.{}.", l);
        add_norm(b, p + "attn_norm", m, l, opt);
        // q | k | v: d_model, then n_kv_heads heads each for k and v (OLMo's fused att_proj).
        add_linear(b, p + "att_proj", m.qkv_size(), C, m, l, opt);
        // QK-norm over the whole q and the whole k (OLMo's q_norm, d_model wide, and k_norm, n_kv_heads heads wide).
        add_norm(b, p + "q_norm", C, l, opt, m.qk_norm_has_weight(), m.qk_norm_has_bias());
        add_norm(b, p + "k_norm", m.kv_size(), l, opt, m.qk_norm_has_weight(), m.qk_norm_has_bias());
        add_linear(b, p + "attn_out", C, C, m, l, opt);
        add_norm(b, p + "ff_norm", m, l, opt);
        add_linear(b, p + "ff_proj", m.ff_proj_size(), C, m, l, opt);
        add_linear(b, p + "ff_out", C, m.ff_hidden_size(), m, l, opt);
        units_.push_back(std::move(b));
    }

    Unit head{"head", {}, 0};
    add_norm(head, "transformer.ln_f", m, -1, opt);
    if (!m.weight_tying) add_linear(head, "transformer.ff_out", m.embedding_size, C, m, -1, opt);
    units_.push_back(std::move(head));
    num_layers_ = m.n_layers;

    if (!config.lora.enabled) return;
    for (Unit& u : units_) {
        u.frozen = true, u.nf4 = config.lora.nf4, u.double_quant = config.lora.double_quant;
        u.bf16_gemms = bf16_mixed(config.precision);
    }
    const std::vector<LoraModule> modules = lora_modules(m, config.lora.targets);
    const int64_t r = config.lora.r;
    for (int l = 0; l < m.n_layers; ++l) {
        Unit a{fmt::format("lora.{}", l), {}, 0};
        const std::string p = fmt::format("transformer.blocks.{}.", l);
        for (const LoraModule& mod : modules) {
            add(a, p + mod.name + ".lora_A.weight", {r, mod.in}, ParamKind::kLoraA, l, opt);
            add(a, p + mod.name + ".lora_B.weight", {mod.rows(), r}, ParamKind::kLoraB, l, opt);
        }
        units_.push_back(std::move(a));
    }
    if (const auto head = lora_head_module(m, config.lora.targets)) {
        Unit a{"lora.head", {}, 0};
        add(a, "lm_head.lora_A.weight", {r, head->in}, ParamKind::kLoraA, -1, opt);
        add(a, "lm_head.lora_B.weight", {head->rows(), r}, ParamKind::kLoraB, -1, opt);
        units_.push_back(std::move(a));
    }
}

size_t ParamLayout::trainable_numel() const {
    size_t n = 0;
    for (const auto& u : units_) n += u.frozen ? 0 : u.numel;
    return n;
}

std::vector<DecaySegment> ParamLayout::decay_segments(int unit) const {
    std::vector<DecaySegment> segs;
    for (const auto& p : units_.at(unit).params) {
        if (!segs.empty() && segs.back().decay == p.decay && segs.back().end == p.offset) {
            segs.back().end = p.offset + p.numel;
        } else {
            segs.push_back({p.offset, p.offset + p.numel, p.decay});
        }
    }
    return segs;
}

bool ParamLayout::find(const std::string& name, int* unit, const ParamSpec** spec) const {
    for (int u = 0; u < num_units(); ++u) {
        for (const auto& p : units_[u].params) {
            if (p.name == name) {
                *unit = u;
                *spec = &p;
                return true;
            }
        }
    }
    return false;
}

size_t ParamLayout::total_numel() const {
    size_t n = 0;
    for (const auto& u : units_) n += u.numel;
    return n;
}

size_t ParamLayout::matmul_numel() const { return total_numel() - wpe_numel_ - (tied_ ? 0 : wte_numel_); }

}  // namespace trainer
