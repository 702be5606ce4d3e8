// OLMo's keys mapped onto the trainer's (finish_olmo_config, see olmo_yaml.h): its evaluators, tokenizer,
// checkpoints, model and scheduler spellings, and the keys with no effect here.
#include <glob.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "base/common.h"
#include "base/files.h"
#include "base/olmo_yaml.h"

namespace trainer {

namespace {

// ---- keys with no effect here ----

// An OLMo key the trainer does not have. `ok` says whether a value leaves training as the trainer does
// it (then the key is dropped and listed in the warning); any other value is refused, with `needs`.
struct NoEffect {
    const char* path;                     // dotted; "evaluators[]" for each evaluator
    std::function<bool(const Json&)> ok;  // null: any value
    const char* needs;                    // what the refused values would need
};

bool is_null(const Json& v) { return v.is_null(); }
bool is_false_or_null(const Json& v) { return v.is_null() || (v.is_boolean() && !v.get<bool>()); }
bool is_zero_or_null(const Json& v) { return v.is_null() || (v.is_number() && v.get<double>() == 0.0); }

const std::vector<NoEffect>& no_effect_keys() {
    static const std::vector<NoEffect> keys = {
        {"dry_run", is_false_or_null, "a dry run (trainer plan does one)"},
        {"wandb", nullptr, ""},
        {"compile", nullptr, ""},
        {"speed_monitor", nullptr, ""},
        {"remote_save_folder", is_null, "remote checkpoint storage"},
        {"sharded_checkpointer", nullptr, ""},
        {"new_style_checkpoints", nullptr, ""},
        {"load_path_sharded_checkpointer", nullptr, ""},
        {"restore_dataloader", [](const Json& v) { return v.is_null() || v == true; }, "restarting the data order"},
        {"fast_forward_batches", is_null, "fast-forwarding batches"},
        {"reset_optimizer_state", is_false_or_null, "resetting the optimizer state"},
        {"reset_trainer_state", is_false_or_null, "resetting the trainer state"},
        {"max_grad_norm_ratio", is_null, "ratio-based clipping"},
        {"time_limit", is_null, "a time limit (stop with SIGUSR1 instead)"},
        {"stop_at", is_null, "stop_at (set max_duration)"},
        {"stop_after", is_null, "stop_after (set max_duration)"},
        {"early_stopping_factor", is_null, "early stopping"},
        {"python_profiling", is_false_or_null, ""},
        {"torch_profiling", is_false_or_null, ""},
        {"gen1_gc_interval", nullptr, ""},
        {"fused_loss", nullptr, ""},
        {"hf_datasets_cache_dir", nullptr, ""},
        {"optimizer.metrics_log_interval", nullptr, ""},
        {"optimizer.record_update_metrics", is_false_or_null, "update metrics"},
        {"optimizer.selective_updates", is_false_or_null, "selective updates"},
        {"model.flash_attention", nullptr, ""},
        {"model.alibi", is_false_or_null, "ALiBi"},
        {"model.alibi_bias_max", nullptr, ""},
        {"model.attention_dropout", is_zero_or_null, "dropout"},
        {"model.residual_dropout", is_zero_or_null, "dropout"},
        {"model.embedding_dropout", is_zero_or_null, "dropout"},
        {"model.block_type", [](const Json& v) { return v.is_null() || v == "sequential"; }, "that block type"},
        {"model.init_device", nullptr, ""},
        {"model.clip_qkv", is_null, "clipping q, k and v (clip_qkv)"},
        {"model.scale_logits", is_false_or_null, "scaled logits"},
        {"model.emb_init_std", is_null, "a separate embedding init std"},
        {"model.precision", nullptr, ""},
        {"data.pad_direction", nullptr, ""},
        {"data.num_workers", nullptr, ""},
        {"data.drop_last", [](const Json& v) { return v.is_null() || v == true; }, "keeping a partial last batch"},
        {"data.pin_memory", nullptr, ""},
        {"data.prefetch_factor", nullptr, ""},
        {"data.persistent_workers", nullptr, ""},
        {"data.timeout", nullptr, ""},
        {"data.generate_attention_mask", is_false_or_null, "attention masks"},
        {"data.datasets", is_null, "named training datasets (list data.paths)"},
        {"fsdp.use_orig_params", nullptr, ""},
        {"ddp.find_unused_params", nullptr, ""},
    };
    return keys;
}

// Erases `path` (dotted, no "[]") from `doc`; returns the value it had, or nullopt.
std::optional<Json> take(Json& doc, const std::string& path) {
    Json* v = &doc;
    std::stringstream ss(path);
    std::string part;
    std::vector<std::string> parts;
    while (std::getline(ss, part, '.')) parts.push_back(part);
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
        if (!v->is_object() || !v->contains(parts[i])) return std::nullopt;
        v = &(*v)[parts[i]];
    }
    if (!v->is_object() || !v->contains(parts.back())) return std::nullopt;
    Json out = (*v)[parts.back()];
    v->erase(parts.back());
    return out;
}

// The folder where an OLMo downstream evaluator's examples are looked for, as <label>.jsonl: $TRAINER_DOWNSTREAM_DIR,
// else data/downstream (relative paths from the working directory, as every data path).
std::string downstream_dir() {
    const char* env = std::getenv("TRAINER_DOWNSTREAM_DIR");
    return env != nullptr && *env != '\0' ? std::string(env) : std::string("data/downstream");
}

// OLMo's tokenizer {identifier, truncate_direction}: the identifier is the run's tokenizer (kept as the trainer's
// tokenizer.identifier); truncate_direction has no effect (instances are cut from token files). An identifier the
// trainer has no tokenizer for is said by name now, since text is refused where it must be tokenized.
void finish_tokenizer(Json& doc, const std::string& path, std::vector<std::string>& ignored) {
    if (!doc.contains("tokenizer") || !doc["tokenizer"].is_object()) return;  // validate_config names it
    Json& t = doc["tokenizer"];
    if (t.contains("truncate_direction")) {
        t.erase("truncate_direction");
        ignored.push_back("tokenizer.truncate_direction");
    }
    if (t.contains("identifier") && t["identifier"].is_string() &&
        !tokenizer_from_identifier(t["identifier"].get<std::string>())) {
        std::fprintf(stderr,
                     "warning: %s: tokenizer.identifier %s is a tokenizer the trainer does not have (it has bytes, "
                     "gpt2, cl100k and dolma2): text is refused where it must be tokenized (samples, trainer "
                     "generate's prompts, downstream examples written as text); token ids work\n",
                     path.c_str(), json_text(t["identifier"]).c_str());
    }
}

// Evaluators: each local dataset becomes an evaluator of its own, labelled with its name; datasets that are URLs
// are not run here. A downstream evaluator runs where its examples are found (downstream_dir).
void finish_evaluators(Json& doc, std::vector<std::string>& ignored) {
    const long subset = doc.contains("eval_subset_num_batches") && doc["eval_subset_num_batches"].is_number_integer()
                            ? doc["eval_subset_num_batches"].get<long>()
                            : -1;
    if (doc.contains("eval_subset_num_batches")) {
        doc.erase("eval_subset_num_batches");  // -1 (every batch) is the trainer's default too
    }
    if (doc.contains("evaluators") && doc["evaluators"].is_array()) {
        Json kept = Json::array();
        std::vector<std::string> downstream, url_labels;
        int url_sets = 0;
        for (size_t i = 0; i < doc["evaluators"].size(); ++i) {
            Json ev = doc["evaluators"][i];
            if (!ev.is_object()) {  // not OLMo's either: validate_config names it
                kept.push_back(ev);
                continue;
            }
            const std::string label = ev.contains("label") && ev["label"].is_string()
                                          ? ev["label"].get<std::string>()
                                          : fmt::format("evaluators[{}]", i);
            if (ev.contains("type") && ev["type"] == "downstream") {
                // Its examples: the entry's data.paths, else <label>.jsonl in the downstream folder.
                const bool given = ev.contains("data") && ev["data"].is_object() && ev["data"].contains("paths") &&
                                   ev["data"]["paths"].is_array();
                std::vector<std::string> missing;
                Json paths = Json::array();
                if (given) {
                    for (const auto& p : ev["data"]["paths"]) {
                        if (!p.is_string()) continue;  // validate_config names it
                        if (!is_regular_file_path(p.get<std::string>())) missing.push_back(p);
                        paths.push_back(p);
                    }
                } else {
                    const std::string file = downstream_dir() + "/" + label + ".jsonl";
                    if (!is_regular_file_path(file)) missing.push_back(file);
                    paths.push_back(file);
                }
                if (!missing.empty()) {
                    downstream.push_back(fmt::format("{} ({} not found)", label, fmt::join(missing, ", ")));
                    continue;
                }
                Json one = {{"label", label}, {"type", "downstream"}, {"data", {{"paths", paths}}}};
                if (ev.contains("subset_num_batches")) {
                    one["subset_num_batches"] = ev["subset_num_batches"];
                } else if (subset >= 0) {
                    one["subset_num_batches"] = subset;
                }
                kept.push_back(one);
                continue;
            }
            if (ev.contains("type") && (ev["type"].is_null() || ev["type"] == "lm"))
                ev.erase("type");  // what runs here
            if (ev.contains("data") && ev["data"].is_object()) {
                for (const char* k : {"num_workers", "drop_last", "pin_memory", "prefetch_factor", "persistent_workers",
                                      "timeout", "pad_direction"}) {
                    if (ev["data"].contains(k)) {
                        ev["data"].erase(k);
                        const std::string shown = std::string("evaluators[].data.") + k;
                        if (std::find(ignored.begin(), ignored.end(), shown) == ignored.end()) ignored.push_back(shown);
                    }
                }
            }
            std::vector<std::pair<std::string, Json>> sets;  // (label, paths)
            if (ev.contains("data") && ev["data"].is_object() && ev["data"].contains("datasets") &&
                ev["data"]["datasets"].is_object()) {
                for (auto it = ev["data"]["datasets"].begin(); it != ev["data"]["datasets"].end(); ++it) {
                    sets.emplace_back(it.key(), it.value());
                }
                ev["data"].erase("datasets");
            } else if (ev.contains("data") && ev["data"].is_object() && ev["data"].contains("paths")) {
                sets.emplace_back(label, ev["data"]["paths"]);
            }
            for (auto& [name, paths] : sets) {
                bool url = false;
                for (const auto& p : paths) url = url || (p.is_string() && is_url(p.get<std::string>()));
                if (url) {
                    ++url_sets;
                    if (std::find(url_labels.begin(), url_labels.end(), label) == url_labels.end())
                        url_labels.push_back(label);
                    continue;
                }
                Json one = ev;
                one["label"] = name;
                one["data"]["paths"] = paths;
                if (subset >= 0 && !one.contains("subset_num_batches")) one["subset_num_batches"] = subset;
                kept.push_back(one);
            }
        }
        doc["evaluators"] = kept;
        if (url_sets > 0) {
            ignored.push_back(fmt::format("evaluators {} ({} dataset{} at URLs: download them and list their paths)",
                                          fmt::join(url_labels, ", "), url_sets, url_sets == 1 ? "" : "s"));
        }
        if (!downstream.empty()) {
            ignored.push_back(
                fmt::format("downstream evaluators without their examples: {} (docs/downstream.md: "
                            "scripts/make_downstream_jsonl.py writes them)",
                            fmt::join(downstream, ", ")));
        }
        if (kept.empty() && doc.contains("eval_interval")) {
            doc.erase("eval_interval");
            ignored.push_back("eval_interval (no evaluator left)");
        }
    }
}

// Checkpoints. OLMo writes sharded ones (save_interval, save_num_checkpoints_to_keep), unsharded ones
// (save_interval_unsharded, save_num_unsharded_checkpoints_to_keep) and ephemeral ones (every
// save_interval_ephemeral steps, only the newest kept); save_num_checkpoints_to_keep: 0 turns the sharded
// ones off (OLMo-2's recipe). The trainer writes one kind, sharded and loadable on any world size and
// exportable, like both of OLMo's: it follows the sharded keys, or the unsharded ones where the sharded
// are off. Ephemeral checkpoints change nothing where they fall on those steps anyway.
void finish_checkpoints(Json& doc, const std::string& path, std::vector<std::string>& ignored) {
    const auto number = [&](const char* key) -> std::optional<double> {
        if (!doc.contains(key) || doc[key].is_null()) return std::nullopt;
        if (!doc[key].is_number()) {
            user_error("config file {}: {}: {}; expected a number", path, key, json_text(doc[key]));
        }
        return doc[key].get<double>();
    };
    const auto unsharded_interval = number("save_interval_unsharded");
    const auto unsharded_keep = number("save_num_unsharded_checkpoints_to_keep");
    const auto keep = number("save_num_checkpoints_to_keep");
    if (keep && *keep == 0.0) {
        doc.erase("save_num_checkpoints_to_keep");
        if (unsharded_keep) doc["save_num_checkpoints_to_keep"] = static_cast<long>(*unsharded_keep);
        if (unsharded_interval)
            doc["save_interval"] = static_cast<long>(*unsharded_interval);
        else
            doc.erase("save_interval");
        ignored.push_back("save_num_checkpoints_to_keep: 0 (sharded checkpoints off: the unsharded keys apply)");
    } else {
        if (unsharded_interval) ignored.push_back("save_interval_unsharded");
        if (unsharded_keep) ignored.push_back("save_num_unsharded_checkpoints_to_keep");
    }
    doc.erase("save_interval_unsharded");
    doc.erase("save_num_unsharded_checkpoints_to_keep");
    if (const auto ephemeral = number("save_interval_ephemeral")) {
        const auto every = number("save_interval");
        if (!every || *every <= 0.0 || std::fmod(*ephemeral, *every) != 0.0) {
            user_error(
                "config file {}: save_interval_ephemeral: {}; this trainer has no ephemeral checkpoints (it "
                "accepts the key where those steps are checkpointed anyway: a multiple of save_interval {})",
                path, json_text(doc["save_interval_ephemeral"]), every ? json_text(doc["save_interval"]) : "null");
        }
        ignored.push_back("save_interval_ephemeral");
    }
    doc.erase("save_interval_ephemeral");
}

// QK-norm's affine setting without QK-norm (OLMo-1B's and 7B's configs set it false) changes nothing. OLMo's
// multi_query_attention: true is one key/value head, false all n_heads; with n_kv_heads set too, the two must agree
// (OLMo's effective_n_kv_heads).
void finish_model(Json& doc, const std::string& path, std::vector<std::string>& ignored) {
    if (auto mqa = take(doc, "model.multi_query_attention"); mqa && !mqa->is_null()) {
        if (!mqa->is_boolean()) {
            user_error("config file {}: model.multi_query_attention: {}; expected true, false or null", path,
                       json_text(*mqa));
        }
        Json& model = doc["model"];
        const Json heads = mqa->get<bool>() ? Json(1) : model.value("n_heads", Json());
        const Json kv = model.value("n_kv_heads", Json());
        if (!kv.is_null() && kv != heads) {
            user_error(
                "config file {}: model.multi_query_attention: {} and model.n_kv_heads: {} disagree (it means "
                "n_kv_heads {}); set one of them",
                path, json_text(*mqa), json_text(kv), heads.is_null() ? "n_heads" : json_text(heads));
        }
        if (mqa->get<bool>()) model["n_kv_heads"] = 1;
    }

    if (doc.contains("model") && doc["model"].is_object() &&
        doc["model"].contains("attention_layer_norm_with_affine")) {
        const Json& on = doc["model"].contains("attention_layer_norm") ? doc["model"]["attention_layer_norm"] : Json();
        if (!(on.is_boolean() && on.get<bool>())) {
            doc["model"].erase("attention_layer_norm_with_affine");
            ignored.push_back("model.attention_layer_norm_with_affine (without attention_layer_norm)");
        }
    }
}

// data.instance_filter: an object (OLMo's defaults for what it leaves out, as OLMo's InstanceFilterConfig),
// or null (no filter).
void finish_instance_filter(Json& doc) {
    if (doc.contains("data") && doc["data"].is_object() && doc["data"].contains("instance_filter")) {
        Json& f = doc["data"]["instance_filter"];
        if (f.is_null()) {
            doc["data"].erase("instance_filter");
        } else if (f.is_object()) {
            const std::pair<const char*, int> defaults[] = {
                {"repetition_max_period", 13}, {"repetition_min_period", 1}, {"repetition_max_count", 32}};
            for (const auto& [key, value] : defaults) {
                if (!f.contains(key) || f[key].is_null()) f[key] = value;
            }
        }  // anything else: validate_config names it
    }
}

// scheduler.units: tokens -> steps of global_train_batch_size x max_sequence_length tokens (fractional where
// they do not divide: the schedule on tokens seen is the same formula on fractional steps).
void finish_scheduler_units(Json& doc, const std::string& path) {
    if (auto units = take(doc, "scheduler.units")) {
        if (*units == "tokens") {
            const Json* batch = doc.contains("global_train_batch_size") ? &doc["global_train_batch_size"] : nullptr;
            const Json* length =
                doc.contains("model") && doc["model"].is_object() && doc["model"].contains("max_sequence_length")
                    ? &doc["model"]["max_sequence_length"]
                    : nullptr;
            if (!batch || !length || !batch->is_number() || !length->is_number() || !doc["scheduler"].is_object()) {
                user_error(
                    "config file {}: scheduler.units: tokens needs global_train_batch_size and "
                    "model.max_sequence_length (numbers) to turn tokens into steps",
                    path);
            }
            const double per_step = batch->get<double>() * length->get<double>();
            for (const char* k : {"t_warmup", "t_max", "grad_clip_warmup_steps", "t_decay"}) {
                if (!doc["scheduler"].contains(k)) continue;
                Json& v = doc["scheduler"][k];
                if (v.is_null()) continue;
                if (!v.is_number() || per_step <= 0) {
                    user_error("config file {}: scheduler.{}: {}; expected a number of tokens", path, k, json_text(v));
                }
                const double steps = v.get<double>() / per_step;
                if (steps == std::floor(steps) && steps < 9e15) {
                    v = static_cast<long>(steps);
                } else {
                    v = steps;
                }
            }
        } else if (*units != "steps") {
            user_error("config file {}: scheduler.units: {}; expected steps or tokens", path, json_text(*units));
        }
    }
}

// The keys with no effect here.
void take_no_effect_keys(Json& doc, const std::string& path, std::vector<std::string>& ignored) {
    for (const NoEffect& k : no_effect_keys()) {
        const std::string p = k.path;
        const size_t arr = p.find("[]");
        std::vector<std::pair<std::string, Json*>> where;  // (shown name, object holding the key)
        if (arr == std::string::npos) {
            where.emplace_back(p, &doc);
        } else if (doc.contains(p.substr(0, arr)) && doc[p.substr(0, arr)].is_array()) {
            Json& list = doc[p.substr(0, arr)];
            for (size_t i = 0; i < list.size(); ++i) {
                where.emplace_back(fmt::format("{}[{}]{}", p.substr(0, arr), i, p.substr(arr + 2)), &list[i]);
            }
        }
        for (auto& [shown, holder] : where) {
            const std::string rel = arr == std::string::npos ? p : p.substr(arr + 3);
            auto v = take(*holder, rel);
            if (!v) continue;
            if (k.ok && !k.ok(*v)) {
                user_error(
                    "config file {}: {}: {}; this trainer has no {} (an OLMo key it accepts only at the value "
                    "that changes nothing)",
                    path, shown, json_text(*v), k.needs);
            }
            ignored.push_back(shown);
        }
    }
}

}  // namespace

void finish_olmo_config(Json& doc, const std::string& path, bool strict) {
    resolve_olmo_interpolations(doc, path);
    std::vector<std::string> ignored;
    finish_evaluators(doc, ignored);
    finish_tokenizer(doc, path, ignored);
    finish_checkpoints(doc, path, ignored);
    finish_model(doc, path, ignored);
    finish_instance_filter(doc);
    finish_scheduler_units(doc, path);
    take_no_effect_keys(doc, path, ignored);
    if (!ignored.empty()) {
        const std::string list = fmt::format("{}", fmt::join(ignored, ", "));
        if (strict) user_error("config file {}: OLMo keys with no effect here (--strict): {}", path, list);
        std::fprintf(stderr, "warning: %s: OLMo keys with no effect here, ignored: %s\n", path.c_str(), list.c_str());
    }
}

}  // namespace trainer
