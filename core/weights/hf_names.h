// Hugging Face names for import (--init-from) and export (trainer export): GPT2LMHeadModel for the
// GPT-2 shape (learned positions, affine LayerNorm with bias, biases, GELU, tied head),
// OlmoForCausalLM for the OLMo shape (RoPE, SwiGLU, non-parametric LayerNorm, no biases),
// Olmo2ForCausalLM for OLMo-2's (RMSNorm with weights after each sublayer, QK-norm) and LlamaForCausalLM for
// Llama's (RMSNorm with weights before each sublayer); the last three with grouped-query attention too
// (k_proj and v_proj n_kv_heads heads each).
// The trainer's fused tensors are split and transposed on the way out and joined on the way in:
// att_proj = [q_proj; k_proj; v_proj], ff_proj = [up_proj; gate_proj] (OLMo's x, gate order), and GPT-2's
// Conv1D weights are stored (in, out), the transpose of a Linear's (out, in).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "core/weights/safetensors.h"

namespace trainer {

// "gpt2", "olmo", "olmo2" or "llama"; a model matching none has no Hugging Face class and is refused with the keys
// that differ, naming `what` ("--init-from", "export").
std::string hf_family(const ModelConfig& m, const std::string& what);

// Full unit buffers (host) -> Hugging Face tensors.
std::vector<std::pair<std::string, Tensor>> to_hf_tensors(const TrainConfig& config, const ParamLayout& layout,
                                                          const std::vector<std::vector<float>>& units);
// Hugging Face tensors (read from `file`) -> full unit buffers (host, already sized). Refuses a missing,
// extra or mis-shaped tensor by name. A token embedding of vocab_size rows (GPT-2's 50257) fills the
// first rows of an embedding_size-row wte; the padded rows keep their initial values.
void from_hf_tensors(const TrainConfig& config, const ParamLayout& layout, const std::map<std::string, Tensor>& tensors,
                     const std::string& file, std::vector<std::vector<float>>& units);

}  // namespace trainer
