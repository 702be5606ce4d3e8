// The config's choices: a string key with a fixed set of values, parsed once into an enum, spelled as the
// JSON spells it in logs and messages. Below the config itself, so that kernels/ takes these values without
// the training config.
#pragma once

#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace trainer {

// ---- choices: each enum's values in the order of its spellings in Choices<E>::kNames ----
enum class Device { kAuto, kCpu, kCuda };
enum class Precision { kFp32, kAmpBf16, kAmpFp8 };
// Mixed precision on bf16: amp_bf16, and amp_fp8 (amp_bf16 with the blocks' Linear layers on FP8 operands).
inline bool bf16_mixed(Precision p) { return p == Precision::kAmpBf16 || p == Precision::kAmpFp8; }
enum class AttentionKernel { kAuto, kNative, kCudnn, kFlash };
enum class DistributedBackend { kAuto, kGloo, kNccl };
enum class DistributedStrategy { kSingle, kDdp, kFsdp, kAuto };  // kAuto: the plan chooses (core/plan/auto.h)
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard };
enum class WrappingStrategy {
    kNull,  // JSON null: the whole model is one FSDP unit
    kByBlock,
    kByBlockAndSize,
    kByBlockGroup,
    kByBlockGroupAndSize,
    kSizeBased,
    kOneInTwo,
    kOneInThree,
    kOneInFour,
    kOneInFive
};
enum class GradSyncMode { kBatch, kMicroBatch };
enum class FsdpPrecision { kFp32, kMixed, kPure };
enum class ActivationType { kSwiglu, kGelu, kGeluTanh };
enum class LayerNormType { kDefault, kLowPrecision, kRms };
enum class SchedulerName {
    kConstant,
    kLinearWithWarmup,
    kCosineWithWarmup,
    kInverseSqrtWithWarmup,
    kMaxScheduler,
    kCosineLinearEnvelope,
    kConstantWithWarmup,
    kWsd
};
enum class DecayShape { kLinear, kOneMinusSqrt };
enum class InitFn { kNormal, kMitchell };
enum class TokenDtype { kUint16, kUint32 };                // a raw token file's ids (OLMo's data.memmap_dtype)
enum class Tokenizer { kBytes, kGpt2, kCl100k, kDolma2 };  // the tokenizers the trainer has (core/data)
// An evaluator: a validation set's loss (lm), or a multiple-choice task scored by its continuations' log-likelihoods
// (downstream, core/run/downstream.h).
enum class EvaluatorType { kLm, kDownstream };
enum class ActivationCheckpointing {
    kNull,         // every block keeps all it needs for its backward
    kWholeLayer,   // every block keeps its input only and recomputes its forward in its backward
    kOneInTwo,     // whole_layer for blocks with layer % 2 == 0
    kOneInThree,   // ... % 3 == 0
    kOneInFour,    // ... % 4 == 0
    kOneInEight,   // ... % 8 == 0
    kTwoInThree,   // whole_layer for blocks with layer % 3 != 0
    kThreeInFour,  // ... % 4 != 0
    kFineGrained   // every block keeps its GEMM and attention outputs, recomputes norms and activations (only
                   // the activations where the norms' backward reads their output: it keeps those)
};

// The config spellings of an enum's values (OLMo's and PyTorch's names), indexed by the value.
template <typename E>
struct Choices;
template <>
struct Choices<Device> {
    static constexpr const char* kNames[] = {"auto", "cpu", "cuda"};
};
template <>
struct Choices<Precision> {
    static constexpr const char* kNames[] = {"fp32", "amp_bf16", "amp_fp8"};
};
template <>
struct Choices<AttentionKernel> {
    static constexpr const char* kNames[] = {"auto", "native", "cudnn", "flash"};
};
template <>
struct Choices<DistributedBackend> {
    static constexpr const char* kNames[] = {"auto", "gloo", "nccl"};
};
template <>
struct Choices<DistributedStrategy> {
    static constexpr const char* kNames[] = {"single", "ddp", "fsdp", "auto"};
};
template <>
struct Choices<ShardingStrategy> {
    static constexpr const char* kNames[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"};
};
template <>
struct Choices<WrappingStrategy> {
    static constexpr const char* kNames[] = {
        "null",       "by_block",   "by_block_and_size", "by_block_group", "by_block_group_and_size",
        "size_based", "one_in_two", "one_in_three",      "one_in_four",    "one_in_five"};
};
template <>
struct Choices<GradSyncMode> {
    static constexpr const char* kNames[] = {"batch", "micro_batch"};
};
template <>
struct Choices<FsdpPrecision> {
    static constexpr const char* kNames[] = {"fp32", "mixed", "pure"};
};
template <>
struct Choices<ActivationType> {
    static constexpr const char* kNames[] = {"swiglu", "gelu", "gelu_tanh"};
};
template <>
struct Choices<LayerNormType> {
    static constexpr const char* kNames[] = {"default", "low_precision", "rms"};
};
template <>
struct Choices<SchedulerName> {
    static constexpr const char* kNames[] = {
        "constant",      "linear_with_warmup",     "cosine_with_warmup",   "inverse_sqrt_with_warmup",
        "max_scheduler", "cosine_linear_envelope", "constant_with_warmup", "wsd"};
};
template <>
struct Choices<DecayShape> {
    static constexpr const char* kNames[] = {"linear", "1-sqrt"};
};
template <>
struct Choices<ActivationCheckpointing> {
    static constexpr const char* kNames[] = {"null",         "whole_layer",   "one_in_two",
                                             "one_in_three", "one_in_four",   "one_in_eight",
                                             "two_in_three", "three_in_four", "fine_grained"};
};
template <>
struct Choices<InitFn> {
    static constexpr const char* kNames[] = {"normal", "mitchell"};
};
template <>
struct Choices<TokenDtype> {
    static constexpr const char* kNames[] = {"uint16", "uint32"};
};
template <>
struct Choices<EvaluatorType> {
    static constexpr const char* kNames[] = {"lm", "downstream"};
};
template <>
struct Choices<Tokenizer> {
    static constexpr const char* kNames[] = {"bytes", "gpt2", "cl100k", "dolma2"};
};

// The config spelling of a choice ("FULL_SHARD", "amp_bf16"), for logs and error messages.
template <typename E>
const char* choice_name(E value) {
    return Choices<E>::kNames[static_cast<int>(value)];
}
// Every spelling of an enum, in order (the schema's allowed values).
template <typename E>
std::vector<std::string> choice_names() {
    return std::vector<std::string>(std::begin(Choices<E>::kNames), std::end(Choices<E>::kNames));
}
// The value spelled `name`; nullopt when no value is.
template <typename E>
std::optional<E> parse_choice(const std::string& name) {
    const auto& names = Choices<E>::kNames;
    for (size_t i = 0; i < std::size(names); ++i) {
        if (name == names[i]) return static_cast<E>(i);
    }
    return std::nullopt;
}

}  // namespace trainer
