// The typed configuration: each section read from the completed document, and every cross-field rule checked
// once (see config.h; the schema and the document mechanics are base/config_schema.cpp, the JSON made back from the
// typed fields base/config_json.cpp).
#include "base/config.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/config_schema.h"
#include "base/files.h"
#include "base/lora.h"
#include "base/utf8.h"

namespace trainer {
namespace {

std::vector<std::string> string_list(const Json& v) {
    if (v.is_string()) return {v.get<std::string>()};
    return v.get<std::vector<std::string>>();
}

template <typename T>
std::optional<T> opt(const Json& v) {
    if (v.is_null()) return std::nullopt;
    return v.get<T>();
}

// A choice key's value as its enum; the schema has checked the spelling against the same names.
template <typename E>
E choice(const Json& v) {
    const std::optional<E> e = parse_choice<E>(v.get<std::string>());
    TRAINER_CHECK(e.has_value(), "config value {} is none of its enum's names", v.dump());
    return *e;
}

long get_long(const Json& v) { return v.is_number_integer() ? v.get<long>() : static_cast<long>(v.get<double>()); }

}  // namespace

std::optional<Tokenizer> tokenizer_from_identifier(const std::string& identifier) {
    if (const auto ours = parse_choice<Tokenizer>(identifier)) return ours;
    static const std::pair<const char*, Tokenizer> known[] = {
        {"openai-community/gpt2", Tokenizer::kGpt2},
        {"cl100k_base", Tokenizer::kCl100k},
        {"allenai/dolma2-tokenizer", Tokenizer::kDolma2},
        {"tokenizers/allenai_dolma2.json", Tokenizer::kDolma2},
    };
    for (const auto& [name, tokenizer] : known) {
        if (identifier == name) return tokenizer;
    }
    return std::nullopt;
}

Tokenizer TokenizerConfig::require(std::optional<Tokenizer> chosen, const std::string& what) const {
    if (chosen) return *chosen;
    if (known) return *known;
    user_error(
        "{} needs text tokenized, and config tokenizer.identifier \"{}\" is a tokenizer the trainer does not have "
        "(it has bytes, gpt2, cl100k and dolma2); give token ids instead of text, or name one of those",
        what, identifier);
}

Duration Duration::parse(const std::string& text) {
    Duration d;
    d.text = text;
    std::string number = text;
    if (text.size() > 2 && text.compare(text.size() - 2, 2, "ep") == 0) {
        d.unit = Unit::kEpochs;
        number = text.substr(0, text.size() - 2);
    } else if (!text.empty() && text.back() == 'T') {
        d.unit = Unit::kTokens;
        number = text.substr(0, text.size() - 1);
    }
    char* end = nullptr;
    d.value = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || !(d.value > 0) || !std::isfinite(d.value)) {
        user_error("config max_duration: \"{}\"; expected steps (1000), tokens (\"2e12T\") or epochs (\"1ep\")", text);
    }
    if (d.unit == Unit::kSteps) {
        if (std::floor(d.value) != d.value) user_error("config max_duration: \"{}\"; a step count must be whole", text);
        d.steps(1, 1);  // a step count is checked against the bound now; the others once their data is known
    }
    return d;
}

long Duration::steps(long tokens_per_step, long batches_per_epoch) const {
    double n = value;
    if (unit == Unit::kTokens) n = value / static_cast<double>(tokens_per_step);
    if (unit == Unit::kEpochs) n = value * static_cast<double>(batches_per_epoch);
    if (!(n <= 1e15)) user_error("config max_duration: \"{}\" is {:.3g} steps; expected at most 1e15", text, n);
    return std::max<long>(1, static_cast<long>(std::ceil(n)));
}

long TrainConfig::total_steps(long instances_per_epoch) const {
    return max_duration.steps(global_train_batch_size * model.max_sequence_length,
                              instances_per_epoch / global_train_batch_size);
}

