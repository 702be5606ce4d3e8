// The configuration schema: every key with its type, default and meaning, and the document mechanics over it (a
// user's keys checked, defaults filled, --set overrides parsed by type, the closest key to a misspelt one).
#include "base/config_schema.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_set>

#include "base/common.h"
#include "base/config.h"
#include "base/utf8.h"

namespace trainer {
namespace {

enum class KeyType { kInt, kFloat, kBool, kString, kStringList, kFloatPair, kDuration, kObjectList };

// One key of the schema. `path` uses dots; keys inside the items of an object list use "list[].key".
struct KeySpec {
    std::string path;
    KeyType type;
    Json default_value;  // null with nullable: absent means null
    bool nullable = false;
    std::vector<std::string> choices;  // for strings: the allowed values
    double min = -std::numeric_limits<double>::infinity();
    double max = std::numeric_limits<double>::infinity();
    std::string doc;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// The strings of a nullable choice whose first value (kNull) is JSON null: every other spelling.
template <typename E>
std::vector<std::string> non_null_choices() {
    std::vector<std::string> names = choice_names<E>();
    names.erase(names.begin());
    return names;
}

const std::vector<KeySpec>& schema() {
    // One key a line: the schema reads as a table.
    // clang-format off
    static const std::vector<KeySpec> keys = {
        {"run_name", KeyType::kString, "run", false, {}, -kInf, kInf, "name of the run, used in logs"},
        {"seed", KeyType::kInt, 6198, false, {}, 0, 9.2e18, "seed of the initialisation (and the data order unless data.seed is set)"},
        {"model.d_model", KeyType::kInt, nullptr, false, {}, 1, 1 << 20, "model width C (required)"},
        {"model.n_heads", KeyType::kInt, nullptr, false, {}, 1, 4096, "attention heads; must divide d_model (required)"},
        {"model.n_kv_heads", KeyType::kInt, nullptr, true, {}, 1, 4096, "key/value heads (grouped-query attention: n_heads / n_kv_heads query heads share each; 1 is multi-query); must divide n_heads; null: n_heads"},
        {"model.n_layers", KeyType::kInt, nullptr, false, {}, 1, 4096, "transformer blocks (required)"},
        {"model.mlp_ratio", KeyType::kInt, 4, false, {}, 1, 1024, "ff_proj width = mlp_ratio * d_model unless mlp_hidden_size is set"},
        {"model.mlp_hidden_size", KeyType::kInt, nullptr, true, {}, 1, 1 << 24, "ff_proj output width (before SwiGLU halves it); null: mlp_ratio * d_model"},
        {"model.activation_type", KeyType::kString, "swiglu", false, choice_names<ActivationType>(), -kInf, kInf, "MLP activation: swiglu (silu(gate) * x, x = first half), gelu (erf), gelu_tanh (GPT-2)"},
        {"model.rope", KeyType::kBool, false, false, {}, -kInf, kInf, "rotary position embeddings; false: learned positional embedding (wpe)"},
        {"model.rope_theta", KeyType::kFloat, 10000.0, false, {}, 1, kInf, "RoPE base"},
        {"model.layer_norm_type", KeyType::kString, "default", false, choice_names<LayerNormType>(), -kInf, kInf, "every norm's kind: default (LayerNorm; low_precision is the same here: the norms compute in fp32) or rms (RMSNorm, OLMo-2)"},
        {"model.layer_norm_with_affine", KeyType::kBool, false, false, {}, -kInf, kInf, "the block and final norms have a weight (and a bias if bias_for_layer_norm)"},
        {"model.bias_for_layer_norm", KeyType::kBool, nullptr, true, {}, -kInf, kInf, "norm bias (with affine); null: same as include_bias"},
        {"model.layer_norm_eps", KeyType::kFloat, 1e-5, false, {}, 0, 1, "epsilon of every norm (OLMo-2: 1e-6)"},
        {"model.attention_layer_norm", KeyType::kBool, false, false, {}, -kInf, kInf, "QK-norm: a norm over each token's whole q and whole k before RoPE (OLMo-2)"},
        {"model.attention_layer_norm_with_affine", KeyType::kBool, true, false, {}, -kInf, kInf, "the QK-norms have a weight (and a bias if bias_for_layer_norm)"},
        {"model.norm_after", KeyType::kBool, false, false, {}, -kInf, kInf, "norm each sublayer's output before the residual add (x + norm(attn(x)), OLMo-2) instead of its input (x + attn(norm(x)))"},
        {"model.include_bias", KeyType::kBool, false, false, {}, -kInf, kInf, "biases in every Linear (att_proj, attn_out, ff_proj, ff_out, LM head)"},
        {"model.weight_tying", KeyType::kBool, true, false, {}, -kInf, kInf, "LM head shares the token embedding"},
        {"model.vocab_size", KeyType::kInt, nullptr, false, {}, 1, 1 << 28, "tokenizer vocabulary; every token id must be below it (required)"},
        {"model.embedding_size", KeyType::kInt, nullptr, true, {}, 1, 1 << 28, "embedding rows, >= vocab_size (padded for speed); null: vocab_size"},
        {"model.max_sequence_length", KeyType::kInt, nullptr, false, {}, 2, 1 << 20, "tokens per instance L (L-1 predictions) (required)"},
        {"model.init_fn", KeyType::kString, "normal", false, choice_names<InitFn>(), -kInf, kInf, "initialisation (OLMo's): normal(init_std) or mitchell (1/sqrt(fan_in), outputs /sqrt(2(layer+1)), +-3 sigma)"},
        {"model.init_std", KeyType::kFloat, 0.02, false, {}, 0, kInf, "standard deviation of init_fn normal"},
        {"model.init_cutoff_factor", KeyType::kFloat, nullptr, true, {}, 0, kInf, "normal init truncated at +-factor * std; null: not truncated"},
        {"model.eos_token_id", KeyType::kInt, 0, false, {}, 0, 1 << 28, "end-of-document token id"},
        {"model.pad_token_id", KeyType::kInt, 1, false, {}, 0, 1 << 28, "padding token id (recorded for export)"},
        {"optimizer.name", KeyType::kString, "adamw", false, {"adamw"}, -kInf, kInf, "optimizer"},
        {"optimizer.learning_rate", KeyType::kFloat, 4e-4, false, {}, 0, kInf, "peak learning rate"},
        {"optimizer.betas", KeyType::kFloatPair, Json::array({0.9, 0.95}), false, {}, 0, 1, "AdamW (beta1, beta2), each in [0, 1)"},
        {"optimizer.eps", KeyType::kFloat, 1e-5, false, {}, 0, kInf, "AdamW epsilon"},
        {"optimizer.weight_decay", KeyType::kFloat, 0.0, false, {}, 0, kInf, "decoupled weight decay (applied to Linear weights, see decay_*)"},
        {"optimizer.decay_norm_and_bias", KeyType::kBool, false, false, {}, -kInf, kInf, "also decay LayerNorm weights and all biases"},
        {"optimizer.decay_embeddings", KeyType::kBool, false, false, {}, -kInf, kInf, "also decay the token and position embeddings"},
        {"scheduler.name", KeyType::kString, "cosine_with_warmup", false, choice_names<SchedulerName>(), -kInf, kInf, "learning-rate schedule (OLMo's formulas)"},
        {"scheduler.t_warmup", KeyType::kFloat, 0, false, {}, 0, 9e18, "warmup steps (linear from warmup_min_lr to learning_rate); a fraction schedules as OLMo's token units do"},
        {"scheduler.t_max", KeyType::kFloat, nullptr, true, {}, 1, 9e18, "the step at which the decay ends (may be fractional); null: the run's total steps"},
        {"scheduler.alpha_f", KeyType::kFloat, 0.1, false, {}, 0, 1, "final learning rate as a fraction of learning_rate"},
        {"scheduler.warmup_min_lr", KeyType::kFloat, nullptr, true, {}, 0, kInf, "learning rate at step 0 of warmup; null: 0.1 * learning_rate"},
        {"scheduler.grad_clip_warmup_steps", KeyType::kFloat, nullptr, true, {}, 0, 9e18, "steps during which max_grad_norm is multiplied by grad_clip_warmup_factor (step <= this)"},
        {"scheduler.grad_clip_warmup_factor", KeyType::kFloat, nullptr, true, {}, 0, kInf, "factor on max_grad_norm during the clip warmup"},
        {"scheduler.t_decay", KeyType::kFloat, nullptr, true, {}, 0, 9e18, "wsd: steps of the decay that ends at t_max (may be fractional); null: decay_fraction"},
        {"scheduler.decay_fraction", KeyType::kFloat, nullptr, true, {}, 0, 1, "wsd: the decay's share of t_max, rounded to whole steps; null (and t_decay null): 0.1, OLMo-core's"},
        {"scheduler.decay_shape", KeyType::kString, nullptr, true, choice_names<DecayShape>(), -kInf, kInf, "wsd: linear (OLMo-core) or 1-sqrt (llm.c) from learning_rate down to alpha_f x learning_rate; null: linear"},
        {"max_grad_norm", KeyType::kFloat, 1.0, true, {}, 0, kInf, "global gradient-norm clipping threshold; null: no clipping"},
        {"softmax_auxiliary_loss", KeyType::kBool, false, false, {}, -kInf, kInf, "add the z-loss auxiliary_loss_multiplier * logsumexp(logits)^2 per token to the objective (PaLM's, OLMo-2's); logged as z_loss beside the cross-entropy loss"},
        {"auxiliary_loss_multiplier", KeyType::kFloat, 1e-4, false, {}, 0, kInf, "the z-loss multiplier with softmax_auxiliary_loss (OLMo's default 1e-4; OLMo-2 1e-5)"},
        {"global_train_batch_size", KeyType::kInt, nullptr, false, {}, 1, 1e12, "instances per optimizer step, all ranks together (required)"},
        {"device_train_microbatch_size", KeyType::kInt, nullptr, false, {}, 1, 1e9, "instances per forward/backward on one rank (required)"},
        {"device_eval_batch_size", KeyType::kInt, nullptr, true, {}, 1, 1e9, "instances per evaluation forward; null: device_train_microbatch_size"},
        {"max_duration", KeyType::kDuration, nullptr, false, {}, -kInf, kInf, "length of the run: steps (1000), tokens (\"2e12T\") or epochs (\"1ep\") (required)"},
        {"data.paths", KeyType::kStringList, nullptr, true, {}, -kInf, kInf, "token files (raw uint16/uint32, .npy, llm.c .bin), concatenated in order (this or data.sources is required)"},
        {"data.label_mask_paths", KeyType::kStringList, nullptr, true, {}, -kInf, kInf, "OLMo's label masks: one file a token file of data.paths, in its order, one byte a token (a raw boolean memmap as OLMo writes it, or .npy of bool); a token whose byte is 0 is no target: the loss skips it (cross_entropy's ignore_index) though the model reads it; the loss is then the mean over the global batch's tokens in the loss (tokens_in_loss in the metrics); null: every token"},
        {"data.sources", KeyType::kObjectList, Json::array(), false, {}, -kInf, kInf, "a mixture instead of data.paths (OLMo-core's source mixture): sources, each {source_name, target_ratio, paths, max_repetition_ratio}; every global batch takes each source's share, exactly over the run, in an order fixed by the seed and the step"},
        {"data.sources[].source_name", KeyType::kString, nullptr, false, {}, -kInf, kInf, "the source's name in the metrics (tokens_by_source) (required)"},
        {"data.sources[].target_ratio", KeyType::kFloat, nullptr, false, {}, 0, 1, "the source's share of every global batch; the ratios sum to 1 (required)"},
        {"data.sources[].paths", KeyType::kStringList, nullptr, false, {}, -kInf, kInf, "the source's token files (required)"},
        {"data.sources[].label_mask_paths", KeyType::kStringList, nullptr, true, {}, -kInf, kInf, "the source's label masks, one a file of its paths (as data.label_mask_paths); null: every token of the source in the loss"},
        {"data.sources[].max_repetition_ratio", KeyType::kFloat, 1.0, false, {}, 1, 1e6, "the run may read the source's instances at most this many times over (checked before step 1; OLMo-core's default 1: none twice)"},
        {"data.memmap_dtype", KeyType::kString, "uint16", false, choice_names<TokenDtype>(), -kInf, kInf, "token type of raw files without a header"},
        {"data.shuffle", KeyType::kBool, true, false, {}, -kInf, kInf, "seeded permutation of instances per epoch; false: file order"},
        {"data.seed", KeyType::kInt, nullptr, true, {}, 0, 9.2e18, "seed of the data order; null: the run's seed"},
        {"data.instance_filter.repetition_max_period", KeyType::kInt, nullptr, true, {}, 1, 1e6, "OLMo's instance filter: mask out of the loss every training instance that repeats a sequence of repetition_min_period..repetition_max_period tokens repetition_max_count times or more (OLMo-2's recipe: 13, 1, 32); null (with repetition_max_count): no filter"},
        {"data.instance_filter.repetition_min_period", KeyType::kInt, 1, false, {}, 1, 1e6, "the instance filter's shortest repeated sequence"},
        {"data.instance_filter.repetition_max_count", KeyType::kInt, nullptr, true, {}, 3, 1e9, "the instance filter's repeats that mask an instance; null (with repetition_max_period): no filter"},
        {"evaluators", KeyType::kObjectList, Json::array(), false, {}, -kInf, kInf, "validation sets and downstream tasks, each {label, type, data: {paths, memmap_dtype}, subset_num_batches}"},
        {"evaluators[].label", KeyType::kString, "val", false, {}, -kInf, kInf, "name of the validation set in logs"},
        {"evaluators[].type", KeyType::kString, "lm", false, choice_names<EvaluatorType>(), -kInf, kInf, "lm: the mean loss over token files; downstream: a multiple-choice task in JSONL files (docs/downstream.md), scored by its continuations' log-likelihoods (acc, len_norm, pmi_dc, bpb), as OLMo's downstream evaluators"},
        {"evaluators[].data.paths", KeyType::kStringList, nullptr, false, {}, -kInf, kInf, "the evaluator's files (required): token files (lm), or JSONL task files read in order (downstream)"},
        {"evaluators[].data.label_mask_paths", KeyType::kStringList, nullptr, true, {}, -kInf, kInf, "the validation files' label masks, one a file (as data.label_mask_paths): the loss is the mean over the tokens in the loss; null: every token"},
        {"evaluators[].data.memmap_dtype", KeyType::kString, "uint16", false, choice_names<TokenDtype>(), -kInf, kInf, "token type of raw validation files"},
        {"evaluators[].subset_num_batches", KeyType::kInt, -1, false, {}, -1, 1e12, "evaluate this many batches (downstream: the first subset_num_batches x device_eval_batch_size examples); -1: all"},
        {"eval_interval", KeyType::kInt, 0, false, {}, 0, 9e18, "evaluate every N steps (and after the last); 0: never"},
        {"eval_on_startup", KeyType::kBool, false, false, {}, -kInf, kInf, "evaluate before the first step too (at step 0, or the step a resumed run starts from), as OLMo-core's eval_on_startup"},
        {"sample.interval", KeyType::kInt, 0, false, {}, 0, 9e18, "every N steps the model continues sample.prompt (as trainer generate, with a KV cache; every rank takes part, so FSDP gathers its units) and rank 0 prints it (metrics: sample); 0: never. Its buffers count as other memory, which trainer plan does not predict"},
        {"sample.prompt", KeyType::kString, "", false, {}, -kInf, kInf, "the sample's prompt; \"\": it starts after an EOS, as a document does"},
        {"sample.max_new_tokens", KeyType::kInt, 64, false, {}, 1, 1e6, "tokens a sample adds (the prompt and these within max_sequence_length)"},
        {"sample.temperature", KeyType::kFloat, 1.0, false, {}, 0, 1e6, "the sample's temperature; 0: greedy (draws seeded by the seed and the step)"},
        {"sample.top_k", KeyType::kInt, 0, false, {}, 0, 1e9, "the sample draws among the k most likely tokens; 0: all"},
        {"sample.tokenizer", KeyType::kString, nullptr, true, choice_names<Tokenizer>(), -kInf, kInf, "the tokenizer of the sample's prompt and text; null: the run's (tokenizer.identifier)"},
        {"tokenizer.identifier", KeyType::kString, "bytes", false, {}, -kInf, kInf, "the run's tokenizer (OLMo's key; \"tokenizer\": \"NAME\" is short for it, as is --set tokenizer=NAME): bytes, gpt2, cl100k or dolma2, or the Hugging Face or OLMo identifier of one (openai-community/gpt2, cl100k_base, allenai/dolma2-tokenizer, tokenizers/allenai_dolma2.json); the sample, trainer generate and downstream evaluators tokenize text with it. Another identifier (OLMo-1B's GPT-NeoX one) is kept and refused by name wherever text must be tokenized: token ids still work"},
        {"save_folder", KeyType::kString, nullptr, true, {}, -kInf, kInf, "folder of checkpoints step<N>/ (created)"},
        {"save_interval", KeyType::kInt, 0, false, {}, 0, 9e18, "checkpoint every N steps; 0: only at the end (when save_folder is set)"},
        {"save_overwrite", KeyType::kBool, false, false, {}, -kInf, kInf, "allow a fresh run to write into a save_folder that already holds checkpoints"},
        {"save_safetensors", KeyType::kBool, false, false, {}, -kInf, kInf, "rank 0 also writes the full weights as model.safetensors (Hugging Face names) into every checkpoint folder; a LoRA fine-tune's, its PEFT adapter (adapter_model.safetensors and adapter_config.json)"},
        {"save_async", KeyType::kBool, true, false, {}, -kInf, kInf, "save_interval checkpoints copy the state to host memory at the end of the step (pinned on GPUs; host_checkpoint_snapshot in the memory report) and are written by a background thread while training goes on; false: every rank stops for the whole write"},
        {"save_num_checkpoints_to_keep", KeyType::kInt, -1, false, {}, -1, 9e18, "keep the newest N checkpoints; -1: all"},
        {"load_path", KeyType::kString, nullptr, true, {}, -kInf, kInf, "resume from this checkpoint folder, or \"latest\" in save_folder"},
        {"try_load_latest_save", KeyType::kBool, false, false, {}, -kInf, kInf, "resume from the newest complete checkpoint in save_folder when there is one (over load_path), else start as configured: the same command serves the first run and every requeue after a preemption"},
        {"init_from", KeyType::kString, nullptr, true, {}, -kInf, kInf, "initial weights with Hugging Face names (GPT2LMHeadModel, OlmoForCausalLM, Olmo2ForCausalLM, LlamaForCausalLM): a safetensors file, or a Hugging Face model directory (one model.safetensors or shards with their index; its config.json must agree); a resumed run (load_path) takes the checkpoint's weights instead"},
        {"metrics_file", KeyType::kString, nullptr, true, {}, -kInf, kInf, "write one JSON object per step here (and a final summary)"},
        {"tensorboard_dir", KeyType::kString, nullptr, true, {}, -kInf, kInf, "write every step's metrics (each number of the metrics file's step record) as TensorBoard scalars to an event file in this folder (created): tensorboard --logdir DIR"},
        {"console_log_interval", KeyType::kInt, 1, false, {}, 1, 9e18, "print a console line every N steps"},
        {"straggler_factor", KeyType::kFloat, 1.5, false, {}, 1.0, 1e9, "every console_log_interval steps the ranks compare their compute time a step (the step less its waits on collectives); a rank above this factor times the median is named on the console with its host and its times, and in the metrics (stragglers)"},
        {"utilization_interval", KeyType::kInt, 1, false, {}, 0, 9e18, "every N steps, measure how much of the step the device ran kernels (device_busy_fraction), waited for collectives (device_comm_wait_fraction) or waited for the host (device_host_wait_fraction), with the GPU's NVML counters; CUDA times each op with a pair of events; 0: never (a trace_file measures every step)"},
        {"device", KeyType::kString, "auto", false, choice_names<Device>(), -kInf, kInf, "where to train: auto picks cuda when a GPU is present"},
        {"precision", KeyType::kString, "fp32", false, choice_names<Precision>(), -kInf, kInf, "compute precision: fp32; amp_bf16 (bf16 GEMMs and attention with fp32 master weights: the CUDA backend); amp_fp8 (amp_bf16 with the blocks' Linear layers on FP8 operands through cuBLASLt: e4m3 forward, e5m2 gradients, per-tensor scales from the current amax; GPUs of compute capability 8.9 and newer; the CPU backend emulates it on fp32, slowly)"},
        {"kernels.attention", KeyType::kString, "auto", false, choice_names<AttentionKernel>(), -kInf, kInf, "CUDA attention: auto (cudnn in amp_bf16 where cuDNN runs the shape, else native), native (hand-written, online softmax, fp32, deterministic; the reference), cudnn (cuDNN's fused flash attention in bf16; not bitwise reproducible) or flash (ours, on tensor cores, in bf16, deterministic; heads of 64 or 128 channels; wgmma on compute capability 9.0, mma.sync elsewhere); cudnn and flash need precision amp_bf16"},
        {"kernels.bf16_activations", KeyType::kBool, true, false, {}, -kInf, kInf, "amp_bf16 on CUDA: store the activations GEMMs read or write for element-wise ops (norm, attention and MLP outputs, qkv, the ff_proj output), the gradients only GEMMs and bf16 kernels read, and the LM head's logits in bf16, as autocast does; false keeps them fp32 and casts per GEMM (to compare, or to isolate a numerical question)"},
        {"kernels.cuda_graphs", KeyType::kBool, false, false, {}, -kInf, kInf, "CUDA: record each micro-batch's forward and backward as a CUDA graph on its second run and replay it from then on (torch.compile's reduce-overhead): one launch instead of one per kernel, where short kernels (small models) leave the GPU waiting for the host; distributed_strategy single, no cpu_offload"},
        {"kernels.classifier_one_read", KeyType::kBool, false, false, {}, -kInf, kInf, "CUDA: the fused softmax + cross-entropy holds each logits row in shared memory between its two passes, so the logits are read from device memory once (rows of whole 16-byte words up to the shared memory a block may take: 114,176 bf16 or 57,088 fp32 logits on an H100; longer rows are read twice); false (the default until a GPU has timed both) reads every row twice; the same bits either way"},
        {"distributed_backend", KeyType::kString, "auto", false, choice_names<DistributedBackend>(), -kInf, kInf, "collectives library: auto is nccl on cuda and gloo on cpu (a lone process needs none); nccl forces an NCCL communicator even for one rank; gloo on cuda stages each collective through pinned host memory and lets several ranks share a GPU (rank on GPU LOCAL_RANK % GPUs)"},
        {"distributed_strategy", KeyType::kString, "single", false, choice_names<DistributedStrategy>(), -kInf, kInf, "data-parallel strategy (single: one process owns full parameters)"},
        {"fsdp.sharding_strategy", KeyType::kString, "FULL_SHARD", false, choice_names<ShardingStrategy>(), -kInf, kInf, "FSDP sharding (PyTorch's names)"},
        {"fsdp.wrapping_strategy", KeyType::kString, nullptr, true, non_null_choices<WrappingStrategy>(), -kInf, kInf, "FSDP units (OLMo's); null: the whole model is one unit"},
        {"lora.enabled", KeyType::kBool, false, false, {}, -kInf, kInf, "LoRA fine-tuning: every base weight frozen (no gradient, no optimizer state, never reduced), a low-rank adapter trained beside each Linear of lora.targets (PEFT's: W x + (alpha / r) B A dropout(x), A (r, in) uniform in +-1/sqrt(in), B (out, r) zero)"},
        {"lora.r", KeyType::kInt, 8, false, {}, 1, 4096, "the adapters' rank"},
        {"lora.alpha", KeyType::kFloat, 16.0, false, {}, 0, 1e9, "the adapters' scale is alpha / r (alpha / sqrt(r) with lora.use_rslora); > 0"},
        {"lora.dropout", KeyType::kFloat, 0.05, false, {}, 0, 0.999, "dropout of each adapter's input in training, its masks keyed by (seed, step, instance, position, adapter, channel): the same on any world size"},
        {"lora.init_from", KeyType::kString, nullptr, true, {}, -kInf, kInf, "start the adapters from an existing PEFT adapter (its directory, whose adapter_config.json must agree on r, lora_alpha and use_rslora, or its adapter_model.safetensors) instead of PEFT's initialisation, to continue it or to generate with it; a resumed run takes the checkpoint's adapters"},
        {"lora.quantize", KeyType::kString, "none", false, {"none", "nf4"}, -kInf, kInf, "QLoRA: nf4 stores every frozen block Linear weight as NF4 (the 16-value NormalFloat code, one fp32 absmax a block of 64: 0.5625 bytes a parameter), what FSDP shards and gathers, dequantized by our own kernels for compute; the embedding, the LM head and the norms stay fp32; none: the base as loaded"},
        {"lora.double_quant", KeyType::kBool, false, false, {}, -kInf, kInf, "QLoRA's double quantization (with lora.quantize nf4): each NF4 block's absmax in 8 bits of bitsandbytes' dynamic map, blocks of 256 of them with an fp32 absmax and the tensor's mean as offset: about 0.516 bytes a parameter"},
        {"lora.use_rslora", KeyType::kBool, false, false, {}, -kInf, kInf, "rank-stabilised LoRA: scale alpha / sqrt(r)"},
        {"lora.targets", KeyType::kStringList, nullptr, true, {}, -kInf, kInf, "the Linear layers that get an adapter, by their Hugging Face module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (RoPE models), or GPT-2's c_attn, c_proj (attention's output), c_fc, mlp.c_proj; and lm_head, an untied LM head; null: LitGPT's default, the query and the value (q_proj and v_proj; GPT-2's fused c_attn)"},
        {"fsdp.block_group_size", KeyType::kInt, 1, false, {}, 1, 4096, "blocks per unit for by_block_group*"},
        {"fsdp.precision", KeyType::kString, "mixed", false, choice_names<FsdpPrecision>(), -kInf, kInf, "FSDP precision: mixed (bf16 params, fp32 reduction), pure (bf16 reduction too), fp32"},
        {"fsdp.min_num_params", KeyType::kInt, 100000000, false, {}, 1, 9e18, "size_based wrapping: a unit holds at least this many parameters (PyTorch's size_based_auto_wrap_policy default)"},
        {"fsdp.hybrid_sharding_num_model_replicas", KeyType::kInt, nullptr, true, {}, 1, 1e6, "HYBRID_SHARD: number of model replicas (must divide the world size); null: one per node"},
        {"fsdp.forward_prefetch", KeyType::kBool, true, false, {}, -kInf, kInf, "start gathering the next FSDP unit when a unit's forward starts"},
        {"fsdp.backward_prefetch", KeyType::kBool, true, false, {}, -kInf, kInf, "start gathering the next FSDP unit (in backward order) when a unit's backward starts"},
        {"fsdp.limit_all_gathers", KeyType::kBool, true, false, {}, -kInf, kInf, "prefetch only while fewer than two FSDP units (besides the root) are gathered"},
        {"fsdp.grad_sync_mode", KeyType::kString, "batch", false, choice_names<GradSyncMode>(), -kInf, kInf, "reduce gradients once per step (batch) or on every micro-batch"},
        {"ddp.grad_sync_mode", KeyType::kString, "batch", false, choice_names<GradSyncMode>(), -kInf, kInf, "all-reduce once per step (batch) or on every micro-batch"},
        {"distributed_timeout_seconds", KeyType::kFloat, 120.0, false, {}, 0.1, 86400, "rendezvous and collective timeout: a rank that never arrives or a collective that never completes ends the run with an error naming it"},
        {"activation_checkpointing", KeyType::kString, nullptr, true, non_null_choices<ActivationCheckpointing>(), -kInf, kInf, "recompute activations in the backward instead of keeping them (OLMo's): whole_layer (each block keeps its input and recomputes its forward), one_in_two / one_in_three / one_in_four / one_in_eight / two_in_three / three_in_four (whole_layer for that share of the blocks), fine_grained (blocks keep their GEMM and attention outputs and recompute norms and activations; with OLMo's parameter-free norms they keep the norms' outputs too and recompute only the activations); null: keep everything"},
        {"plan.hardware", KeyType::kString, nullptr, true, {}, -kInf, kInf, "trainer plan and distributed_strategy auto: the hardware entry the step times are predicted for: a name of configs/hardware (h100-sxm, h200, a100-40gb, a100-80gb, a100-40gb-pcie, cpu) or the path of a hardware file (copy one and edit it for another machine); null: cpu on the CPU; on CUDA the entry of the GPU the rank computes on, h100-sxm where it has none (said on stderr) or the node has no GPU"},
        {"plan.calibration", KeyType::kString, nullptr, true, {}, -kInf, kInf, "trainer plan and distributed_strategy auto: op times measured by trainer bench-kernels --calibration-out (required for the cpu entry)"},
        {"plan.comm_calibration", KeyType::kString, nullptr, true, {}, -kInf, kInf, "trainer plan and distributed_strategy auto: the links measured by trainer bench-comm --calibration-out (bandwidth and latency per collective, within a node and between nodes), instead of the hardware entry's"},
        {"plan.device_memory_gib", KeyType::kFloat, nullptr, true, {}, 0.001, 1e9, "trainer plan and distributed_strategy auto: GiB of memory per device that a configuration must fit in; null: the hardware entry's (none for the CPU), and for distributed_strategy auto on CUDA the memory of the GPU the rank computes on"},
        {"plan.host_memory_gib", KeyType::kFloat, nullptr, true, {}, 0.001, 1e9, "trainer plan and distributed_strategy auto: GiB of host memory on one node that the offloaded state of its ranks must fit in; null: for distributed_strategy auto this node's (MemTotal, or the memory cgroup's limit where less), for trainer plan not checked"},
        {"trace_file", KeyType::kString, nullptr, true, {}, -kInf, kInf, "write a Chrome trace (Perfetto, chrome://tracing) of every step here: units' forward / backward / recompute, collectives with their bytes, waits, optimizer, data, checkpoints; with several ranks each writes <name>.rank<r>.<ext> (scripts/merge_traces.py joins them)"},
        {"cpu_offload.optimizer_state", KeyType::kBool, false, false, {}, -kInf, kInf, "keep the fp32 master parameters and the AdamW moments in (pinned) host memory and run AdamW on the host; the gradients stay on the device and stream down in chunks as the host updates, each updated chunk going straight back up (DeepSpeed's offload_optimizer)"},
        {"cpu_offload.parameters", KeyType::kBool, false, false, {}, -kInf, kInf, "also keep the sharded parameters only in host memory, each FSDP unit's shard uploaded before its gather (FSDP's CPUOffload(offload_params=True), DeepSpeed's offload_param); needs cpu_offload.optimizer_state and a sharding strategy that gathers (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD)"},
        {"peak_flops_per_device", KeyType::kFloat, nullptr, true, {}, 1, kInf, "peak FLOP/s of one device (a GPU; on the CPU, the cores one rank computes on) used for MFU; null: the backend's (GPU: SMs x clock x FLOP/clock/SM; CPU: threads x measured clock x FMA width and pipes)"},
        {"threads", KeyType::kInt, 0, false, {}, 0, 4096, "compute threads (OpenMP and BLAS); 0: OMP_NUM_THREADS if set (trainer launch sets each rank's share), else one per available core, fewer while other processes use cores (CPU device)"},
    };
    // clang-format on
    return keys;
}

const char* type_name(KeyType t) {
    switch (t) {
        case KeyType::kInt:
            return "an integer";
        case KeyType::kFloat:
            return "a number";
        case KeyType::kBool:
            return "true or false";
        case KeyType::kString:
            return "a string";
        case KeyType::kStringList:
            return "a list of strings";
        case KeyType::kFloatPair:
            return "a list of two numbers";
        case KeyType::kDuration:
            return "steps (integer) or a string like \"2e12T\" (tokens) or \"1ep\" (epochs)";
        case KeyType::kObjectList:
            return "a list of objects";
    }
    return "?";
}

const KeySpec* find_spec(const std::string& path) {
    for (const auto& k : schema()) {
        if (k.path == path) return &k;
    }
    return nullptr;
}

// True when some schema key lies below `prefix` (so `prefix` names an object).
bool is_object_prefix(const std::string& prefix) {
    const std::string p = prefix + ".";
    for (const auto& k : schema()) {
        if (k.path.compare(0, p.size(), p) == 0) return true;
    }
    return false;
}

size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
        cur[0] = i;
        for (size_t j = 1; j <= b.size(); ++j) {
            const size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
        }
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

[[noreturn]] void unknown_key(const std::string& path, const std::string& where) {
    const std::string near = closest_config_key(path);
    std::string msg = fmt::format("{}unknown config key \"{}\"", where, path);
    if (!near.empty()) msg += fmt::format("; did you mean \"{}\"?", near);
    msg += " (configs/README.md lists every key)";
    throw UserError(msg);
}

// Checks one value against its spec; `shown` is the path as the user wrote it (with list indices).
void check_value(const KeySpec& spec, const Json& v, const std::string& shown) {
    if (v.is_null()) {
        if (spec.nullable) return;
        user_error("config {}: null is not allowed; expected {}", shown, type_name(spec.type));
    }
    auto bad_type = [&]() {
        user_error("config {}: {} has the wrong type; expected {}", shown, short_json(v), type_name(spec.type));
    };
    auto check_range = [&](double x) {
        if (x < spec.min || x > spec.max) {
            user_error("config {}: {} is out of range; expected a value in [{}, {}]", shown, short_json(v), spec.min,
                       spec.max);
        }
    };
    switch (spec.type) {
        case KeyType::kInt:
            if (!v.is_number_integer()) {
                // Allow 1e3-style floats that are whole numbers (JSON writers emit them).
                if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()) {
                    check_range(v.get<double>());
                    return;
                }
                bad_type();
            }
            check_range(static_cast<double>(v.get<long long>()));
            return;
        case KeyType::kFloat:
            if (!v.is_number()) bad_type();
            if (!std::isfinite(v.get<double>()))
                user_error("config {}: {} is not a finite number; expected {}", shown, v.get<double>(),
                           type_name(spec.type));
            check_range(v.get<double>());
            return;
        case KeyType::kBool:
            if (!v.is_boolean()) bad_type();
            return;
        case KeyType::kString:
            if (!v.is_string()) bad_type();
            if (!spec.choices.empty()) {
                const auto s = v.get<std::string>();
                if (std::find(spec.choices.begin(), spec.choices.end(), s) == spec.choices.end()) {
                    std::string allowed;
                    for (size_t i = 0; i < spec.choices.size(); ++i) {
                        allowed += (i == 0 ? "" : (i + 1 == spec.choices.size() ? " or " : ", ")) + spec.choices[i];
                    }
                    if (spec.nullable) allowed += " or null";
                    user_error("config {}: \"{}\"; expected {}", shown, s, allowed);
                }
            }
            return;
        case KeyType::kStringList:
            if (v.is_string()) return;  // a single path is accepted as a one-element list
            if (!v.is_array()) bad_type();
            if (v.empty()) {
                const bool paths = spec.path.size() >= 5 && spec.path.compare(spec.path.size() - 5, 5, "paths") == 0;
                user_error("config {}: [] is empty; expected {}{}", shown,
                           paths ? "at least one file (a list of paths, or one path)" : "at least one entry, or null",
                           shown == "data.paths" ? ", or null with data.sources set" : "");
            }
            for (const auto& e : v) {
                if (!e.is_string()) bad_type();
            }
            return;
        case KeyType::kFloatPair:
            if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number()) bad_type();
            for (const auto& e : v) {
                const double x = e.get<double>();
                if (!(x >= 0.0 && x < 1.0)) {
                    user_error("config {}: {} is out of range; expected each in [0, 1)", shown, short_json(v));
                }
            }
            return;
        case KeyType::kDuration:
            if (v.is_number_integer()) {
                if (v.get<long long>() < 1) user_error("config {}: {}; expected at least 1 step", shown, short_json(v));
                return;
            }
            if (!v.is_string()) bad_type();
            return;  // parsed (and checked) by parse_duration
        case KeyType::kObjectList:
            if (!v.is_array()) bad_type();
            return;
    }
}

// Walks a user document: every leaf must be a schema key of the right type.
void check_object(const Json& obj, const std::string& schema_prefix, const std::string& shown_prefix) {
    if (!obj.is_object()) {
        user_error("config {}: expected an object, got {}", shown_prefix.empty() ? "<top level>" : shown_prefix,
                   short_json(obj));
    }
    for (auto it = obj.begin(); it != obj.end(); ++it) {
        const std::string path = schema_prefix.empty() ? it.key() : schema_prefix + "." + it.key();
        const std::string shown = shown_prefix.empty() ? it.key() : shown_prefix + "." + it.key();
        if (const KeySpec* spec = find_spec(path)) {
            check_value(*spec, it.value(), shown);
            if (spec->type == KeyType::kObjectList) {
                for (size_t i = 0; i < it.value().size(); ++i) {
                    check_object(it.value()[i], path + "[]", fmt::format("{}[{}]", shown, i));
                }
            }
        } else if (is_object_prefix(path)) {
            check_object(it.value(), path, shown);
        } else {
            unknown_key(shown, "");
        }
    }
}

// The parts of a dotted key path: "fsdp.precision" -> {"fsdp", "precision"}.
std::vector<std::string> path_parts(const std::string& path) {
    std::vector<std::string> parts;
    size_t start = 0;
    for (;;) {
        const size_t dot = path.find('.', start);
        parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
        if (dot == std::string::npos) return parts;
        start = dot + 1;
    }
}

const Json& at_path(const Json& doc, const std::string& path) {
    const Json* cur = &doc;
    for (const std::string& part : path_parts(path)) cur = &cur->at(part);
    return *cur;
}

// The value at `path`, creating the objects on the way (null where the leaf is new).
Json* at_path_create(Json& doc, const std::string& path) {
    Json* cur = &doc;
    for (const std::string& part : path_parts(path)) {
        if (!cur->is_object()) *cur = Json::object();
        cur = &(*cur)[part];
    }
    return cur;
}

// Fills the defaults of every non-list key below `schema_prefix` into `obj`.
void fill_defaults(Json& obj, const std::string& schema_prefix) {
    const std::string p = schema_prefix.empty() ? "" : schema_prefix + ".";
    for (const auto& k : schema()) {
        if (k.path.compare(0, p.size(), p) != 0) continue;
        const std::string rest = k.path.substr(p.size());
        if (rest.find("[]") != std::string::npos) continue;  // keys inside list items
        const size_t dot = rest.rfind('.');
        Json* parent = dot == std::string::npos ? &obj : at_path_create(obj, rest.substr(0, dot));
        const std::string leaf = rest.substr(dot == std::string::npos ? 0 : dot + 1);
        if (!parent->contains(leaf)) (*parent)[leaf] = k.default_value;
    }
}

void require(const Json& doc, const std::string& path) {
    if (at_path(doc, path).is_null()) user_error("config {}: required, not set", path);
}

// An override's string as written, or the string a JSON string literal spells ("a.bin" with its quotes, as a user
// copying from a config file writes it); a literal that is not valid JSON is refused.
// An override's text as messages show it: cut to 60 characters.
std::string shown_text(const std::string& text) { return text.size() > 60 ? text.substr(0, 57) + "..." : text; }

std::string unquoted(const std::string& text) {
    if (text.size() < 2 || text.front() != '"') return text;
    const Json v = parse_json(text, fmt::format("--set value {}", shown_text(text)));
    if (!v.is_string()) user_error("--set value {}: expected one JSON string", text);
    return v.get<std::string>();
}

// Parses an override's text by the key's type: "8" for integers, "3e-4" for numbers, "true"/"false",
// "null" where nullable, a JSON literal for lists (or a comma-separated list of strings), strings as is.
Json parse_typed(const KeySpec& spec, const std::string& path, const std::string& text) {
    if (text == "null") return nullptr;
    auto fail = [&]() -> Json { user_error("--set {}={}: \"{}\" is not {}", path, text, text, type_name(spec.type)); };
    switch (spec.type) {
        case KeyType::kInt: {
            errno = 0;
            char* end = nullptr;
            const long long x = std::strtoll(text.c_str(), &end, 10);
            if (end != text.c_str() && *end == '\0' && errno == 0) return x;
            const double d = std::strtod(text.c_str(), &end);  // 1e6
            if (end != text.c_str() && *end == '\0' && std::floor(d) == d && std::fabs(d) < 9.2e18) {
                return static_cast<long long>(d);
            }
            return fail();
        }
        case KeyType::kFloat: {
            char* end = nullptr;
            const double d = std::strtod(text.c_str(), &end);
            if (end != text.c_str() && *end == '\0') return d;
            return fail();
        }
        case KeyType::kBool:
            if (text == "true") return true;
            if (text == "false") return false;
            return fail();
        case KeyType::kString:
            return unquoted(text);
        case KeyType::kDuration: {
            char* end = nullptr;
            const long long x = std::strtoll(text.c_str(), &end, 10);
            if (end != text.c_str() && *end == '\0') return x;
            return text;
        }
        case KeyType::kStringList:
        case KeyType::kFloatPair:
        case KeyType::kObjectList: {
            if (!text.empty() && text[0] == '[') {
                return parse_json(text, fmt::format("--set {}={}", path, shown_text(text)));
            }
            if (spec.type != KeyType::kStringList) return fail();
            if (text.size() >= 2 && text.front() == '"') return Json::array({unquoted(text)});
            Json list = Json::array();
            std::stringstream ss(text);
            std::string item;
            while (std::getline(ss, item, ',')) list.push_back(item);
            return list;
        }
    }
    return fail();
}

}  // namespace

