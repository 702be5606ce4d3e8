// `trainer generate` (see generate.h).
#include "core/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>

#include "base/common.h"
#include "base/files.h"
#include "base/layout.h"
#include "core/data/data.h"
#include "core/data/tokenizer.h"
#include "core/model/init.h"
#include "core/model/model.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/setup.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

namespace {

// A uniform double in [0, 1) for (seed, sequence, step): splitmix64's first draw from a state that mixes the three,
// so the draws of every prompt and step are independent of the batch they run in.
double uniform01(uint64_t seed, int sequence, long step) {
    SplitMix64 rng(seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(sequence) +
                   0xd1b54a32d192ed03ull * (static_cast<uint64_t>(step) + 1));
    return static_cast<double>(rng.next() >> 11) * 0x1.0p-53;
}

}  // namespace

int32_t sample_token(const float* logits, int vocab, const SamplingOptions& o, int sequence, long step) {
    TRAINER_CHECK(vocab >= 1, "sampling from {} ids", vocab);
    if (o.temperature <= 0.0) {
        return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);  // the first of equals
    }
    // The candidates, most likely first (equal logits: the lower id first), cut to top_k.
    std::vector<int32_t> ids(static_cast<size_t>(vocab));
    std::iota(ids.begin(), ids.end(), 0);
    const auto before = [&](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    const size_t k = o.top_k > 0 ? std::min<size_t>(static_cast<size_t>(o.top_k), ids.size()) : ids.size();
    std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), before);
    ids.resize(k);
    std::vector<double> p(k);
    const double top = logits[ids[0]];
    double sum = 0.0;
    for (size_t i = 0; i < k; ++i) sum += (p[i] = std::exp((logits[ids[i]] - top) / o.temperature));
    // top-p: the fewest most likely whose probabilities reach p (at least one).
    size_t keep = k;
    if (o.top_p < 1.0) {
        double cumulative = 0.0;
        for (size_t i = 0; i < k; ++i) {
            cumulative += p[i] / sum;
            if (cumulative >= o.top_p) {
                keep = i + 1;
                break;
            }
        }
        sum = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
    }
    const double u = uniform01(o.seed, sequence, step) * sum;
    double cumulative = 0.0;
    for (size_t i = 0; i < keep; ++i) {
        cumulative += p[i];
        if (u < cumulative) return ids[i];
    }
    return ids[keep - 1];
}

GenerationResult generate_tokens(Model& model, const ModelConfig& m, const std::vector<std::vector<int32_t>>& prompts,
                                 int max_new_tokens, const SamplingOptions& sampling, int eos, bool kv_cache) {
    const int B = static_cast<int>(prompts.size());
    TRAINER_CHECK(B >= 1 && max_new_tokens >= 1, "{} prompts, {} new tokens", B, max_new_tokens);
    int length = 0, prompt_rows = 0, all_rows = 0;
    for (int b = 0; b < B; ++b) {
        const int n = static_cast<int>(prompts[b].size());
        TRAINER_CHECK(n >= 1, "prompt {} is empty", b);
        if (static_cast<long>(n) + max_new_tokens > m.max_sequence_length) {
            user_error(
                "generate: prompt {} has {} tokens; with --max-new-tokens {} that is {} positions, above the model's "
                "max_sequence_length {} (shorten the prompt or generate fewer tokens)",
                b + 1, n, max_new_tokens, n + max_new_tokens, m.max_sequence_length);
        }
        length = std::max(length, n + max_new_tokens);
        prompt_rows += n, all_rows += n + max_new_tokens;
    }
    Model::DecodeCache cache = model.make_decode_cache(B, length, kv_cache ? std::max(prompt_rows, B) : all_rows);
    std::vector<std::vector<int32_t>> seq(prompts.begin(), prompts.end());
    GenerationResult result;
    result.tokens.resize(static_cast<size_t>(B));
    std::vector<uint8_t> active(static_cast<size_t>(B), 1);
    std::vector<int32_t> tokens, seqs, positions;
    std::vector<uint8_t> wanted;
    const auto t0 = std::chrono::steady_clock::now();
    for (long step = 0; step < max_new_tokens; ++step) {
        tokens.clear(), seqs.clear(), positions.clear(), wanted.clear();
        for (int b = 0; b < B; ++b) {
            if (!active[static_cast<size_t>(b)]) continue;
            const int n = static_cast<int>(seq[b].size());
            // With the cache: a prompt's tokens on the first step, then the last new token; without: everything.
            const int from = kv_cache && step > 0 ? n - 1 : 0;
            for (int t = from; t < n; ++t) {
                tokens.push_back(seq[b][static_cast<size_t>(t)]), seqs.push_back(b), positions.push_back(t);
                wanted.push_back(t == n - 1);
            }
        }
        model.decode(cache, tokens.data(), seqs.data(), positions.data(), static_cast<int>(tokens.size()),
                     wanted.data(), [&](int row, int, const float* logits) {
                         const int b = seqs[static_cast<size_t>(row)];
                         const int32_t next = sample_token(logits, m.vocab_size, sampling, b, step);
                         seq[b].push_back(next);
                         result.tokens[b].push_back(next);
                         ++result.new_tokens;
                         if (next == eos) active[static_cast<size_t>(b)] = 0;
                     });
        if (std::none_of(active.begin(), active.end(), [](uint8_t a) { return a != 0; })) break;
    }
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
}

