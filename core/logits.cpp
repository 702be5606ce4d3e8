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
#include "core/model/init.h"
#include "core/model/model.h"
#include "core/weights/checkpoint.h"
#include "core/weights/hf_export.h"
#include "core/weights/hf_names.h"
#include "kernels/backend.h"
#include "kernels/cpu/machine.h"
#include "parallel/setup.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

int run_logits(const TrainConfig& config, long instances, const std::string& out) {
    if (instances < 1) user_error("logits --instances: {}; expected at least 1", instances);
    const ComputeTarget target = resolve_compute(config);
    configure_threads(config.threads);
    const ModelConfig& m = config.model;
    const int L = m.max_sequence_length, T = L - 1, V = m.embedding_size;
    const TokenDtype dtype = config.data.memmap_dtype;
    TokenDataset data(config.data.paths, dtype, L, m.vocab_size);
    if (data.num_instances() < instances) {
        user_error("logits --instances: {}, but the data holds {} instances of {} tokens", instances,
                   data.num_instances(), L);
    }
    auto backend = make_backend(target.device, backend_options(config, target, 0));
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
