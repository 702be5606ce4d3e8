// `trainer logits` (see logits.h).
#include "core/logits.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <vector>

#include "base/common.h"
#include "base/layout.h"
#include "core/data/data.h"
#include "core/model.h"
#include "core/weights/checkpoint.h"
#include "core/weights/hf_export.h"
#include "core/weights/hf_names.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/setup.h"
#include "parallel/strategy.h"

namespace trainer {

void load_inference_params(const TrainConfig& config, const ParamLayout& layout, Strategy& strategy,
                           const char* command) {
    const ModelConfig& m = config.model;
    if (config.load_path) {
        TrainConfig saved;
        std::vector<std::vector<float>> units;
        const std::string path = resolve_checkpoint(config, *config.load_path);
        read_checkpoint_params(path, &saved, &units);
        // The same model, not only the same sizes (rope_theta, the norms' kind and eps change no size).
        check_model_matches(saved.json, config, path);
        if (units.size() != static_cast<size_t>(layout.num_units())) {
            user_error("{}: checkpoint {} holds {} units; this config's model has {}", command, *config.load_path,
                       units.size(), layout.num_units());
        }
        for (int u = 0; u < layout.num_units(); ++u) {
            if (units[u].size() != layout.units()[u].numel) {
                user_error("{}: checkpoint {} does not hold this config's model (unit {})", command, *config.load_path,
                           layout.units()[u].name);
            }
            strategy.load_full_unit_params(u, units[u].data());
        }
        strategy.params_loaded();
    } else if (config.init_from) {
        hf_family(m, "--init-from " + *config.init_from);
        const std::map<std::string, Tensor> tensors = read_hf_weights(config, *config.init_from);
        load_initial_params(config, layout, strategy, &tensors, *config.init_from);
    } else {
        load_initial_params(config, layout, strategy, nullptr, "");
    }
}

int run_logits(const TrainConfig& config, long instances, const std::string& out) {
    if (instances < 1) user_error("logits --instances: {}; expected at least 1", instances);
    const Device device = check_device_config(config);
    configure_threads(config.threads);
    const ModelConfig& m = config.model;
    const int L = m.max_sequence_length, T = L - 1, V = m.embedding_size;
    const TokenDtype dtype = parse_token_dtype(config.data.memmap_dtype);
    TokenDataset data(config.data.paths, dtype, L, m.vocab_size);
    if (data.num_instances() < instances) {
        user_error("logits --instances: {}, but the data holds {} instances of {} tokens", instances,
                   data.num_instances(), L);
    }
    auto backend = make_backend(device, backend_options(config, 0));
    const ParamLayout layout(config);
    auto strategy = make_single_strategy(backend.get(), layout);
    load_inference_params(config, layout, *strategy, "logits");
    const int batch = static_cast<int>(std::min<long>(instances, config.device_eval_batch_size));
    Model model(config, layout, backend.get(), strategy.get(), batch);

    const std::string tmp = out + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) user_error("logits: cannot write {} ({})", tmp, std::strerror(errno));
    bool ok = true;
    const auto write = [&](const void* p, size_t bytes) { ok = ok && std::fwrite(p, 1, bytes, f) == bytes; };
    const std::string header = npy_header("<f4", {instances, T, V});
    write(header.data(), header.size());
    std::vector<int32_t> tokens(static_cast<size_t>(batch) * L);
    for (long first = 0; first < instances; first += batch) {
        const int n = static_cast<int>(std::min<long>(batch, instances - first));
        for (int i = 0; i < n; ++i) data.read_instance(first + i, tokens.data() + static_cast<size_t>(i) * L);
        // Chunks arrive in row order: written as they come.
        model.forward_logits(tokens.data(), n, [&](int, int rows, const float* logits) {
            write(logits, static_cast<size_t>(rows) * V * sizeof(float));
        });
    }
    ok = std::fclose(f) == 0 && ok;
    if (!ok || std::rename(tmp.c_str(), out.c_str()) != 0) {
        std::remove(tmp.c_str());
        user_error("logits: cannot write {} ({})", out, std::strerror(errno));
    }
    std::printf("wrote %s: logits of %ld instances x %d positions x %d vocabulary rows (float32)\n", out.c_str(),
                instances, T, V);
    return 0;
}

}  // namespace trainer
