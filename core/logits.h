// `trainer logits`: the model's logits on the first instances of the config's training data, for comparing the
// trainer with another implementation of the same model (scripts/check_hf_export.py holds them against
// transformers' on an exported directory).
#pragma once

#include <string>

#include "base/config.h"

namespace trainer {

// The weights: load_path's checkpoint, else init_from's Hugging Face weights, else the config's initialisation.
// Writes `out` as a float32 .npy of shape (instances, max_sequence_length - 1, embedding_size): the logits of
// each instance's first L-1 tokens, in the config's device and precision (written through a temporary file
// and a rename). Returns the process exit code.
int run_logits(const TrainConfig& config, long instances, const std::string& out);

}  // namespace trainer