Json complete_config_document(const Json& user_doc) {
    Json doc = user_doc;
    // "tokenizer": "gpt2" is short for "tokenizer": {"identifier": "gpt2"}.
    if (doc.is_object() && doc.contains("tokenizer") && doc["tokenizer"].is_string()) {
        doc["tokenizer"] = Json{{"identifier", doc["tokenizer"]}};
    }
    check_object(doc, "", "");
    fill_defaults(doc, "");
    for (auto& ev : doc["evaluators"]) fill_defaults(ev, "evaluators[]");
    for (auto& source : doc["data"]["sources"]) fill_defaults(source, "data.sources[]");
    for (const char* key :
         {"model.d_model", "model.n_heads", "model.n_layers", "model.vocab_size", "model.max_sequence_length",
          "global_train_batch_size", "device_train_microbatch_size", "max_duration"}) {
        require(doc, key);
    }
    return doc;
}

Json config_key_default(const std::string& path) {
    const KeySpec* spec = find_spec(path);
    TRAINER_CHECK(spec != nullptr, "no config key {}", path);
    return spec->default_value;
}

std::vector<std::string> config_key_choices(const std::string& path) {
    const KeySpec* spec = find_spec(path);
    TRAINER_CHECK(spec != nullptr, "no config key {}", path);
    return spec->choices;
}

