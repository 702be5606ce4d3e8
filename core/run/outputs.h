// What a training run writes as it goes: the metrics file and TensorBoard's event file (rank 0), each rank's trace
// file, and the sample's tokenizer and prompt; each opened or checked before the run is built, so a path that
// cannot be written or a prompt that does not fit stops it before any large allocation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/json.h"
#include "core/data/text_codec.h"
#include "core/metrics.h"
#include "core/tensorboard.h"
#include "parallel/launch/rank_env.h"

namespace trainer {

class RunOutputs {
   public:
    // `resuming`: the metrics file is appended to, not replaced. trace_file: tracing starts.
    RunOutputs(const TrainConfig& config, const RankEnv& env, bool resuming);
    // Whether step records are written here (rank 0 with a metrics file): the device's counters are read only then.
    bool writes_metrics() const { return metrics_.writes(); }
    // A step's record: to the metrics file and, as scalars, to TensorBoard's event file.
    void write_step(long step, const Json& record);
    // Any other record (a stop, the summary): to the metrics file.
    void write_event(const Json& record) { metrics_.write(record); }
    // trace_file: this rank's trace, written now (rank 0 says where).
    void write_trace() const;

   private:
    MetricsWriter metrics_;
    std::unique_ptr<TensorBoardWriter> tensorboard_;  // rank 0 with tensorboard_dir
    std::string trace_path_;                          // this rank's trace file (trace_file)
    int rank_ = 0;
};

// sample.interval: the tokenizer the sample is decoded with, and its prompt's tokens (an empty prompt starts after
// an EOS), refused where the prompt and sample.max_new_tokens do not fit model.max_sequence_length.
struct RunSample {
    std::unique_ptr<TextCodec> codec;
    std::vector<int32_t> prompt;
};
RunSample open_run_sample(const TrainConfig& config);

}  // namespace trainer
