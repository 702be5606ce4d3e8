// FSDP wrap policies (see wrap_policy.h).
#include "parallel/wrap_policy.h"

#include "base/common.h"

namespace trainer {

std::vector<std::vector<int>> fsdp_unit_groups(const ParamLayout& layout, const FsdpConfig& fsdp) {
    const int emb = layout.embedding_unit(), head = layout.head_unit();
    const int n_layers = head - 1;
    const std::string policy = fsdp.wrapping_strategy.value_or("null");
    // The head unit holds ln_f and, untied, the LM head: OLMo wraps ff_out by size, ln_f stays in the root.
    bool head_is_lm_head = false;
    for (const ParamSpec& p : layout.units()[head].params) head_is_lm_head |= p.name == "transformer.ff_out.weight";
    std::vector<bool> wrapped(layout.num_units(), false);
    std::vector<std::vector<int>> groups(1);  // groups[0]: the root, filled last
    auto wrap = [&](std::vector<int> units) {
        for (int u : units) wrapped[u] = true;
        groups.push_back(std::move(units));
    };

    if (policy == "by_block_group" || policy == "by_block_group_and_size") {
        if (fsdp.block_group_size <= 1) {
            user_error("fsdp.wrapping_strategy \"{}\" needs fsdp.block_group_size > 1 (it is {}); use by_block{}",
                       policy, fsdp.block_group_size, policy == "by_block_group" ? "" : "_and_size");
        }
    }
    const bool and_size = policy == "by_block_and_size" || policy == "by_block_group_and_size";
    if (and_size) wrap({emb});
    if (policy == "by_block" || policy == "by_block_and_size") {
        for (int l = 0; l < n_layers; ++l) wrap({layout.block_unit(l)});
    } else if (policy == "by_block_group" || policy == "by_block_group_and_size") {
        for (int l = 0; l < n_layers; l += fsdp.block_group_size) {
            std::vector<int> g;
            for (int k = l; k < std::min(n_layers, l + fsdp.block_group_size); ++k) g.push_back(layout.block_unit(k));
            wrap(g);
        }
    } else if (policy.rfind("one_in_", 0) == 0) {
        const int every = policy == "one_in_two" ? 2 : policy == "one_in_three" ? 3 : policy == "one_in_four" ? 4 : 5;
        for (int l = 0; l < n_layers; l += every) wrap({layout.block_unit(l)});
    } else if (policy == "size_based") {
        const size_t min = static_cast<size_t>(fsdp.min_num_params);
        auto big = [&](int u) { return layout.units()[u].numel >= min; };
        if (big(emb)) wrap({emb});
        size_t rest = 0;
        std::vector<int> left;
        for (int l = 0; l < n_layers; ++l) {
            const int u = layout.block_unit(l);
            if (big(u)) {
                wrap({u});
            } else {
                rest += layout.units()[u].numel;
                left.push_back(u);
            }
        }
        if (!left.empty() && rest >= min) wrap(left);  // PyTorch wraps the ModuleList of blocks
        if (big(head)) wrap({head});
    } else if (policy != "null") {
        TRAINER_CHECK(false, "unknown fsdp.wrapping_strategy {}", policy);
    }
    if (and_size && head_is_lm_head) wrap({head});
    for (int u = 0; u < layout.num_units(); ++u) {
        if (!wrapped[u]) groups[0].push_back(u);
    }
    return groups;
}

}  // namespace trainer
