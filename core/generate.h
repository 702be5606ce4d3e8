// `trainer generate`: text from a model. Prompts are encoded with the tokenizer the data was made with, run through
// the model as one batch with a KV cache (Model::decode: each prompt's tokens at once, then one token a sequence a
// step), and continued greedily or by sampling (temperature, top-k, top-p, a seed) until EOS or max_new_tokens.
// Without the cache (`--no-kv-cache`) every new token recomputes its sequence's whole prefix with the same kernels:
// the baseline the cache is measured against.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/config.h"
#include "core/data/text_codec.h"

namespace trainer {

class Model;

struct SamplingOptions {
    double temperature = 0.0;  // 0: greedy (the most likely token, the lowest id among equals)
    int top_k = 0;             // sample among the k most likely tokens; 0: all
    double top_p = 1.0;        // then among the fewest most likely whose probabilities reach p; 1: all
    uint64_t seed = 0;         // draws are a function of (seed, the prompt's index, the step)
};

// The next token from one row of logits over `vocab` ids (the rows past the vocabulary, embedding_size's padding,
// never), for prompt `sequence` at generation step `step`. Deterministic on every platform (its own generator).
int32_t sample_token(const float* logits, int vocab, const SamplingOptions& options, int sequence, long step);

struct GenerationResult {
    std::vector<std::vector<int32_t>> tokens;  // each prompt's new tokens (its EOS included when it stopped there)
    long new_tokens = 0;                       // all of them
    double seconds = 0.0;                      // the prompts' processing and the decoding
};

// Continues each prompt (token ids, none empty) by up to max_new_tokens tokens, stopping a prompt at `eos` when
// eos >= 0. With `kv_cache` false, each step recomputes each sequence's whole prefix. Every prompt plus its new
// tokens must fit the model's max_sequence_length (UserError naming the prompt otherwise).
GenerationResult generate_tokens(Model& model, const ModelConfig& m, const std::vector<std::vector<int32_t>>& prompts,
                                 int max_new_tokens, const SamplingOptions& sampling, int eos, bool kv_cache);

struct GenerateOptions {
    std::vector<std::string> prompts;       // --prompt TEXT (each one prompt)
    std::vector<std::string> prompt_files;  // --prompt-file FILE (each file one prompt)
    std::vector<std::string> prompt_ids;    // --prompt-ids "1,2,3" (token ids)
    bool tokenizer_given = false;           // --tokenizer; else the config's tokenizer.identifier
    std::optional<Tokenizer> tokenizer;     // nullopt: none (ids in and out)
    std::string tokenizer_dir;
    int max_new_tokens = 64;
    SamplingOptions sampling;  // its seed: the config's
    bool stop_at_eos = true;
    bool kv_cache = true;
    bool json = false;  // one JSON object a prompt, then a summary, instead of text
};

// Loads the weights (load_path, init_from or the initialisation, as `trainer logits`), generates, and prints each
// prompt with its continuation and a line of throughput to stderr. Returns the exit code.
int run_generate(const TrainConfig& config, const GenerateOptions& options);

}  // namespace trainer
