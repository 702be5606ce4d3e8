// Hugging Face model directories, as `save_pretrained` writes them and `from_pretrained` reads them:
//   config.json              GPT2LMHeadModel (model_type gpt2), OlmoForCausalLM (olmo), Olmo2ForCausalLM
//                            (olmo2) or LlamaForCausalLM (llama), the architecture's keys from the trainer's
//                            model config
//   generation_config.json   the EOS (and GPT-2's BOS) ids
//   model.safetensors        the weights with Hugging Face names (hf_names.h), or, above max_shard_bytes,
//   model-0000N-of-0000M.safetensors + model.safetensors.index.json {"metadata": {"total_size"},
//                            "weight_map": {tensor: file}}, split as transformers splits (a tensor opens
//                            a new shard when it would take the current one past the limit)
//   vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json
//                            GPT2Tokenizer's files, when the export is told the tokenizer is gpt2
// The directory is written under a temporary name and renamed, so a failed export leaves nothing; an
// existing directory is refused, never overwritten.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "core/weights/safetensors.h"

namespace trainer {

struct HfExportOptions {
    int64_t max_shard_bytes = 5000000000;  // transformers' default max_shard_size, "5GB"
    std::string tokenizer;                 // "" (none written) or "gpt2"
    std::string tokenizer_dir;             // where scripts/fetch_tokenizers.sh put the gpt2 files
    // A LoRA fine-tune's checkpoint: its adapters as a PEFT adapter directory (lora_adapter), or the model with
    // them merged into the base's weights (merge_lora); one of them is required there, and refused elsewhere.
    bool lora_adapter = false, merge_lora = false;
};

// The config.json of the model (its architecture name in "architectures").
Json hf_config_json(const TrainConfig& config);

// Writes the directory `out` for full unit buffers `units` of `config`; returns the architecture name.
std::string export_hf_directory(const TrainConfig& config, const ParamLayout& layout,
                                const std::vector<std::vector<float>>& units, const std::string& out,
                                const HfExportOptions& options);

// The tensors of `path`: a safetensors file, or a Hugging Face directory (sharded through its index, or
// one model.safetensors); a directory's config.json, when present, must agree with `config` on every key
// that decides the tensors' shapes or meaning (refused naming the key). UserError naming the file.
std::map<std::string, Tensor> read_hf_weights(const TrainConfig& config, const std::string& path);

}  // namespace trainer
