// trainer: the command line. Training is the default action; subcommands launch ranks, prepare data, export
// weights, plan configurations, benchmark kernels, list config keys and measure the CPU's FMA peak.
//
//   trainer --config configs/cpu_bench.json --set optimizer.learning_rate=3e-4 --data tokens.npy
//   trainer prepare-data --tokenizer bytes a.txt b.txt -o tokens.bin   (or gpt2, cl100k, dolma2)
//   trainer tokenize --tokenizer gpt2 a.txt | trainer detokenize --tokenizer gpt2
//   trainer export --checkpoint runs/x/step100 -o model.safetensors
//   trainer logits --config C --init-from hf_dir --data tokens.bin --instances 4 -o logits.npy
//   trainer plan --config configs/olmo_7b.json --nproc-per-node 8 --device cuda --device-memory 80
//
// Every user error ends as one `error: ...` line on stderr and a non-zero exit (1; 2 for bad flags).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>

#include "apps/cli.h"
#include "base/common.h"
#include "base/config.h"
#include "base/files.h"
#include "base/olmo_yaml.h"
#include "build_commit.h"  // generated at build time: TRAINER_COMMIT
#include "core/data/bpe.h"
#include "core/data/data.h"
#include "core/data/tokenizer.h"
#include "core/generate.h"
#include "core/logits.h"
#include "core/plan/auto.h"
#include "core/plan/bench_comm.h"
#include "core/plan/bench_kernels.h"
#include "core/plan/plan.h"
#include "core/train.h"
#include "core/weights/checkpoint.h"
#include "kernels/cpu/machine.h"
#include "parallel/comm/communicator.h"
#include "parallel/launch/launcher.h"

namespace {

using trainer::Json;
using trainer::cli::add_detokenize;
using trainer::cli::add_prepare_data;
using trainer::cli::add_tokenize;
using trainer::cli::add_tokenizer_dir;
using trainer::cli::flag_choice;
using trainer::cli::kNonNegativeInt;
using trainer::cli::kPositive;
using trainer::cli::Run;

// "5GB", "100MB", "2KB" (powers of 1000, as transformers reads max_shard_size), "64MiB", "4KiB" (powers of 1024)
// or a byte count.
int64_t parse_size(const std::string& text, const std::string& what) {
    size_t used = 0;
    double v = -1;
    try {
        v = std::stod(text, &used);
    } catch (const std::exception&) {
    }
    const std::string unit = text.substr(std::min(used, text.size()));
    const double scale = unit.empty() || unit == "B" ? 1
                         : unit == "KB"              ? 1e3
                         : unit == "MB"              ? 1e6
                         : unit == "GB"              ? 1e9
                         : unit == "KiB"             ? 1024.0
                         : unit == "MiB"             ? 1024.0 * 1024.0
                         : unit == "GiB"             ? 1024.0 * 1024.0 * 1024.0
                                                     : -1;
    if (used == 0 || v <= 0 || scale < 0) {
        trainer::user_error("{}: \"{}\"; expected a positive size such as 5GB, 200MB, 64MiB or 1000000", what, text);
    }
    return static_cast<int64_t>(v * scale);
}

// A named CLI shortcut for a config key: its value is typed and checked by the schema, and errors name
// the flag.
void set_from_flag(Json& doc, const std::string& flag, const std::string& key, const std::string& text) {
    try {
        trainer::apply_override(doc, key + "=" + text);
    } catch (const trainer::UserError& e) {
        throw trainer::UserError(flag + ": " + e.what());
    }
}

// The training flags: the config, its overrides and the named shortcuts, taken by training and by every
// subcommand that runs a configuration (bench-kernels, bench-comm, logits, show-config, plan).
struct TrainingFlags {
    // A named CLI shortcut for a config key: its value is typed and checked by the schema. A key with a fixed set
    // of values lists them in its help from the schema, followed by `help` (so a new value is never left out).
    struct Shortcut {
        const char* flag;
        const char* key;
        const char* help;
        std::string value;
    };
    std::string config_path;
    bool strict = false;
    std::vector<std::string> sets, data_paths;
    std::vector<Shortcut> shortcuts = {
        {"--device", "device", "", ""},
        {"--save-folder", "save_folder", "checkpoint folder", ""},
        {"--load-path", "load_path", "resume from a checkpoint folder or \"latest\"", ""},
        {"--init-from", "init_from", "initial weights, safetensors with Hugging Face names", ""},
        {"--metrics-file", "metrics_file", "JSON lines of per-step metrics", ""},
        {"--tensorboard-dir", "tensorboard_dir", "TensorBoard event files of the step metrics", ""},
        {"--trace-file", "trace_file", "Chrome trace of every step (Perfetto); one file per rank", ""},
        {"--seed", "seed", "run seed", ""},
        {"--max-duration", "max_duration", "steps, tokens (2e9T) or epochs (1ep)", ""},
        {"--threads", "threads", "compute threads, 0 = one per core", ""},
        {"--strategy", "distributed_strategy", "auto lets the plan choose", ""},
        {"--sharding-strategy", "fsdp.sharding_strategy", "", ""},
        {"--wrapping-strategy", "fsdp.wrapping_strategy", "FSDP's wrap policy, OLMo's names", ""},
        {"--precision", "precision", "", ""},
    };

