// The validated run configuration.
//
// A run's configuration is one JSON document (OLMo's key names and semantics where OLMo has the
// concept), built from: the schema's defaults <- the --config file <- --set key.path=value overrides
// <- named CLI shortcuts. Every key is declared once in the schema (config.cpp), with its type,
// default, allowed values and one line of documentation; configs/README.md is generated from it.
// Validation happens once, before anything is allocated: unknown keys (with the closest known key
// suggested), wrong types, out-of-range values and every cross-field rule (batch sizes, shapes).
// Choices (a string key with a fixed set of values) are parsed once, at validation, into the enums
// below; the code compares enums, and logs and error messages spell them as the JSON does.
#pragma once

#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/choices.h"
#include "base/json.h"

namespace trainer {

struct ModelConfig {
    int d_model = 0;
    int n_heads = 0;
    int n_kv_heads = 0;  // resolved: defaults to n_heads (grouped-query attention when fewer)
    int n_layers = 0;
    int mlp_ratio = 4;
    std::optional<int> mlp_hidden_size;  // overrides mlp_ratio * d_model when set
    ActivationType activation_type = ActivationType::kSwiglu;
    bool rope = false;  // false: learned positional embedding (GPT-2)
    double rope_theta = 10000.0;
    LayerNormType layer_norm_type = LayerNormType::kDefault;  // low_precision is default in fp32
    bool layer_norm_with_affine = false;
    bool bias_for_layer_norm = false;  // resolved: defaults to include_bias
    double layer_norm_eps = 1e-5;
    bool attention_layer_norm = false;  // QK-norm
    bool attention_layer_norm_with_affine = true;
    bool norm_after = false;  // x + norm(sublayer(x)) instead of x + sublayer(norm(x))
    bool include_bias = false;
    bool weight_tying = true;
    int vocab_size = 0;
    int embedding_size = 0;  // resolved: defaults to vocab_size
    int max_sequence_length = 0;
    InitFn init_fn = InitFn::kNormal;
    double init_std = 0.02;
    std::optional<double> init_cutoff_factor;
    int eos_token_id = 0;
    int pad_token_id = 1;  // OLMo's; read and kept, the trainer pads nothing

