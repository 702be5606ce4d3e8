// The run's data (see run_data.h).
#include "core/run/run_data.h"

#include "base/common.h"
#include "base/trace.h"
#include "core/data/bpe.h"
#include "core/data/text_codec.h"
#include "kernels/element.h"

namespace trainer {

RunData open_run_data(const TrainConfig& config) {
    RunData r;
    const ModelConfig& m = config.model;
    const std::vector<DataSource>& sources = config.data.sources;
    std::vector<std::string> paths = config.data.paths, masks = config.data.label_mask_paths;
    bool any_mask = !masks.empty();
    for (const DataSource& s : sources) any_mask = any_mask || !s.label_mask_paths.empty();
    for (const DataSource& s : sources) {
        paths.insert(paths.end(), s.paths.begin(), s.paths.end());
        // A source without masks: every token of its files in the loss (an empty entry a file).
        if (any_mask) {
            if (s.label_mask_paths.empty()) {
                masks.insert(masks.end(), s.paths.size(), std::string());
            } else {
                masks.insert(masks.end(), s.label_mask_paths.begin(), s.label_mask_paths.end());
            }
        }
    }
    r.train = std::make_unique<TokenDataset>(
        paths, config.data.memmap_dtype, m.max_sequence_length, m.vocab_size,
        sources.empty() ? "data.paths" : "data.sources[].paths", masks,
        sources.empty() ? "data.label_mask_paths" : "data.sources[].label_mask_paths (all sources' files in order)");
    // Downstream examples written as text are tokenized with the run's tokenizer, loaded when the first text comes.
    std::unique_ptr<TextCodec> codec;
    const TokenizerConfig& tok = config.tokenizer;
    DownstreamEncoder encode;
    if (tok.known) {
        encode = [&](const std::string& text) {
            if (!codec) {
                codec = std::make_unique<TextCodec>(*tok.known, default_tokenizer_dir(), m.eos_token_id, m.vocab_size,
                                                    "config tokenizer.identifier");
            }
            return codec->encode(text, "a downstream example");
        };
    }
    const std::string no_text = fmt::format(
        "config tokenizer.identifier \"{}\" is a tokenizer the trainer does not have (it has bytes, gpt2, cl100k and "
        "dolma2): give token ids instead (scripts/make_downstream_jsonl.py --hf-tokenizer writes them)",
        tok.identifier);
    for (size_t i = 0; i < config.evaluators.size(); ++i) {
        const auto& ev = config.evaluators[i];
        if (ev.type == EvaluatorType::kDownstream) {
            r.evals.push_back(nullptr);
            r.tasks.push_back(std::make_unique<DownstreamTask>(read_downstream_task(
                ev.paths, fmt::format("evaluators[{}] ({})", i, ev.label), static_cast<int>(m.max_sequence_length),
                static_cast<int>(m.vocab_size), encode, no_text)));
            continue;
        }
        r.tasks.push_back(nullptr);
        r.evals.push_back(std::make_unique<TokenDataset>(
            ev.paths, ev.memmap_dtype, m.max_sequence_length, m.vocab_size, fmt::format("evaluators[{}].data.paths", i),
            ev.label_mask_paths, fmt::format("evaluators[{}].data.label_mask_paths", i)));
    }
    r.total_steps = config.total_steps(r.train->num_instances());  // epochs: data.paths alone
    if (sources.empty()) {
        r.order = std::make_unique<InstanceOrder>(r.train->num_instances(), config.global_train_batch_size,
                                                  config.data.seed, config.data.shuffle);
    } else {
        auto mixture =
            std::make_unique<MixtureOrder>(mixture_sources(config.data, *r.train), config.global_train_batch_size,
                                           config.data.seed, config.data.shuffle);
        std::vector<double> max_repetition;
        for (const DataSource& s : sources) max_repetition.push_back(s.max_repetition_ratio);
        mixture->check_repetition(r.total_steps, max_repetition);
        r.mixture = mixture.get();
        r.order = std::move(mixture);
    }
    const SchedulerConfig& sched = config.scheduler;
    // WSD's decay ends at t_max, the run's last step where t_max is null: known here, checked here (with t_max set,
    // check_scheduler checked it).
    if (sched.name == SchedulerName::kWsd && !sched.t_max && sched.t_decay &&
        sched.t_warmup > static_cast<double>(r.total_steps) - *sched.t_decay) {
        user_error(
            "config scheduler.t_decay: {:g} steps of decay ending at the run's last step {} (scheduler.t_max null) "
            "begin before the warmup of {:g} ends; shorten t_decay or t_warmup, or lengthen max_duration",
            *sched.t_decay, r.total_steps, sched.t_warmup);
    }
    if (sched.name != SchedulerName::kConstant && !sched.t_max && sched.t_warmup >= 1 &&
        sched.t_warmup >= static_cast<double>(r.total_steps)) {
        // Flagged in the run's header, not refused: a short trial of a long recipe is a fair use.
        r.warmup_note = fmt::format(
            "note: scheduler.t_warmup is {:g} steps in a run of {}: the learning rate never reaches "
            "optimizer.learning_rate (shorten the warmup or lengthen max_duration if that is not meant)",
            sched.t_warmup, r.total_steps);
    }
    return r;
}

StepBatches::StepBatches(const TrainConfig& config, const RunData& data)
    : config_(config),
      data_(data),
      L_(config.model.max_sequence_length),
      micro_(config.device_train_microbatch_size),
      tokens_(static_cast<size_t>(micro_ * L_)),
      keep_(static_cast<size_t>(micro_)) {
    if (data_.train->has_label_masks()) label_mask_.resize(tokens_.size());
}

void StepBatches::begin(long step, int rank, int world) {
    data_.order->global_batch(step - 1, global_);
    step_key_ = lora_step_key(config_.seed, static_cast<uint64_t>(step));
    masked_ = 0.0;
    if (label_mask_.empty()) {
        tokens_in_loss_ = config_.global_predicted_tokens();
    } else {
        std::vector<uint8_t> mask(static_cast<size_t>(L_));
        double n = 0.0;
        for (const int64_t index : global_) {
            data_.train->read_label_mask(index, mask.data());
            for (long t = 1; t < L_; ++t) n += mask[static_cast<size_t>(t)];
        }
        tokens_in_loss_ = n;
    }
    InstanceOrder::rank_slice(global_, rank, world, local_);
}

MicroBatchTokens StepBatches::micro_batch(long k) {
    const trace::Span data("data", "read micro-batch");
    const auto& filter = config_.data.instance_filter;
    for (long i = 0; i < micro_; ++i) {
        const int64_t index = local_[static_cast<size_t>(k * micro_ + i)];
        int32_t* instance = tokens_.data() + static_cast<size_t>(i * L_);
        data_.train->read_instance(index, instance);
        keep_[static_cast<size_t>(i)] = filter && repetitive_instance(instance, static_cast<int>(L_), *filter) ? 0 : 1;
        masked_ += 1 - keep_[static_cast<size_t>(i)];
        if (!label_mask_.empty()) data_.train->read_label_mask(index, label_mask_.data() + static_cast<size_t>(i * L_));
    }
    MicroBatchTokens mb(tokens_.data(), keep_.data(), label_mask_.empty() ? nullptr : label_mask_.data());
    mb.step_key = step_key_;
    mb.instances = local_.data() + k * micro_;
    return mb;
}

}  // namespace trainer
