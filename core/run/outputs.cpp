// What a training run writes as it goes (see outputs.h).
#include "core/run/outputs.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/common.h"
#include "base/trace.h"
#include "core/data/bpe.h"
#include "core/run/report.h"

namespace trainer {

RunOutputs::RunOutputs(const TrainConfig& config, const RankEnv& env, bool resuming)
    : metrics_(env.rank == 0 ? config.metrics_file : std::nullopt, resuming), rank_(env.rank) {
    if (env.rank == 0 && config.tensorboard_dir)
        tensorboard_ = std::make_unique<TensorBoardWriter>(*config.tensorboard_dir);
    if (config.trace_file) {
        // Refuse an unwritable path now, not after the run.
        trace_path_ = trace_path(*config.trace_file, env.rank, env.world_size);
        const std::string probe = trace_path_ + ".tmp-" + std::to_string(::getpid());  // as trace::write
        std::FILE* f = std::fopen(probe.c_str(), "w");
        if (f == nullptr) user_error("trace_file {}: cannot be written ({})", trace_path_, std::strerror(errno));
        std::fclose(f);
        std::remove(probe.c_str());
        trace::start(env.rank);
        trace::name_thread("compute");
    }
}

void RunOutputs::write_step(long step, const Json& record) {
    metrics_.write(record);
    if (tensorboard_) tensorboard_->write(step, scalars_of(record));
}

void RunOutputs::write_trace() const {
    if (trace_path_.empty()) return;
    trace::write(trace_path_);
    if (rank_ == 0) std::printf("trace written to %s\n", trace_path_.c_str());
}

RunSample open_run_sample(const TrainConfig& config) {
    const ModelConfig& m = config.model;
    RunSample s;
    const Tokenizer tokenizer = config.tokenizer.require(config.sample.tokenizer, "config sample.prompt");
    s.codec = std::make_unique<TextCodec>(
        tokenizer, default_tokenizer_dir(), m.eos_token_id, m.vocab_size,
        config.sample.tokenizer ? "config sample.tokenizer" : "config tokenizer.identifier");
    s.prompt = s.codec->encode(config.sample.prompt, "config sample.prompt");
    if (s.prompt.empty()) s.prompt.push_back(static_cast<int32_t>(m.eos_token_id));
    const long positions = static_cast<long>(s.prompt.size()) + config.sample.max_new_tokens;
    if (positions > m.max_sequence_length) {
        user_error(
            "config sample.max_new_tokens: {} after a prompt of {} tokens is {} positions, above "
            "model.max_sequence_length {}",
            config.sample.max_new_tokens, s.prompt.size(), positions, m.max_sequence_length);
    }
    return s;
}

}  // namespace trainer
