// LoRA's targets: lora.targets names Linear layers as Hugging Face (and PEFT) name them; the trainer's Linear layers
// are OLMo's fused ones (att_proj = [q_proj; k_proj; v_proj], ff_proj = [up_proj; gate_proj]), so a target adapts a
// range of a fused Linear's output rows. One adapter a target module and block, as PEFT has one a module: A (r, in)
// and B (rows, r), the update (scaling) B A dropout(x) added to the module's output.
// RoPE models name them q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (Llama's, OLMo's, OLMo-2's
// Hugging Face classes); models with learned positions GPT-2's c_attn (the whole att_proj), c_proj (attention's
// output), c_fc and mlp.c_proj. An untied LM head is lm_head: one adapter for the model, (embedding_size, r) B.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/config.h"

namespace trainer {

// The block Linear layers an adapter can sit beside.
enum class LoraLinear { kAttProj, kAttnOut, kFfProj, kFfOut, kHead };  // kHead: the LM head (lm_head)

struct LoraModule {
    std::string name;  // the Hugging Face module name ("q_proj", "mlp.c_proj")
    LoraLinear linear = LoraLinear::kAttProj;
    int64_t row_begin = 0, row_end = 0;  // the rows of the Linear's weight (columns of its output) it adapts
    int64_t in = 0;                      // the Linear's input width
    int id = 0;                          // its place among the shape's module names (the dropout masks' key)
    int64_t rows() const { return row_end - row_begin; }
};

// The module names a model of this shape has, in the order adapters are laid out: a block's, then lm_head where the
// head is not tied to the embedding.
std::vector<std::string> lora_module_names(const ModelConfig& m);
// The block modules lora.targets names (null: LitGPT's default, the query and the value), in the order of
// lora_module_names; refuses an unknown or repeated name, naming the ones this shape has, and lm_head on a tied head.
std::vector<LoraModule> lora_modules(const ModelConfig& m, const std::vector<std::string>& targets);
// The LM head's module where lora.targets names lm_head: in d_model, rows embedding_size; nullopt otherwise.
std::optional<LoraModule> lora_head_module(const ModelConfig& m, const std::vector<std::string>& targets);
// LitGPT's default targets for this shape: q_proj and v_proj (GPT-2: c_attn, which holds both).
std::vector<std::string> lora_default_targets(const ModelConfig& m);

}  // namespace trainer
