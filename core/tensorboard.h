// TensorBoard event files, written from C++ with no TensorFlow: a file of records (length, masked CRC32C of the
// length, the bytes, masked CRC32C of the bytes), each an Event protocol message: the first one names the file
// version, the others carry a Summary of scalar values at a step. TensorBoard's loader reads a folder of them
// (`tensorboard --logdir DIR`); read_tensorboard_scalars reads them back for the tests and for a user without it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "base/json.h"

namespace trainer {

// CRC-32C (Castagnoli), the checksum of TFRecord files; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, size_t size);

// The numbers of a metrics record as (tag, value): every number in it (booleans and strings left out), nested
// objects and arrays named by their path ("peak_memory_bytes_per_rank/1/activations"); "step" is the event's step,
// not a value.
std::vector<std::pair<std::string, double>> scalars_of(const Json& record);

// One event file in `dir` (created), named as TensorBoard's writers name theirs
// (events.out.tfevents.<seconds>.<host>.<pid>), so a resumed run adds a file beside the first.
class TensorBoardWriter {
   public:
    explicit TensorBoardWriter(const std::string& dir);
    ~TensorBoardWriter();
    TensorBoardWriter(const TensorBoardWriter&) = delete;
    TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
    // One event at `step` holding every value (float32, as TensorBoard's scalars are), flushed.
    void write(long step, const std::vector<std::pair<std::string, double>>& values);
    const std::string& path() const { return path_; }

   private:
    void record(const std::string& bytes);
    std::string path_;
    std::FILE* f_ = nullptr;
};

struct TensorBoardScalar {
    long step = 0;
    double wall_time = 0.0;
    std::string tag;
    float value = 0.0f;
};

// Every scalar of an event file, in file order. UserError naming the file and the record's offset on a short
// record, a wrong checksum, or a message it cannot parse; "file_version" events are checked ("brain.Event:2").
std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& path);

}  // namespace trainer