namespace {

ModelConfig read_model(const Json& m) {
    ModelConfig mc;
    mc.d_model = m["d_model"].get<int>();
    mc.n_heads = m["n_heads"].get<int>();
    mc.n_kv_heads = opt<int>(m["n_kv_heads"]).value_or(mc.n_heads);
    mc.n_layers = m["n_layers"].get<int>();
    mc.mlp_ratio = m["mlp_ratio"].get<int>();
    mc.mlp_hidden_size = opt<int>(m["mlp_hidden_size"]);
    mc.activation_type = choice<ActivationType>(m["activation_type"]);
    mc.rope = m["rope"].get<bool>();
    mc.rope_theta = m["rope_theta"].get<double>();
    mc.layer_norm_type = choice<LayerNormType>(m["layer_norm_type"]);
    mc.layer_norm_with_affine = m["layer_norm_with_affine"].get<bool>();
    mc.include_bias = m["include_bias"].get<bool>();
    mc.bias_for_layer_norm = opt<bool>(m["bias_for_layer_norm"]).value_or(mc.include_bias);
    mc.layer_norm_eps = m["layer_norm_eps"].get<double>();
    mc.attention_layer_norm = m["attention_layer_norm"].get<bool>();
    mc.attention_layer_norm_with_affine = m["attention_layer_norm_with_affine"].get<bool>();
    mc.norm_after = m["norm_after"].get<bool>();
    mc.weight_tying = m["weight_tying"].get<bool>();
    mc.vocab_size = m["vocab_size"].get<int>();
    mc.embedding_size = opt<int>(m["embedding_size"]).value_or(mc.vocab_size);
    mc.max_sequence_length = m["max_sequence_length"].get<int>();
    mc.init_fn = choice<InitFn>(m["init_fn"]);
    mc.init_std = m["init_std"].get<double>();
    mc.init_cutoff_factor = opt<double>(m["init_cutoff_factor"]);
    mc.eos_token_id = m["eos_token_id"].get<int>();
    mc.pad_token_id = m["pad_token_id"].get<int>();
    return mc;
}

void check_model(const ModelConfig& mc) {
    if (mc.d_model % mc.n_heads != 0) {
        user_error("config model.n_heads: {} does not divide model.d_model {}", mc.n_heads, mc.d_model);
    }
    if (mc.n_heads % mc.n_kv_heads != 0) {
        user_error(
            "config model.n_kv_heads: {} does not divide model.n_heads {}; each key/value head serves "
            "n_heads / n_kv_heads query heads",
            mc.n_kv_heads, mc.n_heads);
    }
    if (mc.rope && mc.head_size() % 2 != 0) {
        user_error("config model.rope: RoPE needs an even head size; d_model {} / n_heads {} = {}", mc.d_model,
                   mc.n_heads, mc.head_size());
    }
    if (mc.embedding_size < mc.vocab_size) {
        user_error("config model.embedding_size: {} is smaller than model.vocab_size {}; expected >= vocab_size",
                   mc.embedding_size, mc.vocab_size);
    }
    if (mc.eos_token_id >= mc.vocab_size) {
        user_error("config model.eos_token_id: {} is not below model.vocab_size {}", mc.eos_token_id, mc.vocab_size);
    }
    if (mc.activation_type == ActivationType::kSwiglu && mc.ff_proj_size() % 2 != 0) {
        user_error("config model.mlp_hidden_size: {} must be even with activation_type swiglu (it is split in two)",
                   mc.ff_proj_size());
    }
}

OptimizerConfig read_optimizer(const Json& o) {
    OptimizerConfig c;
    c.name = o["name"].get<std::string>();
    c.learning_rate = o["learning_rate"].get<double>();
    c.beta1 = o["betas"][0].get<double>();
    c.beta2 = o["betas"][1].get<double>();
    c.eps = o["eps"].get<double>();
    c.weight_decay = o["weight_decay"].get<double>();
    c.decay_norm_and_bias = o["decay_norm_and_bias"].get<bool>();
    c.decay_embeddings = o["decay_embeddings"].get<bool>();
    return c;
}

SchedulerConfig read_scheduler(const Json& s) {
    SchedulerConfig c;
    c.name = choice<SchedulerName>(s["name"]);
    c.t_warmup = s["t_warmup"].get<double>();
    c.t_max = opt<double>(s["t_max"]);
    c.alpha_f = s["alpha_f"].get<double>();
    c.warmup_min_lr = opt<double>(s["warmup_min_lr"]);
    c.grad_clip_warmup_steps = opt<double>(s["grad_clip_warmup_steps"]);
    c.grad_clip_warmup_factor = opt<double>(s["grad_clip_warmup_factor"]);
    c.t_decay = opt<double>(s["t_decay"]);
    c.decay_fraction = opt<double>(s["decay_fraction"]);
    if (!s["decay_shape"].is_null()) c.decay_shape = choice<DecayShape>(s["decay_shape"]);
    return c;
}

void check_scheduler(const SchedulerConfig& s) {
    if (s.grad_clip_warmup_steps.has_value() != s.grad_clip_warmup_factor.has_value()) {
        user_error(
            "config scheduler.grad_clip_warmup_steps and scheduler.grad_clip_warmup_factor: set both or neither");
    }
    const bool decays_to_t_max = s.name != SchedulerName::kConstant &&
                                 s.name != SchedulerName::kInverseSqrtWithWarmup &&
                                 s.name != SchedulerName::kConstantWithWarmup;
    if (decays_to_t_max && s.t_max && *s.t_max <= s.t_warmup) {
        user_error("config scheduler.t_max: {} must exceed scheduler.t_warmup {}", *s.t_max, s.t_warmup);
    }
    if ((s.name == SchedulerName::kInverseSqrtWithWarmup || s.name == SchedulerName::kMaxScheduler) && s.t_warmup < 1) {
        user_error("config scheduler.t_warmup: {} needs t_warmup >= 1 (its inverse square root starts there)",
                   choice_name(s.name));
    }
    if (s.name == SchedulerName::kWsd) {
        if (s.t_decay && s.decay_fraction) {
            user_error("config scheduler.t_decay and scheduler.decay_fraction: wsd takes one of them, not both");
        }
        if (s.t_max && s.t_decay && s.t_warmup > *s.t_max - *s.t_decay) {
            user_error(
                "config scheduler.t_decay: {} steps of decay ending at t_max {} begin before the warmup of {} "
                "ends",
                *s.t_decay, *s.t_max, s.t_warmup);
        }
    } else {
        for (const auto& [key, set] : {std::pair<const char*, bool>{"t_decay", s.t_decay.has_value()},
                                       {"decay_fraction", s.decay_fraction.has_value()},
                                       {"decay_shape", s.decay_shape.has_value()}}) {
            if (set) {
                user_error("config scheduler.{}: only scheduler.name wsd has a decay phase; {} does not read it", key,
                           choice_name(s.name));
            }
        }
    }
}

// The batch sizes, the duration and the loss's terms.
void read_training(const Json& doc, TrainConfig& c) {
    c.max_grad_norm = opt<double>(doc["max_grad_norm"]);
    if (doc["softmax_auxiliary_loss"].get<bool>()) c.z_loss_multiplier = doc["auxiliary_loss_multiplier"].get<double>();
    c.global_train_batch_size = get_long(doc["global_train_batch_size"]);
    c.device_train_microbatch_size = get_long(doc["device_train_microbatch_size"]);
    c.device_eval_batch_size = doc["device_eval_batch_size"].is_null() ? c.device_train_microbatch_size
                                                                       : get_long(doc["device_eval_batch_size"]);
    const Json& md = doc["max_duration"];
    c.max_duration = Duration::parse(md.is_string() ? md.get<std::string>() : std::to_string(md.get<long long>()));
    const Json& sample = doc["sample"];
    c.sample.interval = get_long(sample["interval"]);
    c.sample.prompt = sample["prompt"].get<std::string>();
    if (!sample["tokenizer"].is_null()) c.sample.tokenizer = choice<Tokenizer>(sample["tokenizer"]);
    // A tokenizer the trainer has is kept by its short name, whichever identifier named it.
    c.tokenizer.identifier = doc["tokenizer"]["identifier"].get<std::string>();
    c.tokenizer.known = tokenizer_from_identifier(c.tokenizer.identifier);
    if (c.tokenizer.known) c.tokenizer.identifier = choice_name(*c.tokenizer.known);
    c.sample.max_new_tokens = sample["max_new_tokens"].get<int>();
    c.sample.top_k = sample["top_k"].get<int>();
    c.sample.temperature = sample["temperature"].get<double>();
}

void check_training(const TrainConfig& c) {
    if (c.max_grad_norm && *c.max_grad_norm == 0.0) {
        user_error(
            "config max_grad_norm: 0 clips every gradient to zero, so nothing would train; null turns "
            "clipping off");
    }
    if (c.global_train_batch_size % c.device_train_microbatch_size != 0) {
        user_error(
            "config global_train_batch_size: {} is not a multiple of device_train_microbatch_size {} "
            "(global = micro-batch x accumulation steps x ranks)",
            c.global_train_batch_size, c.device_train_microbatch_size);
    }
    // Steps and tokens are held to their bound now; epochs once the data's size is known.
    if (c.max_duration.unit != Duration::Unit::kEpochs) c.total_steps(c.global_train_batch_size);
}

DataConfig read_data(const Json& d, unsigned long long seed) {
    DataConfig c;
    if (!d["paths"].is_null()) c.paths = string_list(d["paths"]);
    if (!d["label_mask_paths"].is_null()) c.label_mask_paths = string_list(d["label_mask_paths"]);
    for (size_t i = 0; i < d["sources"].size(); ++i) {
        const Json& s = d["sources"][i];
        for (const char* key : {"source_name", "target_ratio", "paths"}) {
            if (s[key].is_null()) user_error("config data.sources[{}].{}: required, not set", i, key);
        }
        DataSource source;
        source.name = s["source_name"].get<std::string>();
        source.paths = string_list(s["paths"]);
        if (!s["label_mask_paths"].is_null()) source.label_mask_paths = string_list(s["label_mask_paths"]);
        source.target_ratio = s["target_ratio"].get<double>();
        source.max_repetition_ratio = s["max_repetition_ratio"].get<double>();
        c.sources.push_back(std::move(source));
    }
    c.memmap_dtype = choice<TokenDtype>(d["memmap_dtype"]);
    c.shuffle = d["shuffle"].get<bool>();
    c.seed = d["seed"].is_null() ? seed : d["seed"].get<unsigned long long>();
    const Json& f = d["instance_filter"];
    const auto max_period = opt<int>(f["repetition_max_period"]), max_count = opt<int>(f["repetition_max_count"]);
    if (max_period.has_value() != max_count.has_value()) {
        user_error(
            "config data.instance_filter: set repetition_max_period and repetition_max_count together (OLMo's "
            "defaults: 13 and 32), or neither (no filter)");
    }
    if (max_period) {
        InstanceFilter filter;
        filter.max_period = *max_period;
        filter.max_count = *max_count;
        filter.min_period = f["repetition_min_period"].get<int>();
        c.instance_filter = filter;
    }
    return c;
}

void check_data(const DataConfig& d) {
    if (d.paths.empty() == d.sources.empty()) {
        user_error(d.paths.empty() ? "config data.paths: required, not set (or data.sources, a mixture)"
                                   : "config data.paths and data.sources: set one (data.sources is a mixture of "
                                     "groups of files; --data sets data.paths)");
    }
    double ratios = 0.0;
    for (size_t i = 0; i < d.sources.size(); ++i) {
        const DataSource& s = d.sources[i];
        if (s.paths.empty()) user_error("config data.sources[{}].paths: no files", i);
        for (size_t j = 0; j < i; ++j) {
            if (d.sources[j].name == s.name)
                user_error("config data.sources[{}].source_name: {} names data.sources[{}] too", i, s.name, j);
        }
        ratios += s.target_ratio;
    }
    if (!d.sources.empty() && std::fabs(ratios - 1.0) > 1e-6) {
        user_error("config data.sources[].target_ratio: the ratios sum to {:g}; expected 1", ratios);
    }
    const auto check_local = [](const std::vector<std::string>& paths, const std::string& key) {
        for (size_t i = 0; i < paths.size(); ++i) {
            if (is_url(paths[i])) {
                user_error(
                    "config {}[{}]: {} is a URL; this trainer reads local token files: download them and "
                    "pass --data FILE...",
                    key, i, paths[i]);
            }
        }
    };
    // A label mask a token file, in the same order.
    const auto check_masks = [&](const std::vector<std::string>& masks, const std::vector<std::string>& paths,
                                 const std::string& key, const std::string& paths_key) {
        if (!masks.empty() && masks.size() != paths.size()) {
            user_error("config {}: {} files for the {} of {}; expected one label mask a token file, in its order", key,
                       masks.size(), paths.size(), paths_key);
        }
        check_local(masks, key);
    };
    check_local(d.paths, "data.paths");
    check_masks(d.label_mask_paths, d.paths, "data.label_mask_paths", "data.paths");
    if (!d.sources.empty() && !d.label_mask_paths.empty()) {
        user_error(
            "config data.label_mask_paths: set with data.sources; a mixture's label masks are each source's "
            "(data.sources[].label_mask_paths)");
    }
    for (size_t i = 0; i < d.sources.size(); ++i) {
        check_local(d.sources[i].paths, fmt::format("data.sources[{}].paths", i));
        check_masks(d.sources[i].label_mask_paths, d.sources[i].paths,
                    fmt::format("data.sources[{}].label_mask_paths", i), fmt::format("data.sources[{}].paths", i));
    }
    if (d.instance_filter && d.instance_filter->min_period > d.instance_filter->max_period) {
        user_error("config data.instance_filter.repetition_min_period: {} exceeds repetition_max_period {}",
                   d.instance_filter->min_period, d.instance_filter->max_period);
    }
}

void read_evaluators(const Json& doc, TrainConfig& c) {
    for (size_t i = 0; i < doc["evaluators"].size(); ++i) {
        const Json& e = doc["evaluators"][i];
        if (e["data"]["paths"].is_null()) user_error("config evaluators[{}].data.paths: required, not set", i);
        EvaluatorConfig ec;
        ec.label = e["label"].get<std::string>();
        ec.type = choice<EvaluatorType>(e["type"]);
        ec.paths = string_list(e["data"]["paths"]);
        if (ec.type == EvaluatorType::kDownstream && !e["data"]["label_mask_paths"].is_null()) {
            user_error(
                "config evaluators[{}].data.label_mask_paths: a downstream evaluator scores its files' continuations "
                "(its JSONL says which tokens are scored); label masks are for type lm",
                i);
        }
        if (!e["data"]["label_mask_paths"].is_null()) {
            ec.label_mask_paths = string_list(e["data"]["label_mask_paths"]);
            if (ec.label_mask_paths.size() != ec.paths.size()) {
                user_error(
                    "config evaluators[{}].data.label_mask_paths: {} files for the {} of evaluators[{}].data.paths; "
                    "expected one label mask a token file, in its order",
                    i, ec.label_mask_paths.size(), ec.paths.size(), i);
            }
        }
        ec.memmap_dtype = choice<TokenDtype>(e["data"]["memmap_dtype"]);
        ec.subset_num_batches = get_long(e["subset_num_batches"]);
        if (ec.subset_num_batches == 0)
            user_error("config evaluators[{}].subset_num_batches: 0; expected -1 or >= 1", i);
        c.evaluators.push_back(ec);
    }
    c.eval_interval = get_long(doc["eval_interval"]);
    c.eval_on_startup = doc["eval_on_startup"].get<bool>();
    if (c.eval_on_startup && c.evaluators.empty()) {
        user_error("config eval_on_startup: true but no evaluators are configured; add evaluators[].data.paths");
    }
    std::vector<std::string> labels;
    for (size_t i = 0; i < c.evaluators.size(); ++i) {
        if (std::find(labels.begin(), labels.end(), c.evaluators[i].label) != labels.end()) {
            user_error(
                "config evaluators[{}].label: \"{}\" names an earlier evaluator too; the metrics keep one "
                "result a label",
                i, c.evaluators[i].label);
        }
        labels.push_back(c.evaluators[i].label);
    }
    if (c.eval_interval > 0 && c.evaluators.empty()) {
        user_error("config eval_interval: {} but no evaluators are configured; add evaluators[].data.paths",
                   c.eval_interval);
    }
}

// Checkpoints, initial weights and the run's outputs.
void read_saving(const Json& doc, TrainConfig& c) {
    c.save_folder = opt<std::string>(doc["save_folder"]);
    c.save_interval = get_long(doc["save_interval"]);
    c.save_overwrite = doc["save_overwrite"].get<bool>();
    c.save_num_checkpoints_to_keep = get_long(doc["save_num_checkpoints_to_keep"]);
    c.save_safetensors = doc["save_safetensors"].get<bool>();
    c.save_async = doc["save_async"].get<bool>();
    c.load_path = opt<std::string>(doc["load_path"]);
    c.try_load_latest_save = doc["try_load_latest_save"].get<bool>();
    c.init_from = opt<std::string>(doc["init_from"]);
    c.metrics_file = opt<std::string>(doc["metrics_file"]);
    c.tensorboard_dir = opt<std::string>(doc["tensorboard_dir"]);
    c.console_log_interval = get_long(doc["console_log_interval"]);
    c.utilization_interval = get_long(doc["utilization_interval"]);
    c.straggler_factor = doc["straggler_factor"].get<double>();
    c.trace_file = opt<std::string>(doc["trace_file"]);
}

void check_saving(const TrainConfig& c) {
    if (c.load_path && *c.load_path == "latest" && !c.save_folder) {
        user_error("config load_path: \"latest\" needs save_folder (the folder to look in)");
    }
    if (c.try_load_latest_save && !c.save_folder) {
        user_error("config try_load_latest_save: true needs save_folder (the folder to look in)");
    }
    if (c.save_num_checkpoints_to_keep == 0) {
        user_error("config save_num_checkpoints_to_keep: 0; expected -1 (keep all) or the number to keep (>= 1)");
    }
}

// Where and how the step computes: device, precision, kernels, the strategy and its memory levers.
void read_execution(const Json& doc, TrainConfig& c) {
    c.device = choice<Device>(doc["device"]);
    c.precision = choice<Precision>(doc["precision"]);
    c.kernels_attention = choice<AttentionKernel>(doc["kernels"]["attention"]);
    c.kernels_bf16_activations = doc["kernels"]["bf16_activations"].get<bool>();
    c.kernels_cuda_graphs = doc["kernels"]["cuda_graphs"].get<bool>();
    c.kernels_classifier_one_read = doc["kernels"]["classifier_one_read"].get<bool>();
    c.distributed_backend = choice<DistributedBackend>(doc["distributed_backend"]);
    c.distributed_strategy = choice<DistributedStrategy>(doc["distributed_strategy"]);
    const Json& f = doc["fsdp"];
    c.fsdp.sharding_strategy = choice<ShardingStrategy>(f["sharding_strategy"]);
    c.fsdp.wrapping_strategy =
        f["wrapping_strategy"].is_null() ? WrappingStrategy::kNull : choice<WrappingStrategy>(f["wrapping_strategy"]);
    c.fsdp.block_group_size = f["block_group_size"].get<int>();
    c.fsdp.precision = choice<FsdpPrecision>(f["precision"]);
    c.fsdp.grad_sync_mode = choice<GradSyncMode>(f["grad_sync_mode"]);
    c.fsdp.min_num_params = get_long(f["min_num_params"]);
    c.fsdp.hybrid_sharding_num_model_replicas = opt<int>(f["hybrid_sharding_num_model_replicas"]);
    c.fsdp.forward_prefetch = f["forward_prefetch"].get<bool>();
    c.fsdp.backward_prefetch = f["backward_prefetch"].get<bool>();
    c.fsdp.limit_all_gathers = f["limit_all_gathers"].get<bool>();
    c.ddp_grad_sync_mode = choice<GradSyncMode>(doc["ddp"]["grad_sync_mode"]);
    c.cpu_offload.optimizer_state = doc["cpu_offload"]["optimizer_state"].get<bool>();
    c.cpu_offload.parameters = doc["cpu_offload"]["parameters"].get<bool>();
    const Json& lora = doc["lora"];
    c.lora.enabled = lora["enabled"].get<bool>();
    c.lora.r = lora["r"].get<int>();
    c.lora.alpha = lora["alpha"].get<double>();
    c.lora.dropout = lora["dropout"].get<double>();
    c.lora.use_rslora = lora["use_rslora"].get<bool>();
    if (!lora["targets"].is_null()) c.lora.targets = string_list(lora["targets"]);
    c.lora.init_from = opt<std::string>(lora["init_from"]);
    c.lora.nf4 = lora["quantize"].get<std::string>() == "nf4";
    c.lora.double_quant = lora["double_quant"].get<bool>();
    const Json& ac = doc["activation_checkpointing"];
    c.activation_checkpointing = ac.is_null() ? ActivationCheckpointing::kNull : choice<ActivationCheckpointing>(ac);
    c.peak_flops_per_device = opt<double>(doc["peak_flops_per_device"]);
    c.threads = doc["threads"].get<int>();
    c.distributed_timeout_seconds = doc["distributed_timeout_seconds"].get<double>();
    const Json& p = doc["plan"];
    c.plan.hardware = opt<std::string>(p["hardware"]);
    c.plan.calibration = opt<std::string>(p["calibration"]);
    c.plan.comm_calibration = opt<std::string>(p["comm_calibration"]);
    c.plan.device_memory_gib = opt<double>(p["device_memory_gib"]);
    c.plan.host_memory_gib = opt<double>(p["host_memory_gib"]);
}

void check_execution(const TrainConfig& c) {
    if (c.cpu_offload.parameters && !c.cpu_offload.optimizer_state) {
        user_error(
            "config cpu_offload.parameters: true needs cpu_offload.optimizer_state: true (the optimizer updates the "
            "parameters where they live, in host memory)");
    }
    if (c.cpu_offload.parameters && c.distributed_strategy != DistributedStrategy::kAuto &&
        (c.distributed_strategy != DistributedStrategy::kFsdp ||
         c.fsdp.sharding_strategy == ShardingStrategy::kNoShard)) {
        user_error(
            "config cpu_offload.parameters: true needs distributed_strategy fsdp with fsdp.sharding_strategy "
            "FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (it uploads each unit's shard before its gather; {} keeps "
            "full replicas on the device); cpu_offload.optimizer_state alone works with every strategy",
            c.distributed_strategy == DistributedStrategy::kFsdp ? "NO_SHARD" : choice_name(c.distributed_strategy));
    }
}

void check_lora(TrainConfig& c) {
    if (!c.lora.enabled && c.lora.init_from) {
        user_error(
            "config lora.init_from: \"{}\" but lora.enabled is false; set lora.enabled: true to train or use the "
            "adapter",
            *c.lora.init_from);
    }
    if (c.lora.double_quant && !c.lora.nf4) {
        user_error("config lora.double_quant: true quantizes NF4's absmaxes; it needs lora.quantize: nf4");
    }
    if (!c.lora.enabled && c.lora.nf4) {
        user_error("config lora.quantize: nf4 stores a LoRA run's frozen base; set lora.enabled: true (QLoRA)");
    }
    if (!c.lora.enabled) return;
    if (c.lora.alpha == 0.0) {
        user_error(
            "config lora.alpha: 0 scales every adapter's update by 0, so the adapters would never change the "
            "model or learn; expected a value > 0 (LitGPT's default is 16)");
    }
    if (c.lora.targets.empty()) c.lora.targets = lora_default_targets(c.model);
    lora_modules(c.model, c.lora.targets);  // refuses an unknown or repeated target by name
}

}  // namespace