    void add_to(CLI::App& app) {
        app.add_option("--config", config_path,
                       "JSON config file (OLMo key names; configs/README.md lists every key), or one of OLMo's own "
                       "YAML configs (.yaml, .yml)");
        app.add_flag("--strict", strict,
                     "with a YAML config: OLMo keys that have no effect here are errors, not a warning");
        app.add_option("--set", sets, "override any config key: --set key.path=value (repeatable)");
        app.add_option("--data", data_paths, "token files (config: data.paths)");
        for (auto& s : shortcuts) {
            const std::vector<std::string> choices = trainer::config_key_choices(s.key);
            std::string help = s.help;
            if (!choices.empty()) help = fmt::format("{}{}{}", fmt::join(choices, " | "), *s.help ? "; " : "", s.help);
            app.add_option(s.flag, s.value, fmt::format("{} (config: {})", help, s.key));
        }
    }

    // Schema defaults <- config file <- --set overrides <- named shortcuts, validated.
    trainer::TrainConfig load() const {
        if (config_path.empty())
            trainer::user_error("--config: required (a JSON config file, see configs/, or an OLMo YAML config)");
        // An OLMo YAML config's ${...} are resolved after the overrides, as OmegaConf resolves them.
        const bool yaml = trainer::is_yaml_config_path(config_path);
        Json doc = yaml ? trainer::read_yaml_config(config_path) : trainer::read_config_file(config_path);
        for (const auto& s : sets) trainer::apply_override(doc, s);
        if (!data_paths.empty()) trainer::set_config_value(doc, "data.paths", Json(data_paths));
        for (const auto& s : shortcuts) {
            if (!s.value.empty()) set_from_flag(doc, s.flag, s.key, s.value);
        }
        if (yaml) trainer::finish_olmo_config(doc, config_path, strict);
        try {
            return trainer::validate_config(doc);
        } catch (const trainer::UserError& e) {
            throw trainer::UserError(std::string(e.what()) + " [in " + config_path + "]");
        }
    }
};

// Every tokenizer, or none (generate).
std::vector<std::string> tokenizer_names_or_none() {
    std::vector<std::string> names = trainer::choice_names<trainer::Tokenizer>();
    names.push_back("none");
    return names;
}

Run add_export(CLI::App& app) {
    auto* exp = app.add_subcommand(
        "export", "write a checkpoint's weights with Hugging Face names: a .safetensors file or a model directory");
    struct Options {
        std::string checkpoint, output, max_shard = "5GB";
        trainer::HfExportOptions hf;
    };
    auto o = std::make_shared<Options>();
    o->hf.tokenizer_dir = trainer::default_tokenizer_dir();
    exp->add_option("--checkpoint", o->checkpoint, "checkpoint folder (save_folder/step<N>)")->required();
    exp->add_option("-o,--output", o->output,
                    "FILE.safetensors, or a new directory transformers loads (config.json, generation_config.json, "
                    "weights, sharded above --max-shard-size)")
        ->required();
    exp->add_option("--max-shard-size", o->max_shard, "largest weight file of a directory: bytes, or with KB MB GB");
    exp->add_option("--tokenizer", o->hf.tokenizer, "also write this tokenizer's Hugging Face files (gpt2)");
    exp->add_option("--tokenizer-dir", o->hf.tokenizer_dir, "folder of the tokenizer files");
    exp->add_flag("--adapter", o->hf.lora_adapter,
                  "a LoRA fine-tune's checkpoint: write its adapters as a PEFT adapter directory (adapter_config.json, "
                  "adapter_model.safetensors)");
    exp->add_flag("--merge-lora", o->hf.merge_lora,
                  "a LoRA fine-tune's checkpoint: write the model with its adapters merged into the base's weights");
    return [o] {
        o->hf.max_shard_bytes = parse_size(o->max_shard, "export --max-shard-size");
        const std::string arch = trainer::export_checkpoint(o->checkpoint, o->output, o->hf);
        std::printf("%s: weights of %s (%s names)\n", o->output.c_str(), o->checkpoint.c_str(), arch.c_str());
        return 0;
    };
}

// `trainer launch [options] -- ARGS`: ARGS are the ranks' own arguments, split off before parsing (argc ends
// before "--"). Without "--", an argument that is not the launcher's own is refused here (CLI11 would list it
// back to front as "not expected"): returns 2 after saying so, else 0.
int split_launch_args(int& argc, char** argv, CLI::App* launch_cmd, std::vector<std::string>& args) {
    if (argc < 2 || std::string(argv[1]) != "launch") return 0;
    for (int i = 2; i < argc; ++i) {
        if (std::string(argv[i]) == "--") {
            args.assign(argv + i + 1, argv + argc);
            argc = i;
            return 0;
        }
    }
    for (int i = 2; i < argc; ++i) {
        const std::string a = argv[i];
        const bool own =
            launch_cmd->get_option_no_throw(a.substr(0, a.find('='))) != nullptr || a == "-h" || a == "--help";
        const bool value_of_own = i > 2 && launch_cmd->get_option_no_throw(argv[i - 1]) != nullptr &&
                                  std::string(argv[i - 1]).find('=') == std::string::npos;
        if (!own && !value_of_own) {
            std::fprintf(stderr,
                         "error: launch: \"%s\" is not an option of trainer launch; the ranks' arguments follow "
                         "\"--\": trainer launch --nproc-per-node N -- --config FILE ...\n",
                         a.c_str());
            return 2;
        }
    }
    return 0;
}

// `trainer launch --max-restarts N`: the ranks must train (a subcommand is not restarted), into a save folder
// they checkpoint every save_interval steps, which a restarted round resumes from (try_load_latest_save).
void check_restartable(const trainer::LaunchOptions& o, const CLI::App& root) {
    const std::string what = fmt::format("launch --max-restarts {}", o.max_restarts);
    bool subcommand = false;
    try {
        subcommand = !o.args.empty() && root.get_subcommand(o.args[0]) != nullptr;
    } catch (const CLI::OptionNotFound&) {
    }
    if (subcommand) {
        trainer::user_error("{}: restarts training runs; the ranks run `trainer {}`, which is not one", what,
                            o.args[0]);
    }
    CLI::App app{"the ranks' arguments"};
    TrainingFlags flags;
    flags.add_to(app);
    std::vector<std::string> words = {"trainer"};
    words.insert(words.end(), o.args.begin(), o.args.end());
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    try {
        app.parse(static_cast<int>(argv.size()), argv.data());
    } catch (const CLI::ParseError& e) {
        trainer::user_error("{}: the ranks' arguments: {}", what, e.what());
    }
    const trainer::TrainConfig c = flags.load();
    if (!c.save_folder) {
        trainer::user_error(
            "{}: the run has no save_folder, so a restart could only train again from step 0; set save_folder "
            "(--save-folder) and save_interval",
            what);
    }
    if (c.save_interval <= 0) {
        trainer::user_error(
            "{}: save_interval is {}, so the run saves only at its end and a restart would train again from step 0 "
            "(or an older checkpoint in {}); set save_interval to the steps a failure may cost",
            what, c.save_interval, *c.save_folder);
    }
}

Run add_launch(CLI::App& app, std::shared_ptr<trainer::LaunchOptions> o) {
    auto* cmd = app.add_subcommand(
        "launch", "start the local ranks of one node (torchrun-like): trainer launch --nproc-per-node N -- ARGS");
    cmd->add_option("--nproc-per-node", o->nproc_per_node, "ranks on this node");
    cmd->add_option("--nnodes", o->nnodes, "nodes in the job");
    cmd->add_option("--node-rank", o->node_rank, "this node's index, 0..nnodes-1");
    cmd->add_option("--master-addr", o->master_addr, "address of rank 0's node (rendezvous store)");
    cmd->add_option("--master-port", o->master_port, "port of the rendezvous store");
    cmd->add_option("--max-restarts", o->max_restarts,
                    "after a rank fails, start every rank of every node again, resuming from the newest complete "
                    "checkpoint, up to this many times (torchrun's flag; needs save_folder and save_interval)");
    cmd->add_option("--join-timeout", o->join_timeout_seconds,
                    "with --max-restarts: seconds a round waits for every node's launcher (default 600)");
    return [o, &app] {
        if (o->args.empty()) {
            trainer::user_error("launch: no trainer arguments; usage: trainer launch --nproc-per-node N -- ARGS");
        }
        if (o->max_restarts > 0) {
            check_restartable(*o, app);
            o->restart_args = {"--set", "try_load_latest_save=true"};
        }
        return trainer::launch(*o);
    };
}

Run add_config_keys(CLI::App& app) {
    app.add_subcommand("config-keys", "print every config key as a markdown table");
    return [] {
        std::fputs(trainer::config_keys_markdown().c_str(), stdout);
        return 0;
    };
}

Run add_peak_flops(CLI::App& app) {
    auto* peak = app.add_subcommand("peak-flops", "measure this CPU's fp32 FMA throughput (the MFU denominator)");
    struct Options {
        int threads = 0;
        double seconds = 3.0;
    };
    auto o = std::make_shared<Options>();
    peak->add_option("--threads", o->threads, "threads (0: one per core)");
    peak->add_option("--seconds", o->seconds, "measurement time");
    return [o] {
        const int n = trainer::configure_threads(o->threads);
        const double measured = trainer::measure_fma_peak(n, o->seconds);
        const auto detected = trainer::cpu_peak_flops(n);
        std::printf(
            "{\"threads\": %d, \"measured_fma_flops\": %.4g, \"detected_flops\": %.4g, \"detected_how\": \"%s\"}\n", n,
            measured, detected.flops, detected.how.c_str());
        return 0;
    };
}

Run add_bench_kernels(CLI::App& app, const TrainingFlags& flags) {
    auto* bench = app.add_subcommand(
        "bench-kernels",
        "time every kernel of one training step at the config's shapes on its device and print each against "
        "the device roofline (takes the training flags: --config, --set, --device, --precision)");
    bench->fallthrough();  // the training options (--config, --set, ...) belong to the main command
    struct Options {
        int reps = 20;
        std::string calibration_out;
    };
    auto o = std::make_shared<Options>();
    bench->add_option("--reps", o->reps, "timed calls of each kernel (after two warm-up calls)")->check(kPositive);
    bench->add_option("--calibration-out", o->calibration_out,
                      "also write each op's measured time with its FLOPs and bytes here (for trainer plan)");
    return [o, &flags] { return trainer::run_kernel_bench(flags.load(), o->reps, o->calibration_out); };
}

Run add_bench_comm(CLI::App& app, const TrainingFlags& flags) {
    auto* cmd = app.add_subcommand(
        "bench-comm",
        "measure the links of the launched ranks (trainer launch --nproc-per-node N -- bench-comm ..., mpirun, "
        "srun): all-reduce, reduce-scatter and all-gather times by size, and a bandwidth and latency fitted to "
        "each for trainer plan --comm-calibration (takes the training flags: --config, --device, --set)");
    cmd->fallthrough();
    struct Options {
        trainer::CommBenchOptions comm;
        std::string max_size;
    };
    auto o = std::make_shared<Options>();
    cmd->add_option("--max-size", o->max_size,
                    "the largest buffer, e.g. 64MiB (default: 256MiB on CUDA, 64MiB on the CPU); sizes from 4KiB up "
                    "by 4x");
    cmd->add_option("--seconds-per-size", o->comm.seconds_per_size,
                    "measuring time of each collective and size (three trials)")
        ->check(kPositive);
    cmd->add_option("--calibration-out", o->comm.calibration_out,
                    "write the fitted links here (JSON; trainer plan --comm-calibration)");
    return [o, &flags] {
        const trainer::TrainConfig config = flags.load();
        if (!o->max_size.empty()) o->comm.max_bytes = parse_size(o->max_size, "bench-comm --max-size");
        return trainer::run_comm_bench(config, o->comm);
    };
}

Run add_logits(CLI::App& app, const TrainingFlags& flags) {
    auto* cmd = app.add_subcommand(
        "logits",
        "write the model's logits on the first instances of the data as a float32 .npy (instances, L-1, "
        "embedding_size), from --load-path's checkpoint, --init-from's weights or the initialisation (takes the "
        "training flags; scripts/check_hf_export.py compares them with transformers')");
    cmd->fallthrough();
    struct Options {
        long instances = 1;
        std::string output;
    };
    auto o = std::make_shared<Options>();
    cmd->add_option("--instances", o->instances, "instances of max_sequence_length tokens")->check(kPositive);
    cmd->add_option("-o,--output", o->output, "the .npy file to write")->required();
    return [o, &flags] { return trainer::run_logits(flags.load(), o->instances, o->output); };
}

Run add_generate(CLI::App& app, const TrainingFlags& flags) {
    auto* cmd = app.add_subcommand(
        "generate",
        "continue prompts with the model: --load-path's checkpoint, --init-from's weights (a Hugging Face "
        "directory or safetensors) or the initialisation, greedy or sampled (the draws seeded by --seed), with a KV "
        "cache; the prompts run as one batch (takes the training flags: --config, --device, ...)");
    cmd->fallthrough();
    auto o = std::make_shared<trainer::GenerateOptions>();
    o->tokenizer_dir = trainer::default_tokenizer_dir();
    cmd->add_option("--prompt", o->prompts, "a prompt's text (repeat for a batch; \"\" starts after an EOS)");
    cmd->add_option("--prompt-file", o->prompt_files, "a file whose text is one prompt (repeatable)");
    cmd->add_option("--prompt-ids", o->prompt_ids, "a prompt as token ids, \"1, 2, 3\" (repeatable)");
    cmd->add_option_function<std::string>(
           "--tokenizer",
           [o](const std::string& name) {
               o->tokenizer = name == "none" ? std::nullopt : std::optional(flag_choice<trainer::Tokenizer>(name));
               o->tokenizer_given = true;
           },
           "the tokenizer the data was made with: bytes | gpt2 | cl100k | dolma2 (default: the config's "
           "tokenizer.identifier); none: ids in "
           "(--prompt-ids) and out, for a vocabulary none of them makes")
        ->check(CLI::IsMember(tokenizer_names_or_none()));
    add_tokenizer_dir(cmd, o->tokenizer_dir);
    cmd->add_option("--max-new-tokens", o->max_new_tokens, "tokens to add to each prompt at most (default 64)");
    cmd->add_option("--temperature", o->sampling.temperature, "0: greedy (default); above 0: sample at it");
    cmd->add_option("--top-k", o->sampling.top_k, "sample among the k most likely tokens (0: all)");
    cmd->add_option("--top-p", o->sampling.top_p, "then among the fewest whose probabilities reach p (1: all)");
    cmd->add_flag("!--no-stop-at-eos", o->stop_at_eos, "go on past an EOS token");
    cmd->add_flag("!--no-kv-cache", o->kv_cache,
                  "recompute each sequence's whole prefix for every new token (the baseline the cache is timed "
                  "against)");
    cmd->add_flag("--json", o->json, "one JSON object a prompt (ids and text) and a summary line");
    return [o, &flags] { return trainer::run_generate(flags.load(), *o); };
}

Run add_show_config(CLI::App& app, const TrainingFlags& flags) {
    app.add_subcommand("show-config",
                       "print the configuration a run would use (file, --set overrides and flags applied, defaults "
                       "filled in, validated) as JSON with the trainer's key names (takes the training flags)")
        ->fallthrough();
    return [&flags] {
        std::printf("%s\n", trainer::config_json(flags.load()).dump(2).c_str());
        return 0;
    };
}

Run add_plan(CLI::App& app, const TrainingFlags& flags) {
    auto* plan = app.add_subcommand(
        "plan",
        "dry-run one step of every sensible configuration (strategy, sharding, wrap, grad_sync, activation "
        "checkpointing, CPU offload) for this config and world: each one's peak memory per rank by category, "
        "predicted step time, tokens/s and MFU, whether it fits, and a recommendation (takes the training "
        "flags: --config, --set, --device, ...; --trace-file draws the predicted step)");
    plan->fallthrough();
    auto o = std::make_shared<trainer::PlanOptions>();
    plan->add_option("--nnodes", o->nnodes, "nodes")->check(kPositive);
    plan->add_option("--nproc-per-node", o->nproc_per_node, "ranks per node")->check(kPositive);
    plan->add_option("--device-memory", o->device_memory_gib, "GiB of memory per device: marks what fits")
        ->check(kPositive);
    plan->add_option("--host-memory", o->host_memory_gib,
                     "GiB of host memory per node: marks the CPU offload rows whose host state does not fit")
        ->check(kPositive);
    plan->add_flag("--json", o->json, "one JSON object per configuration instead of the table");
    plan->add_flag("--all", o->all,
                   "every configuration planned, with its memory by category (default: one screen with the "
                   "recommendation, the config as given and the two fastest of each strategy)");
    plan->add_option("--hardware", o->hardware,
                     "the device and links the step times are for: a name of configs/hardware (h100-sxm, h200, "
                     "a100-40gb, a100-80gb, a100-40gb-pcie, cpu) or the path of a hardware file (default: cpu on the "
                     "CPU; on CUDA this node's GPU's entry, else h100-sxm)");
    plan->add_option("--calibration", o->calibration,
                     "op times measured by trainer bench-kernels --calibration-out (required for cpu)");
    plan->add_option("--comm-calibration", o->comm_calibration,
                     "links measured by trainer bench-comm --calibration-out, instead of the hardware entry's");
    return [o, &flags] { return trainer::run_plan(flags.load(), *o); };
}

int run_main(int argc, char** argv) {
    CLI::App app{
        "trainer: decoder-only language model trainer (OLMo / GPT-2 shapes) with pluggable data-parallel "
        "strategies. Training is the default action."};
    app.set_help_all_flag("--help-all", "help for every subcommand");
    bool version = false;
    app.add_flag("--version", version,
                 "print the version, the commit and build type, and the libraries' versions (built with, found), then "
                 "exit");
    TrainingFlags flags;
    flags.add_to(app);
    auto launch_opts = std::make_shared<trainer::LaunchOptions>();
    // Every subcommand, and what it runs; none given: training.
    const std::vector<std::pair<const char*, Run>> commands = {{"prepare-data", add_prepare_data(app)},
                                                               {"tokenize", add_tokenize(app)},
                                                               {"detokenize", add_detokenize(app)},
                                                               {"export", add_export(app)},
                                                               {"launch", add_launch(app, launch_opts)},
                                                               {"config-keys", add_config_keys(app)},
                                                               {"peak-flops", add_peak_flops(app)},
                                                               {"bench-kernels", add_bench_kernels(app, flags)},
                                                               {"bench-comm", add_bench_comm(app, flags)},
                                                               {"logits", add_logits(app, flags)},
                                                               {"generate", add_generate(app, flags)},
                                                               {"show-config", add_show_config(app, flags)},
                                                               {"plan", add_plan(app, flags)}};
    if (const int refused = split_launch_args(argc, argv, app.get_subcommand("launch"), launch_opts->args))
        return refused;
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        std::fprintf(stderr, "error: %s (see trainer --help)\n", e.what());
        return 2;
    }
    if (version) {
        std::printf("trainer %s\ncommit: %s\nbuild: %s (C++17, %s), CUDA parts %s\n", TRAINER_VERSION, TRAINER_COMMIT,
                    TRAINER_BUILD_TYPE[0] != '\0' ? TRAINER_BUILD_TYPE : "no build type",
#if defined(__clang__)
                    "clang " __clang_version__,
#else
                    "g++ " __VERSION__,
#endif
#if defined(TRAINER_SIMT_DEVICE)
                    "emulated on the CPU (a test build)"
#elif defined(TRAINER_HAVE_CUDA)
                    "built"
#else
                    "not built"
#endif
        );
        for (const std::string& line : trainer::library_versions()) std::printf("%s\n", line.c_str());
        std::printf("%s\n", trainer::nccl_library_version().c_str());
        return 0;
    }
    for (const auto& [name, run] : commands) {
        if (app.got_subcommand(name)) return run();
    }
    return trainer::run_training(trainer::resolve_training_config(flags.load()));
}

}  // namespace

int main(int argc, char** argv) {
    // A write to a peer that died (a Gloo socket, a closed pipe) must fail with EPIPE and end the run with
    // an error naming the collective, not kill the process silently with SIGPIPE.
    std::signal(SIGPIPE, SIG_IGN);
    try {
        return run_main(argc, argv);
    } catch (const trainer::UserError& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    } catch (const std::bad_alloc&) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: out of memory\n");
        return 1;
    } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return 70;
    }
}
