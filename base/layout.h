// ParamLayout: the ordered list of named parameters with shapes, grouped into units.
//
// Units are the granularity at which a data-parallel strategy moves parameters: "embedding" (wte, and
// wpe without RoPE), "block.<i>" for each transformer block, and "head" (final norm, and the LM head
// when it is not tied to wte). With LoRA (lora.enabled) those units are frozen (no gradient, no optimizer
// state, never reduced) and one more unit a block follows the head, "lora.<i>": the block's adapters, each
// target module's A (r, in) then B (rows, r) in base/lora.h's order, the only parameters trained; then, with lm_head
// among the targets, "lora.head": lm_head.lora_A.weight (r, d_model) and lm_head.lora_B.weight (embedding_size, r).
// Each unit's parameters are packed into one flat buffer in the order listed here; a strategy may pad a unit's buffer
// so it splits evenly across ranks (padding follows the last parameter and is never read by the model). Names are
// OLMo's (transformer.blocks.N.att_proj
// ...); Hugging Face names are mapped in hf_names.cpp for import and export.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/config.h"

namespace trainer {

enum class ParamKind { kEmbedding, kNormWeight, kNormBias, kLinearWeight, kLinearBias, kLoraA, kLoraB };

struct ParamSpec {
    std::string name;            // OLMo name, e.g. transformer.blocks.3.att_proj.weight
    std::vector<int64_t> shape;  // PyTorch shape: Linear weights are (out, in)
    size_t offset = 0;           // elements from the start of the unit's flat buffer
    size_t numel = 0;
    ParamKind kind = ParamKind::kLinearWeight;
    bool decay = false;  // in the weight-decay group (OLMo's rules, see optimizer config)
    int layer = -1;      // block index, -1 outside blocks
};

struct Unit {
    std::string name;
    std::vector<ParamSpec> params;
    size_t numel = 0;     // sum of the parameters' numel (no padding)
    bool frozen = false;  // LoRA's base: never trained (no gradient, no optimizer state)
    bool nf4 = false;     // QLoRA: frozen, its block Linear weights stored as NF4 (parallel/strategy/packed_unit.h)
    bool double_quant = false;  // their absmaxes double-quantized
    bool bf16_gemms = false;    // frozen under amp_bf16 or amp_fp8: its Linear weights stored as bf16 (packed_unit.h)
};

// A half-open range [begin, end) of elements of a flat buffer.
struct Range {
    size_t begin = 0, end = 0;
    bool empty() const { return begin >= end; }
    size_t size() const { return empty() ? 0 : end - begin; }
};
// The elements two ranges share (empty when none).
inline Range intersect(Range a, Range b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

// A contiguous range of a unit's flat buffer with one weight-decay setting.
struct DecaySegment {
    size_t begin = 0, end = 0;
    bool decay = false;
};

class ParamLayout {
   public:
    explicit ParamLayout(const TrainConfig& config);

    const std::vector<Unit>& units() const { return units_; }
    int num_units() const { return static_cast<int>(units_.size()); }
    int embedding_unit() const { return 0; }
    int block_unit(int layer) const { return 1 + layer; }
    int head_unit() const { return num_layers_ + 1; }
    int num_layers() const { return num_layers_; }
    // Block `layer`'s LoRA adapters' unit; -1 without LoRA.
    int adapter_unit(int layer) const { return has_adapters() ? num_layers_ + 2 + layer : -1; }
    bool has_adapters() const { return num_units() > num_layers_ + 2; }
    // The LM head's adapter's unit ("lora.head", after the blocks' adapters) where lora.targets names lm_head; -1
    // otherwise.
    int head_adapter_unit() const { return num_units() > 2 * num_layers_ + 2 ? 2 * num_layers_ + 2 : -1; }
    // The elements of the units that are trained (all but the frozen ones).
    size_t trainable_numel() const;
    // LoRA: what the frozen units hold, once loaded (the checksum of init_from's tensors, or the seed's
    // initialisation): a fine-tune's checkpoint records it and resuming from one checks it. Empty: unknown.
    const std::string& frozen_base() const { return frozen_base_; }
    void set_frozen_base(std::string what) { frozen_base_ = std::move(what); }
    // Maximal runs of a unit's buffer with the same decay flag, in order.
    std::vector<DecaySegment> decay_segments(int unit) const;
    // Finds a parameter by OLMo name; returns false when absent.
    bool find(const std::string& name, int* unit, const ParamSpec** spec) const;
    size_t total_numel() const;
    // Parameters that take part in matmuls: everything but the position embedding, and but the token
    // embedding when it is not also the LM head (a lookup costs no FLOPs). The N of 6N.
    size_t matmul_numel() const;

   private:
    std::vector<Unit> units_;
    int num_layers_ = 0;
    std::string frozen_base_;
    size_t wte_numel_ = 0, wpe_numel_ = 0;
    bool tied_ = true;
};

}  // namespace trainer
