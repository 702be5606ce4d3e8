// The structure of a checkpoint's metadata.json (core/weights/checkpoint.cpp writes it), checked before anything
// in it is used: a file edited by hand, truncated or damaged is refused with the entry that is wrong
// instead of failing somewhere inside the reader. Only base/ is needed (the fuzz target links it alone).
#pragma once

#include <string>

#include "base/config.h"

namespace trainer {

constexpr int kCheckpointFormatVersion = 2;

// UserError naming the checkpoint `path` and the first entry of `meta` that is missing, of the wrong type
// or out of range: format and version, step, world_size, units (name, numel, pieces of four non-negative
// integers [file, begin, end, byte offset] with file < world_size and begin <= end <= numel), data, files
// (rank<N>.bin -> bytes, checksum), and config (which must validate). Returns that config, validated: the one
// place a checkpoint's config is read.
TrainConfig check_checkpoint_metadata(const Json& meta, const std::string& path);

}  // namespace trainer
