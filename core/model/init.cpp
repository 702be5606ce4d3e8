// Parameter initialisation as OLMo's init_weights (see init.h), and the weights for inference.
//
// mitchell: every Linear weight ~ N(0, 1/fan_in) truncated at +-3 sigma; the block output projections
// (attn_out, ff_out) further divided by sqrt(2 (layer + 1)); embeddings and the untied LM head use
// 1/sqrt(d_model). normal: N(0, init_std), truncated at +-init_cutoff_factor * std when set.
// Biases are zero, LayerNorm weights one. LoRA's adapters as PEFT's: B zero (the adapted model starts as its
// base), A uniform in +-1/sqrt(in) (kaiming_uniform with a = sqrt(5)).
//
// Random numbers come from a counter-based generator: element i of parameter `name` draws from
// splitmix64(hash(seed, name), i, attempt), so any thread count or unit order gives the same weights.
#include "core/model/init.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "base/common.h"
#include "base/layout.h"
#include "core/weights/checkpoint.h"
#include "core/weights/hf_names.h"
#include "core/weights/peft.h"
#include "parallel/strategy/packed_unit.h"
#include "parallel/strategy/strategy.h"

namespace trainer {
namespace {

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t hash_name(const std::string& s) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

// Standard normal from two uniforms of (key, index, attempt) by Box-Muller, in double.
double normal_at(uint64_t key, uint64_t index, uint64_t attempt) {
    const uint64_t a = splitmix64(key ^ splitmix64(index * 2 + 0x1234567ull + (attempt << 40)));
    const uint64_t b = splitmix64(a ^ 0x5851f42d4c957f2dull);
    const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;          // [0, 1)
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

void init_unit_params(const TrainConfig& config, const Unit& unit, float* host) {
    const ModelConfig& m = config.model;
    for (const ParamSpec& p : unit.params) {
        float* out = host + p.offset;
        if (p.kind == ParamKind::kLinearBias || p.kind == ParamKind::kNormBias || p.kind == ParamKind::kLoraB) {
            for (size_t i = 0; i < p.numel; ++i) out[i] = 0.0f;
            continue;
        }
        if (p.kind == ParamKind::kNormWeight) {
            for (size_t i = 0; i < p.numel; ++i) out[i] = 1.0f;
            continue;
        }
        if (p.kind == ParamKind::kLoraA) {
            const double bound = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
            const uint64_t key = splitmix64(config.seed) ^ hash_name(p.name);
            for (size_t i = 0; i < p.numel; ++i) {
                const double u = static_cast<double>(splitmix64(key ^ splitmix64(i)) >> 11) * 0x1.0p-53;  // [0, 1)
                out[i] = static_cast<float>((2.0 * u - 1.0) * bound);
            }
            continue;
        }
        double std = m.init_std;
        double cutoff = m.init_cutoff_factor ? *m.init_cutoff_factor : 0.0;  // in sigmas; 0: none
        if (m.init_fn == InitFn::kMitchell) {
            const bool is_block_out = p.layer >= 0 && (p.name.find(".attn_out.") != std::string::npos ||
                                                       p.name.find(".ff_out.") != std::string::npos);
            const double fan_in = p.kind == ParamKind::kEmbedding ? m.d_model : static_cast<double>(p.shape[1]);
            std = 1.0 / std::sqrt(fan_in);
            if (is_block_out) std /= std::sqrt(2.0 * (p.layer + 1));
            cutoff = 3.0;
        }
        const uint64_t key = splitmix64(config.seed) ^ hash_name(p.name);
#pragma omp parallel for schedule(static)
        for (long long i = 0; i < static_cast<long long>(p.numel); ++i) {
            double z = normal_at(key, static_cast<uint64_t>(i), 0);
            for (uint64_t attempt = 1; cutoff > 0.0 && std::fabs(z) > cutoff; ++attempt) {
                z = normal_at(key, static_cast<uint64_t>(i), attempt);  // rejection: truncated normal
            }
            out[i] = static_cast<float>(z * std);
        }
    }
}

void load_initial_params(const TrainConfig& config, const ParamLayout& layout, Strategy& strategy,
                         const std::map<std::string, Tensor>* hf_tensors, const std::string& hf_file) {
    if (config.lora.enabled && config.lora.init_from) {
        // The adapters of an existing PEFT adapter over the initialised ones (the base as below).
        std::vector<std::vector<float>> adapters(layout.num_units());
        for (int u = 0; u < layout.num_units(); ++u) {
            if (layout.units()[u].frozen) continue;
            adapters[u].resize(layout.units()[u].numel);
            init_unit_params(config, layout.units()[u], adapters[u].data());
        }
        read_peft_adapter(config, layout, *config.lora.init_from, adapters);
        TrainConfig base = config;
        base.lora.init_from.reset();
        load_initial_params(base, layout, strategy, hf_tensors, hf_file);
        for (int u = 0; u < layout.num_units(); ++u) {
            if (!layout.units()[u].frozen) strategy.load_full_unit_params(u, adapters[u].data());
        }
        strategy.params_loaded();
        return;
    }
    if (hf_tensors == nullptr) {
        // One unit at a time: the host holds the largest unit's parameters, not the model's (every rank of a
        // node would otherwise hold the whole model in fp32 at once: 27 GB each for OLMo-7B, beside a CPU
        // offload's state).
        std::vector<float> unit;
        for (int u = 0; u < layout.num_units(); ++u) {
            unit.assign(layout.units()[u].numel, 0.0f);
            init_unit_params(config, layout.units()[u], unit.data());
            strategy.load_full_unit_params(u, unit.data());
        }
        strategy.params_loaded();
        return;
    }
    // Hugging Face tensors are in host memory already, the whole model; their units are filled together.
    std::vector<std::vector<float>> host(layout.num_units());
    for (int u = 0; u < layout.num_units(); ++u) {
        host[u].resize(layout.units()[u].numel);
        init_unit_params(config, layout.units()[u], host[u].data());
    }
    from_hf_tensors(config, layout, *hf_tensors, hf_file, host);
    for (int u = 0; u < layout.num_units(); ++u) strategy.load_full_unit_params(u, host[u].data());
    strategy.params_loaded();
}

void fill_lora_base(const TrainConfig& config, const ParamLayout& layout, std::vector<std::vector<float>>& units) {
    units.resize(layout.num_units());
    for (int u = 0; u < layout.num_units(); ++u) {
        if (!layout.units()[u].frozen) continue;
        units[u].assign(layout.units()[u].numel, 0.0f);
        init_unit_params(config, layout.units()[u], units[u].data());
    }
    if (config.init_from) {
        hf_family(config.model, "--init-from " + *config.init_from);
        from_hf_tensors(config, layout, read_hf_weights(config, *config.init_from), *config.init_from, units);
    }
}

void round_trip_frozen(const ParamLayout& layout, std::vector<std::vector<float>>& units) {
    for (int u = 0; u < layout.num_units(); ++u) {
        const Unit& unit = layout.units()[u];
        const PackedUnit pack(unit, frozen_form(unit, false), unit.double_quant);
        if (pack.narrower()) pack.round_trip(units.at(u).data());
    }
}

void load_inference_params(const TrainConfig& config, const ParamLayout& layout, Strategy& strategy,
                           const char* command) {
    const ModelConfig& m = config.model;
    if (config.load_path) {
        TrainConfig saved;
        std::vector<std::vector<float>> units;
        const std::string path = resolve_checkpoint(config, *config.load_path);
        read_checkpoint_params(path, &saved, &units);
        // The same model, not only the same sizes (rope_theta, the norms' kind and eps change no size), and the
        // same adapters on a fine-tune's.
        check_model_matches(saved, config, path);
        if (units.size() != static_cast<size_t>(layout.num_units())) {
            user_error("{}: checkpoint {} holds {} units; this config's model has {}", command, *config.load_path,
                       units.size(), layout.num_units());
        }
        if (saved.lora.enabled) fill_lora_base(saved, layout, units);  // a LoRA checkpoint holds the adapters
        for (int u = 0; u < layout.num_units(); ++u) {
            if (units[u].size() != layout.units()[u].numel) {
                user_error("{}: checkpoint {} does not hold this config's model (unit {})", command, *config.load_path,
                           layout.units()[u].name);
            }
            strategy.load_full_unit_params(u, units[u].data());
        }
        strategy.params_loaded();
    } else if (config.init_from) {
        hf_family(m, "--init-from " + *config.init_from);
        const std::map<std::string, Tensor> tensors = read_hf_weights(config, *config.init_from);
        load_initial_params(config, layout, strategy, &tensors, *config.init_from);
    } else {
        // Allowed (a model's untrained outputs are a baseline), and said: a forgotten --load-path reads alike.
        std::fprintf(stderr,
                     "note: %s: no --load-path or --init-from: the %s is the untrained initialisation of seed %llu\n",
                     command, config.lora.enabled ? "base" : "model", config.seed);
        load_initial_params(config, layout, strategy, nullptr, "");
    }
}

}  // namespace trainer
