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

#include <atomic>
#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "core/weights/hf_export.h"
#include "kernels/backend.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

struct CheckpointInfo {
    std::string path;
    long step = 0;
};

// A save's folders: save_folder, its step<N>/ and the temporary folder the ranks write into first.
struct SavePaths {
    long step = 0;
    std::string folder, final_dir, tmp_dir;
};

// The phases of a save, run in order by save_checkpoint below and, split between the step and a background
// thread, by asynchronous saves (core/weights/async_save.h).
// 1. Every rank: the save's folders; refuses (UserError) an existing step<step>/ unless save_overwrite.
SavePaths prepare_save(const TrainConfig& config, long step, const std::string& run_tag);
// 2. Each rank that writes a shard file: rank<file_index>.bin (each of `shards`' parameters, exp_avg and
//    exp_avg_sq) and rank<file_index>.json (the unit ranges in it, its size and checksum) in save.tmp_dir,
//    which exists. The shards' arrays are read through `device` (its memory, or offloaded host memory), or in
//    place when it is null (a host snapshot); `contiguous`: they lie back to back from there as the file holds
//    them (a snapshot), and the file is written from it in one pass, with direct I/O where the file system
//    takes it. Refuses state that is not finite; stops (UserError) once *cancel is set.
void write_shard_file(const TrainConfig& config, const ParamLayout& layout, const std::vector<ShardView>& shards,
                      Backend* device, const SavePaths& save, int file_index, const std::atomic<bool>* cancel = nullptr,
                      const void* contiguous = nullptr);
// Whether every shard file of a save is complete: rank<k>.json (written after rank<k>.bin, renamed into place) is
// present for each k < files.
bool shard_lists_complete(const SavePaths& save, int files);
// Test hook (TRAINER_DEBUG_KILL_IN_SAVE=<step>): the process dies between its shard file and the metadata.
void debug_kill_in_save(long step);
// 3. Rank 0, once every writer's files are complete: metadata.json from the `files` lists and save_safetensors'
//    model.safetensors (a fine-tune's PEFT adapter) in the temporary folder, the rename to step<N>/, `latest` and
//    save_num_checkpoints_to_keep; returns step<N>/'s path. Removes the temporary folder when it fails (nothing is
//    published then). `rotate` false leaves the rotation to the caller (remove_excess_checkpoints).
std::string publish_save(const TrainConfig& config, const ParamLayout& layout, const SavePaths& save, int files,
                         bool rotate = true);
// Removes the oldest complete checkpoints in save_folder beyond save_num_checkpoints_to_keep.
void remove_excess_checkpoints(const TrainConfig& config);
// Rank 0, for a save that failed on some rank: removes its temporary folder.
void abandon_save(const SavePaths& save);

// Writes step<step>/ under config.save_folder (whose lock the run holds: core/weights/save_folder.h); returns its
// path. The ranks write into .step<step>.tmp-<run_tag> (the tag the same on every rank of a run, another in every run),
// renamed when complete; a save that fails on rank 0 removes it. Old checkpoints beyond save_num_checkpoints_to_keep
// are removed before the new one is written and after it is complete, so the folder never holds more than keep + 1.
// Refuses (UserError, nothing published) to replace an existing step<step>/ unless save_overwrite, and state that is
// not finite.
std::string save_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy& strategy,
                            long step, const std::string& run_tag);
// Resolves load_path ("latest" or a folder) to a complete checkpoint folder; UserError when there is none.
std::string resolve_checkpoint(const TrainConfig& config, const std::string& load_path);
// Loads parameters and optimizer state into the strategy's owned shards; returns the step and data position.
CheckpointInfo load_checkpoint(const TrainConfig& config, const ParamLayout& layout, Backend* backend,
                               Strategy& strategy, const std::string& path);
// Reads the full parameters of every unit (host) and the config a checkpoint was written with (for export). A LoRA
// fine-tune's checkpoint holds its adapters only: its frozen units are left empty (their base is the run's init_from,
// or its initialisation).
void read_checkpoint_params(const std::string& path, TrainConfig* config, std::vector<std::vector<float>>* units);
// Refuses (user_error naming the key and both values) a checkpoint at `path` whose config (`saved`, its metadata's,
// validated) describes another model than `config`'s: every model key but the initialisation's must agree, and so
// must LoRA's keys that shape or scale the adapters (all but dropout and init_from), targets as a set.
void check_model_matches(const TrainConfig& saved, const TrainConfig& config, const std::string& path);
// Writes a checkpoint's full weights with Hugging Face names: to `out` as one safetensors file when it ends
// in .safetensors (through a temporary file and a rename), else as a Hugging Face model directory
// (hf_export.h); returns the architecture name (GPT2LMHeadModel, OlmoForCausalLM, ...).
std::string export_checkpoint(const std::string& path, const std::string& out, const HfExportOptions& options = {});
// Newest complete checkpoint step in a folder, if any (interrupted saves are ignored).
std::optional<long> latest_checkpoint_step(const std::string& save_folder);
// The newest checkpoint of `save_folder` that verifies (metadata and every file's checksum), for a resume from
// "latest": the ones newer than it that do not verify are moved aside as .step<N>.corrupt-<run_tag> (kept, and no
// longer in the way of this run's saves), each said on stderr. nullopt when the folder holds none; a UserError, and
// nothing moved, when it holds some and none verifies. Only the run holding the folder's lock may call it.
std::optional<std::string> newest_sound_checkpoint(const std::string& save_folder, const std::string& run_tag);
// The steps of the complete checkpoints in a folder, ascending.
std::vector<long> checkpoint_steps(const std::string& save_folder);
// The step a checkpoint's metadata.json records (read as it is; loading verifies it).
long checkpoint_step(const std::string& path);
// The step a folder named step<N> holds by its name (its place in its save folder), if it is so named.
std::optional<long> step_of_folder_name(const std::string& path);

}  // namespace trainer