std::string closest_config_key(const std::string& path) {
    std::string best;
    size_t best_d = std::numeric_limits<size_t>::max();
    // Compare with and without list indices so "evaluators[0].lable" finds "evaluators[].label".
    std::string normalized;
    for (size_t i = 0; i < path.size(); ++i) {
        if (path[i] == '[') {
            normalized += "[]";
            while (i < path.size() && path[i] != ']') ++i;
        } else {
            normalized += path[i];
        }
    }
    const size_t limit = std::max<size_t>(3, normalized.size() / 3);
    // The distance is at least the difference of the lengths: past the limit it is not computed (a 64 KB
    // --set key took seconds against every schema key), and nothing past the limit is suggested anyway.
    auto distance = [&](const std::string& a, const std::string& b) {
        const size_t gap = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
        return gap > limit ? limit + 1 : edit_distance(a, b);
    };
    const size_t ndot = normalized.rfind('.');
    const std::string nleaf = ndot == std::string::npos ? normalized : normalized.substr(ndot + 1);
    const std::string nparent = ndot == std::string::npos ? "" : normalized.substr(0, ndot);
    // Whether `word` is one of the '_'-separated words of `leaf` ("name" of "source_name").
    const auto has_word = [](const std::string& leaf, const std::string& word) {
        for (size_t at = leaf.find(word); at != std::string::npos; at = leaf.find(word, at + 1)) {
            const size_t end = at + word.size();
            if ((at == 0 || leaf[at - 1] == '_') && (end == leaf.size() || leaf[end] == '_')) return true;
        }
        return false;
    };
    for (const auto& k : schema()) {
        size_t d = distance(normalized, k.path);
        // A key typed without its section ("learning_rate") is close to "optimizer.learning_rate".
        const size_t dot = k.path.rfind('.');
        if (dot != std::string::npos) {
            const std::string leaf = k.path.substr(dot + 1);
            d = std::min(d, distance(nleaf, leaf) + 1);
            // A word of a key of the same object ("data.sources[].name") is nearer than the same word elsewhere.
            if (!nleaf.empty() && k.path.compare(0, dot, nparent) == 0 && dot == nparent.size() &&
                has_word(leaf, nleaf)) {
                d = 0;
            }
        }
        if (d < best_d) {
            best_d = d;
            best = k.path;
        }
    }
    return best_d <= limit ? best : "";
}

