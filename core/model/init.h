// The model's parameters at the start: initialised as OLMo does, with Hugging Face tensors on top, or for inference
// from a checkpoint (init.cpp).
#pragma once

#include <map>
#include <string>

#include "base/config.h"
#include "core/weights/safetensors.h"

namespace trainer {

class ParamLayout;
class Strategy;
struct Unit;

// Initialises every parameter of a unit into `host` (unit.numel floats) as OLMo does (init_fn normal or
// mitchell), from a counter-based generator keyed by (seed, parameter name, element): the result is
// independent of thread count and of the order units are initialised in.
void init_unit_params(const TrainConfig& config, const Unit& unit, float* host);

// The initial parameters of every unit (host): init_unit_params, then, when `hf_tensors` is not null, the
// Hugging Face tensors read from `hf_file` on top (see from_hf_tensors). Loads them into the strategy.
void load_initial_params(const TrainConfig& config, const ParamLayout& layout, Strategy& strategy,
                         const std::map<std::string, Tensor>* hf_tensors, const std::string& hf_file);

// A LoRA fine-tune's frozen base (host, the frozen units sized and filled; the adapter units untouched): its
// initialisation, then its init_from's Hugging Face tensors where it has one. What a LoRA checkpoint does not hold.
void fill_lora_base(const TrainConfig& config, const ParamLayout& layout, std::vector<std::vector<float>>& units);
// The frozen units (host) as their packed storage gives them back to compute (QLoRA's NF4, the bf16 Linear weights of
// amp_bf16: parallel/strategy/packed_unit.h), packed once, as a strategy packs them when they are loaded (NF4 with
// double quantization is no fixed point, so never twice).
void round_trip_frozen(const ParamLayout& layout, std::vector<std::vector<float>>& units);

// Loads the weights into `strategy` (a single process's): load_path's checkpoint (which must hold this config's
// model), else init_from's Hugging Face weights, else the config's initialisation. `command` names the caller in
// errors.
void load_inference_params(const TrainConfig& config, const ParamLayout& layout, Strategy& strategy,
                           const char* command);

}  // namespace trainer