    int head_size() const { return d_model / n_heads; }
    // T: the positions an instance of max_sequence_length tokens predicts (each token's next), the loss's count and
    // the attention's sequence length.
    int predicted_positions() const { return max_sequence_length - 1; }
    // Width of k and of v: n_kv_heads heads (d_model without grouped-query attention).
    int kv_size() const { return n_kv_heads * head_size(); }
    // Output width of att_proj: q | k | v.
    int qkv_size() const { return d_model + 2 * kv_size(); }
    // Output width of ff_proj (OLMo's hidden_size): mlp_hidden_size or mlp_ratio * d_model.
    int ff_proj_size() const { return mlp_hidden_size ? *mlp_hidden_size : mlp_ratio * d_model; }
    // Input width of ff_out: SwiGLU halves ff_proj's output.
    int ff_hidden_size() const {
        return activation_type == ActivationType::kSwiglu ? ff_proj_size() / 2 : ff_proj_size();
    }
    bool norm_has_weight() const { return layer_norm_with_affine; }
    bool norm_has_bias() const { return layer_norm_with_affine && bias_for_layer_norm; }
    // The pre-norms' backward reads their output (Backend::norm_backward_from_output): they come before the
    // sublayers and have neither weight nor bias, so the output is the normalised input itself.
    bool norm_backward_from_output() const { return !norm_after && !norm_has_weight() && !norm_has_bias(); }
    // The QK-norms' parameters (OLMo's LayerNormBase with elementwise_affine = attention_layer_norm_with_affine).
    bool qk_norm_has_weight() const { return attention_layer_norm && attention_layer_norm_with_affine; }
    bool qk_norm_has_bias() const { return qk_norm_has_weight() && bias_for_layer_norm; }
    bool rms_norm() const { return layer_norm_type == LayerNormType::kRms; }
};

struct OptimizerConfig {
    std::string name;  // adamw
    double learning_rate = 0.0;
    double beta1 = 0.9, beta2 = 0.95;
    double eps = 1e-5;
    double weight_decay = 0.0;
    bool decay_norm_and_bias = false;
    bool decay_embeddings = false;
};

struct SchedulerConfig {
    SchedulerName name = SchedulerName::kCosineWithWarmup;
    // In steps, which may be fractional: OLMo's scheduler.units tokens counts the tokens seen, and a token
    // count that is not a whole number of steps (OLMo-2's t_max of 5e12) schedules the same as the fraction.
    double t_warmup = 0;
    std::optional<double> t_max;  // defaults to the run's total steps
    double alpha_f = 0.1;
    std::optional<double> warmup_min_lr;  // defaults to 0.1 * learning_rate
    std::optional<double> grad_clip_warmup_steps;
    std::optional<double> grad_clip_warmup_factor;
    // wsd: the decay at the end of t_max, its length in steps (t_decay) or as a share of t_max (decay_fraction;
    // OLMo-core's default 0.1 when neither is set), and its shape (linear as OLMo-core's WSD, or llm.c's 1-sqrt).
    std::optional<double> t_decay;
    std::optional<double> decay_fraction;
    std::optional<DecayShape> decay_shape;
};

// OLMo's data.instance_filter: instances repeating a sequence of min_period..max_period tokens max_count times
// or more are masked out of the loss (core/data/data.h: repetitive_instance).
struct InstanceFilter {
    int min_period = 1, max_period = 13, max_count = 32;  // OLMo's defaults
};

// One source of a mixture (data.sources, OLMo-core's SourceMixtureConfig names): its token files and its share of
// every global batch (core/data/mixture.h).
struct DataSource {
    std::string name;
    std::vector<std::string> paths;
    std::vector<std::string> label_mask_paths;  // empty, or one a path (OLMo's label masks)
    double target_ratio = 0.0;
    double max_repetition_ratio = 1.0;  // how many times over its instances a run may read
};

struct DataConfig {
    std::optional<InstanceFilter> instance_filter;  // null: every instance counts
    std::vector<std::string> paths;                 // one stream of files, or (empty) the sources' files
    std::vector<std::string> label_mask_paths;      // empty, or one a path: which tokens are targets in the loss
    std::vector<DataSource> sources;                // a mixture instead of `paths`
    TokenDtype memmap_dtype = TokenDtype::kUint16;
    bool shuffle = true;
    unsigned long long seed = 0;  // resolved: defaults to the run's seed
};

// The run's tokenizer (tokenizer.identifier, OLMo's key): one the trainer has (bytes, gpt2, cl100k, dolma2, or a
// Hugging Face or OLMo identifier of one of them), or an identifier it does not know, which is kept and refused by
// name wherever text must be tokenized (token ids still work everywhere).
struct TokenizerConfig {
    std::string identifier = "bytes";
    std::optional<Tokenizer> known;  // null: a tokenizer the trainer does not have
    // The tokenizer for `chosen` (a key or flag that names one for its own use) or else the run's; a UserError naming
    // `what` (what needs text) and the identifier where the run's is one the trainer lacks.
    Tokenizer require(std::optional<Tokenizer> chosen, const std::string& what) const;
};
// The tokenizer an identifier names: ours by name, or its Hugging Face or OLMo identifier ("openai-community/gpt2",
// "cl100k_base", "allenai/dolma2-tokenizer", "tokenizers/allenai_dolma2.json"); nullopt for any other.
std::optional<Tokenizer> tokenizer_from_identifier(const std::string& identifier);

struct EvaluatorConfig {
    std::string label;
    EvaluatorType type = EvaluatorType::kLm;
    std::vector<std::string> paths;             // token files (lm) or JSONL task files (downstream)
    std::vector<std::string> label_mask_paths;  // empty, or one a path: which tokens the loss is over
    TokenDtype memmap_dtype = TokenDtype::kUint16;
    long subset_num_batches = -1;  // -1: the whole set
};

struct FsdpConfig {
    ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
    WrappingStrategy wrapping_strategy = WrappingStrategy::kNull;
    int block_group_size = 1;
    FsdpPrecision precision = FsdpPrecision::kMixed;
    GradSyncMode grad_sync_mode = GradSyncMode::kBatch;
    long min_num_params = 100000000;                        // size_based wrapping
    std::optional<int> hybrid_sharding_num_model_replicas;  // HYBRID_SHARD; null: one per node
    bool forward_prefetch = true, backward_prefetch = true, limit_all_gathers = true;
};

// What `trainer plan` and distributed_strategy auto plan for (unset: the hardware entry's defaults).
struct PlanConfig {
    std::optional<std::string> hardware;          // a hardware entry: a name or a file (core/plan/hardware.h)
    std::optional<std::string> calibration;       // bench-kernels --calibration-out
    std::optional<std::string> comm_calibration;  // bench-comm --calibration-out (the links)
    std::optional<double> device_memory_gib;      // memory of one device
    std::optional<double> host_memory_gib;        // host memory of one node, for CPU offload's state
};

// CPU offload (DeepSpeed's two levers): where the optimizer's state and the sharded parameters live.
struct CpuOffloadConfig {
    bool optimizer_state = false;  // master parameters, gradient copies and AdamW moments in host memory
    bool parameters = false;       // FSDP: the shards only in host memory, uploaded before each gather
};

// LoRA fine-tuning (lora.*): the base weights frozen, a low-rank adapter trained beside each targeted Linear
// (base/lora.h names the targets and what they map to).
struct LoraConfig {
    bool enabled = false;
    int r = 8;              // the adapters' rank
    double alpha = 16.0;    // their scale is alpha / r (alpha / sqrt(r) with use_rslora)
    double dropout = 0.05;  // of the adapters' input, in training only
    bool use_rslora = false;
    std::vector<std::string> targets;      // Hugging Face module names; resolved: never empty when enabled
    std::optional<std::string> init_from;  // an existing PEFT adapter to start from
    bool nf4 = false;                      // lora.quantize nf4 (QLoRA): the frozen block Linear weights in NF4
    bool double_quant = false;             // lora.double_quant: their absmaxes in 8 bits
    double scaling() const;
};

// max_duration, parsed once when the config is read: a count of optimizer steps, of tokens ("2e12T") or of epochs
// ("2ep") of the training data. Steps are whole; every value is positive and at most 1e15 steps.
struct Duration {
    enum class Unit { kSteps, kTokens, kEpochs };
    Unit unit = Unit::kSteps;
    double value = 0.0;
    std::string text;  // as written, for messages