int run_generate(const TrainConfig& config, const GenerateOptions& o) {
    const ModelConfig& m = config.model;
    if (o.max_new_tokens < 1) user_error("generate --max-new-tokens: {}; expected at least 1", o.max_new_tokens);
    if (o.max_new_tokens >= m.max_sequence_length) {
        user_error("generate --max-new-tokens: {}; a prompt and its new tokens must fit model.max_sequence_length {}",
                   o.max_new_tokens, m.max_sequence_length);
    }
    if (o.sampling.temperature < 0.0 || !std::isfinite(o.sampling.temperature))
        user_error("generate --temperature: {}; expected 0 (greedy) or more", o.sampling.temperature);
    if (o.sampling.top_k < 0) user_error("generate --top-k: {}; expected 0 (all) or more", o.sampling.top_k);
    if (!(o.sampling.top_p > 0.0 && o.sampling.top_p <= 1.0))
        user_error("generate --top-p: {}; expected above 0 and at most 1", o.sampling.top_p);
    const TokenizerConfig& run = config.tokenizer;
    const std::optional<Tokenizer> tokenizer = o.tokenizer_given ? o.tokenizer : run.known;
    const TextCodec codec(
        tokenizer, o.tokenizer_dir, m.eos_token_id, m.vocab_size,
        o.tokenizer_given ? "generate --tokenizer" : "config tokenizer.identifier",
        o.tokenizer_given ? "--tokenizer none takes its prompts as ids (--prompt-ids)"
                          : fmt::format("config tokenizer.identifier \"{}\" is a tokenizer the trainer does not "
                                        "have; give the prompts as ids (--prompt-ids), or name one with --tokenizer",
                                        run.identifier));
    // The prompts in the order given: texts, files, ids. An empty prompt starts after an EOS, as a document does.
    std::vector<std::vector<int32_t>> prompts;
    for (const std::string& text : o.prompts) prompts.push_back(codec.encode(text, "generate --prompt"));
    for (const std::string& path : o.prompt_files) {
        // A prompt fits the model's context: a file far longer than any that could is refused before it is read
        // (64 bytes a position, more than any tokenizer here packs into one token).
        std::error_code ec;
        const uintmax_t bytes = std::filesystem::file_size(path, ec);
        const uintmax_t most = std::max<uintmax_t>(1u << 20, 64ull * static_cast<uintmax_t>(m.max_sequence_length));
        if (!ec && bytes > most) {
            user_error(
                "generate --prompt-file {}: {} bytes; a prompt must fit model.max_sequence_length {} tokens "
                "(at most {} bytes are read)",
                path, bytes, m.max_sequence_length, most);
        }
        prompts.push_back(codec.encode(read_file(path, "generate --prompt-file"), "generate --prompt-file " + path));
    }
    for (const std::string& ids : o.prompt_ids) {
        prompts.push_back(parse_token_ids(ids, "generate --prompt-ids"));
        for (int32_t id : prompts.back()) {
            if (id >= m.vocab_size)
                user_error("generate --prompt-ids: id {} is not below the model's vocab_size {}", id, m.vocab_size);
        }
    }
    if (prompts.empty())
        user_error("generate: no prompt; give --prompt TEXT, --prompt-file FILE or --prompt-ids \"1, 2, 3\"");
    for (auto& p : prompts) {
        if (p.empty()) p.push_back(static_cast<int32_t>(m.eos_token_id));
    }

    const ComputeTarget target = resolve_compute(config);
    configure_threads(config.threads);
    BackendOptions options = backend_options(config, target, 0);
    options.bf16_operands = false;  // the decode path's buffers are fp32
    auto backend = make_backend(target.device, options);
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    load_inference_params(config, layout, *strategy, "generate");
    Model model(config, layout, backend.get(), strategy.get(), 0);
    SamplingOptions sampling = o.sampling;
    sampling.seed = config.seed;
    const GenerationResult r =
        generate_tokens(model, m, prompts, o.max_new_tokens, sampling, o.stop_at_eos ? m.eos_token_id : -1, o.kv_cache);
    const double rate = r.seconds > 0.0 ? static_cast<double>(r.new_tokens) / r.seconds : 0.0;
    for (size_t b = 0; b < prompts.size(); ++b) {
        std::vector<int32_t> shown = r.tokens[b];
        const bool ended = !shown.empty() && shown.back() == m.eos_token_id && o.stop_at_eos;
        if (ended) shown.pop_back();
        if (o.json) {
            Json line = {{"prompt", b}, {"prompt_ids", prompts[b]}, {"ids", r.tokens[b]}, {"stopped_at_eos", ended}};
            if (codec.has_text()) line["prompt_text"] = codec.decode(prompts[b]), line["text"] = codec.decode(shown);
            std::printf("%s\n", line.dump(-1, ' ', false, Json::error_handler_t::replace).c_str());
        } else {
            // Written by length: a NUL in the text (a byte model may make one) must not end the output.
            const std::string text = codec.decode(prompts[b]) + (codec.has_text() ? "" : "| ") + codec.decode(shown) +
                                     (ended ? "<|endoftext|>" : "") + "\n";
            std::fwrite(text.data(), 1, text.size(), stdout);
            if (b + 1 < prompts.size()) std::printf("----\n");
        }
    }
    if (o.json) {
        const Json summary = {{"event", "summary"},       {"prompts", prompts.size()}, {"new_tokens", r.new_tokens},
                              {"seconds", r.seconds},     {"tokens_per_second", rate}, {"kv_cache", o.kv_cache},
                              {"device", backend->name()}};
        std::printf("%s\n", summary.dump().c_str());
    }
    std::fprintf(stderr, "generated %ld tokens for %zu prompt%s in %.3f s: %.1f tokens/s (%s, %s%s)\n", r.new_tokens,
                 prompts.size(), prompts.size() == 1 ? "" : "s", r.seconds, rate, backend->name().c_str(),
                 o.kv_cache ? "KV cache" : "no KV cache: the prefix recomputed every token",
                 sampling.temperature > 0.0 ? ", sampled" : ", greedy");
    return 0;
}

}  // namespace trainer