Json read_config_file(const std::string& path) {
    Json doc = read_json_file(path, "config file");
    if (!doc.is_object()) user_error("config file {}: expected a JSON object at the top level", path);
    return doc;
}

void set_config_value(Json& doc, const std::string& path, const Json& value) {
    const KeySpec* spec = find_spec(path);
    if (!spec) unknown_key(path, "--set: ");
    check_value(*spec, value, path);
    *at_path_create(doc, path) = value;
}

void apply_override(Json& doc, const std::string& assignment) {
    const size_t eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0) {
        user_error("--set \"{}\": expected key.path=value, e.g. --set optimizer.learning_rate=3e-4", assignment);
    }
    // "tokenizer" is short for "tokenizer.identifier", as in a config file ("tokenizer": "gpt2").
    const std::string path =
        assignment.substr(0, eq) == "tokenizer" ? "tokenizer.identifier" : assignment.substr(0, eq);
    const std::string text = assignment.substr(eq + 1);
    const KeySpec* spec = find_spec(path);
    if (!spec) unknown_key(path, "--set: ");
    set_config_value(doc, path, parse_typed(*spec, path, text));
}

std::string config_keys_markdown() {
    std::string out = "| key | type | default | meaning |\n|---|---|---|---|\n";
    for (const auto& k : schema()) {
        std::string type = type_name(k.type);
        if (!k.choices.empty()) {
            type = "";
            for (size_t i = 0; i < k.choices.size(); ++i) type += (i ? " \\| " : "") + k.choices[i];
        }
        if (k.nullable) type += " or null";
        std::string def = k.default_value.is_null() ? (k.nullable ? "null" : "required") : k.default_value.dump();
        out += fmt::format("| `{}` | {} | {} | {} |\n", k.path, type, def, k.doc);
    }
    return out;
}

}  // namespace trainer
