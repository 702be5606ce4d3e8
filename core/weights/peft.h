// LoRA adapters in PEFT's format: adapter_model.safetensors, each adapter's A and B under the Hugging Face module's
// name (base_model.model.<module>.lora_A.weight, (r, in); .lora_B.weight, (out, r)), and adapter_config.json
// (peft_type LORA, r, lora_alpha, lora_dropout, use_rslora, target_modules, fan_in_fan_out for GPT-2's Conv1D).
// The modules are base/lora.h's; GPT-2's attention output is "attn.c_proj" in target_modules, since PEFT matches
// a target as a suffix and "c_proj" would take the MLP's too.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/config.h"
#include "base/json.h"
#include "base/layout.h"
#include "core/weights/safetensors.h"

namespace trainer {

// The adapter units' parameters (host, full units; the frozen units are not read) as PEFT's tensors.
std::vector<std::pair<std::string, Tensor>> to_peft_tensors(const TrainConfig& config, const ParamLayout& layout,
                                                            const std::vector<std::vector<float>>& units);
// PEFT's tensors into the adapter units (host, sized): every adapter of the layout must be there with its shape, and
// nothing else (refused by name, naming `file`).
void from_peft_tensors(const TrainConfig& config, const ParamLayout& layout,
                       const std::map<std::string, Tensor>& tensors, const std::string& file,
                       std::vector<std::vector<float>>& units);
// adapter_config.json for the run's lora keys (base: the base model's path, or "").
Json peft_adapter_config(const TrainConfig& config, const std::string& base);
// Writes a PEFT adapter's two files (adapter_model.safetensors, adapter_config.json) into the directory `dir` (a
// LoRA checkpoint's folder with save_safetensors); `what` names them in errors.
void write_peft_adapter_files(const TrainConfig& config, const ParamLayout& layout,
                              const std::vector<std::vector<float>>& units, const std::string& dir,
                              const std::string& what);
// Writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) as the new directory `dir`,
// whole or not at all (one that exists is refused).
void write_peft_adapter(const TrainConfig& config, const ParamLayout& layout,
                        const std::vector<std::vector<float>>& units, const std::string& dir);
// lora.init_from: reads a PEFT adapter (a directory with adapter_model.safetensors, its adapter_config.json checked
// against the run's lora keys, or the safetensors file itself) into the adapter units.
void read_peft_adapter(const TrainConfig& config, const ParamLayout& layout, const std::string& path,
                       std::vector<std::vector<float>>& units);
// A checksum of Hugging Face tensors (their names, shapes and values, in name order), as 16 hex digits: what a LoRA
// run's frozen base is, recorded in its checkpoints.
std::string tensors_checksum(const std::map<std::string, Tensor>& tensors);

// W += scaling B A for every adapter: the adapted model as plain weights (the frozen units and the adapters, host).
void merge_lora(const TrainConfig& config, const ParamLayout& layout, std::vector<std::vector<float>>& units);

}  // namespace trainer
