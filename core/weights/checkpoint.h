// Checkpoints: model parameters, AdamW moments, step, data position and seeds, sharded by rank.
//
// Layout of save_folder/step<N>/:
//   rank<r>.bin     for each unit in order, this rank's owned shard: params, exp_avg, exp_avg_sq (fp32)
//   metadata.json   format version, step, world size, each unit's numel and every rank's shard range,
//                   each file's size and checksum, data position, seeds, the full config
// A save writes into save_folder/.step<N>.tmp-<pid>/ and renames it to step<N>/ only when every file is
// written, synced and checksummed, so an interrupted save never leaves a folder that looks complete:
// loading requires metadata.json, and `latest` resolves to the newest complete step<N>/. Loading verifies
// every checksum and that the model shape matches, and reassembles units from any number of shards, so a
// checkpoint reloads on a different world size.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "core/weights/hf_export.h"
#include "kernels/backend.h"
#include "parallel/strategy.h"

namespace trainer {

struct CheckpointInfo {
    std::string path;
    long step = 0;
};

// Writes step<step>/ under config.save_folder (whose lock the run holds: core/weights/save_folder.h); returns its
// path. The ranks write into .step<step>.tmp-<run_tag> (the tag the same on every rank of a run, another in every run),
// renamed when complete; a save that fails on rank 0 removes it. Old checkpoints beyond save_num_checkpoints_to_keep
// are removed after the new one is complete. Refuses (UserError, nothing published) to replace an existing
// step<step>/ unless save_overwrite, and state that is not finite.
std::string save_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy& strategy,
                            long step, const std::string& run_tag);
// Resolves load_path ("latest" or a folder) to a complete checkpoint folder; UserError when there is none.
std::string resolve_checkpoint(const TrainConfig& config, const std::string& load_path);
// Loads parameters and optimizer state into the strategy's owned shards; returns the step and data position.
CheckpointInfo load_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend,
                               Strategy& strategy, const std::string& path);
// Reads the full parameters of every unit (host) and the config a checkpoint was written with (for export).
void read_checkpoint_params(const std::string& path, TrainConfig* config, std::vector<std::vector<float>>* units);
// Refuses (user_error naming the key and both values) a checkpoint at `path` whose config (`saved_config`, its
// metadata's) describes another model than `config`'s: every model key but the initialisation's must agree.
void check_model_matches(const Json& saved_config, const TrainConfig& config, const std::string& path);
// Writes a checkpoint's full weights with Hugging Face names: to `out` as one safetensors file when it ends
// in .safetensors (through a temporary file and a rename), else as a Hugging Face model directory
// (hf_export.h); returns the architecture name (GPT2LMHeadModel or OlmoForCausalLM).
std::string export_checkpoint(const std::string& path, const std::string& out, const HfExportOptions& options = {});
// Newest complete checkpoint step in a folder, if any (interrupted saves are ignored).
std::optional<long> latest_checkpoint_step(const std::string& save_folder);
// The steps of the complete checkpoints in a folder, ascending.
std::vector<long> checkpoint_steps(const std::string& save_folder);
// The step a checkpoint's metadata.json records (read as it is; loading verifies it).
long checkpoint_step(const std::string& path);

}  // namespace trainer