    // A UserError naming config max_duration where `text` is none of the three forms.
    static Duration parse(const std::string& text);
    // The run's optimizer steps: tokens need the tokens a step trains on, epochs the instances an epoch holds.
    long steps(long tokens_per_step, long batches_per_epoch) const;
};

struct TrainConfig {
    std::string run_name;
    unsigned long long seed = 0;
    ModelConfig model;
    OptimizerConfig optimizer;
    SchedulerConfig scheduler;
    std::optional<double> max_grad_norm;  // null: no clipping
    double z_loss_multiplier = 0.0;       // softmax_auxiliary_loss: auxiliary_loss_multiplier; 0: no z-loss
    long global_train_batch_size = 0;
    long device_train_microbatch_size = 0;
    long device_eval_batch_size = 0;  // resolved: defaults to device_train_microbatch_size
    Duration max_duration;
    DataConfig data;
    std::vector<EvaluatorConfig> evaluators;
    long eval_interval = 0;        // 0: no evaluation
    bool eval_on_startup = false;  // evaluate before the first step too (OLMo-core's eval_on_startup)
    TokenizerConfig tokenizer;     // the run's (tokenizer.identifier)
    // sample.*: every `interval` steps the model continues `prompt` (core/generate.h) and rank 0 prints it.
    struct Sample {
        long interval = 0;  // 0: never
        std::string prompt;
        std::optional<Tokenizer> tokenizer;  // null: the run's
        int max_new_tokens = 64, top_k = 0;
        double temperature = 1.0;
    } sample;
    std::optional<std::string> save_folder;
    long save_interval = 0;  // 0: no periodic checkpoints (a final one is still written when save_folder is set)
    bool save_overwrite = false;
    long save_num_checkpoints_to_keep = -1;
    bool save_safetensors = false;  // rank 0 also writes model.safetensors into each checkpoint
    bool save_async = true;         // save_interval checkpoints are written by a background thread
    // Whether this run writes save_interval checkpoints in the background (core/weights/async_save.h).
    bool async_saves() const { return save_async && save_folder && save_interval > 0; }
    std::optional<std::string> load_path;  // a checkpoint folder, or "latest" in save_folder
    bool try_load_latest_save = false;     // resume from save_folder's newest checkpoint when it has one
    std::optional<std::string> init_from;  // a safetensors file with Hugging Face names
    std::optional<std::string> metrics_file;
    std::optional<std::string> tensorboard_dir;
    long console_log_interval = 1;
    long utilization_interval = 1;  // measure the device's busy / wait shares every N steps (0: never)
    double straggler_factor = 1.5;  // a rank computing this many times the median's time a step is named
    Device device = Device::kAuto;
    Precision precision = Precision::kFp32;
    AttentionKernel kernels_attention = AttentionKernel::kAuto;  // CUDA; resolved by resolve_attention
    bool kernels_bf16_activations = true;                        // amp_bf16 on CUDA: GemmOperand storage in bf16
    bool kernels_cuda_graphs =
        false;  // CUDA: each micro-batch's forward + backward replayed as a graph (kernels/graph.h)
    bool kernels_classifier_one_read = false;  // CUDA: the classifier holds a logits row in shared memory
    DistributedBackend distributed_backend = DistributedBackend::kAuto;
    DistributedStrategy distributed_strategy = DistributedStrategy::kSingle;
    FsdpConfig fsdp;
    GradSyncMode ddp_grad_sync_mode = GradSyncMode::kBatch;
    std::optional<double> peak_flops_per_device;  // FLOP/s of one device (a GPU, or one rank's CPU cores)
    ActivationCheckpointing activation_checkpointing = ActivationCheckpointing::kNull;
    CpuOffloadConfig cpu_offload;
    LoraConfig lora;
    std::optional<std::string> trace_file;  // Chrome trace of every step (one file per rank)
    PlanConfig plan;
    int threads = 0;                             // 0: one per available core
    double distributed_timeout_seconds = 120.0;  // rendezvous and every collective