void check_config(const TrainConfig& c) {
    check_model(c.model);
    check_scheduler(c.scheduler);
    check_training(c);
    check_data(c.data);
    if (!c.data.sources.empty() && c.max_duration.unit == Duration::Unit::kEpochs) {
        user_error(
            "config max_duration: \"{}\" counts epochs, which a mixture of sources does not have (each source "
            "repeats at its own rate); give steps or tokens",
            c.max_duration.text);
    }
    check_saving(c);
    check_execution(c);
}

TrainConfig with_execution(const TrainConfig& config, const ExecutionChoice& e) {
    TrainConfig c = config;
    c.distributed_strategy = e.strategy;
    if (e.strategy == DistributedStrategy::kFsdp)
        c.fsdp.sharding_strategy = e.sharding, c.fsdp.wrapping_strategy = e.wrapping;
    if (e.grad_sync) {
        GradSyncMode& mode = e.strategy == DistributedStrategy::kFsdp ? c.fsdp.grad_sync_mode : c.ddp_grad_sync_mode;
        mode = *e.grad_sync;
    }
    c.activation_checkpointing = e.checkpointing;
    c.cpu_offload.optimizer_state = e.offload_optimizer, c.cpu_offload.parameters = e.offload_parameters;
    c.kernels_cuda_graphs = e.cuda_graphs;
    check_config(c);
    return c;
}

TrainConfig validate_config(const Json& user_doc) {
    if (const auto bad = invalid_utf8_path(user_doc)) {
        user_error(
            "config {}: not valid UTF-8; the config is saved in every checkpoint as JSON, which holds only "
            "UTF-8 (rename the file or folder, or choose another name)",
            *bad);
    }
    Json doc = complete_config_document(user_doc);
    TrainConfig c;
    c.run_name = doc["run_name"].get<std::string>();
    c.seed = doc["seed"].get<unsigned long long>();
    c.model = read_model(doc["model"]);
    c.optimizer = read_optimizer(doc["optimizer"]);
    c.scheduler = read_scheduler(doc["scheduler"]);
    read_training(doc, c);
    c.data = read_data(doc["data"], c.seed);
    read_evaluators(doc, c);
    read_saving(doc, c);
    read_execution(doc, c);
    check_lora(c);
    check_config(c);
    return c;
}

}  // namespace trainer