    // Instances (sequences) per micro-batch and micro-batches per step on `world` ranks.
    long accumulation_steps(int world) const {
        return global_train_batch_size / (device_train_microbatch_size * world);
    }
    // The predicted tokens of a global batch: what the loss is the mean over (and what the loss gradient's scale
    // divides by).
    double global_predicted_tokens() const {
        return static_cast<double>(global_train_batch_size) * model.predicted_positions();
    }
    // Total optimizer steps of the run, from max_duration (tokens and epochs need the dataset size).
    long total_steps(long instances_per_epoch) const;
};

// Reads a config file (JSON); a bad file is a UserError naming it and the position.
Json read_config_file(const std::string& path);
// Applies one `key.path=value` override, typed by the schema (UserError on unknown key or bad value).
void apply_override(Json& doc, const std::string& assignment);
// Sets `key.path` to a JSON value (used by named CLI shortcuts), checked against the schema.
void set_config_value(Json& doc, const std::string& path, const Json& value);
// Validates `doc` against the schema, fills defaults, checks every cross-field rule and returns the config.
TrainConfig validate_config(const Json& doc);
// How a step runs on its world, as `trainer plan` varies it: the strategy, FSDP's sharding and wrap, the
// gradient reductions' timing, activation checkpointing, CPU offload and CUDA graphs.
struct ExecutionChoice {
    DistributedStrategy strategy = DistributedStrategy::kSingle;
    ShardingStrategy sharding = ShardingStrategy::kFullShard;  // fsdp
    WrappingStrategy wrapping = WrappingStrategy::kByBlock;    // fsdp
    std::optional<GradSyncMode> grad_sync;                     // ddp and fsdp; nullopt: the config's
    ActivationCheckpointing checkpointing = ActivationCheckpointing::kNull;
    bool offload_optimizer = false, offload_parameters = false, cuda_graphs = false;
};
// `config` with `choice` in place of its own (the typed fields and the document saved in checkpoints alike),
// checked by check_config.
TrainConfig with_execution(const TrainConfig& config, const ExecutionChoice& choice);
// The cross-field rules alone (model shapes, scheduler, batch sizes, data, checkpoints, offload), on a
// configuration built in code (a plan's candidate) as on one read from a file; UserError naming the key.
void check_config(const TrainConfig& config);
// The config as a complete document, made from its typed fields: every schema key, derived values resolved (the
// n_kv_heads, embedding_size, bias_for_layer_norm, data.seed and device_eval_batch_size the run uses). What
// checkpoints store and `trainer show-config` prints; validate_config reads it back as the same config.
Json config_json(const TrainConfig& config);
// Markdown table of every key (configs/README.md's key list).
std::string config_keys_markdown();
// The schema's default of a key (dotted path; a key the schema lacks is an internal error): what a config
// written before the key existed meant by its absence.
Json config_key_default(const std::string& path);
// A string key's allowed values, in the schema's order (empty for a key without a fixed set; a key the schema lacks
// is an internal error): what a CLI shortcut's help lists.
std::vector<std::string> config_key_choices(const std::string& path);
// The closest schema key to `path` (for "did you mean"), or "" when none is close.
std::string closest_config_key(const std::string& path);

}  // namespace trainer
