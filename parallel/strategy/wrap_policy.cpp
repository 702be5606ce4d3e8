// FSDP wrap policies (see wrap_policy.h).
#include "parallel/strategy/wrap_policy.h"

#include "base/common.h"

namespace trainer {

std::vector<std::vector<int>> fsdp_unit_groups(const ParamLayout& layout, const FsdpConfig& fsdp) {
    const int emb = layout.embedding_unit(), head = layout.head_unit();
    const int n_layers = layout.num_layers();
    using W = WrappingStrategy;
    const W policy = fsdp.wrapping_strategy;
    // The head unit holds ln_f and, untied, the LM head: OLMo wraps ff_out by size, ln_f stays in the root.
    bool head_is_lm_head = false;
    for (const ParamSpec& p : layout.units()[head].params) head_is_lm_head |= p.name == "transformer.ff_out.weight";
    std::vector<bool> wrapped(layout.num_units(), false);
    std::vector<std::vector<int>> groups(1);  // groups[0]: the root, filled last
    auto wrap = [&](std::vector<int> units) {
        for (int u : units) wrapped[u] = true;
        groups.push_back(std::move(units));
    };

    const bool grouped = policy == W::kByBlockGroup || policy == W::kByBlockGroupAndSize;
    if (grouped && fsdp.block_group_size <= 1) {
        user_error("fsdp.wrapping_strategy \"{}\" needs fsdp.block_group_size > 1 (it is {}); use by_block{}",
                   choice_name(policy), fsdp.block_group_size, policy == W::kByBlockGroup ? "" : "_and_size");
    }
    const bool and_size = policy == W::kByBlockAndSize || policy == W::kByBlockGroupAndSize;
    if (and_size) wrap({emb});
    // one_in_N: every Nth block.
    auto every_nth = [&](int every) {
        for (int l = 0; l < n_layers; l += every) wrap({layout.block_unit(l)});
    };
    switch (policy) {
        case W::kNull:
            break;
        case W::kByBlock:
        case W::kByBlockAndSize:
            for (int l = 0; l < n_layers; ++l) wrap({layout.block_unit(l)});
            break;
        case W::kByBlockGroup:
        case W::kByBlockGroupAndSize:
            for (int l = 0; l < n_layers; l += fsdp.block_group_size) {
                std::vector<int> g;
                for (int k = l; k < std::min(n_layers, l + fsdp.block_group_size); ++k)
                    g.push_back(layout.block_unit(k));
                wrap(g);
            }
            break;
        case W::kOneInTwo:
            every_nth(2);
            break;
        case W::kOneInThree:
            every_nth(3);
            break;
        case W::kOneInFour:
            every_nth(4);
            break;
        case W::kOneInFive:
            every_nth(5);
            break;
        case W::kSizeBased: {
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
            break;
        }
    }
    if (and_size && head_is_lm_head) wrap({head});
    // LoRA: each block's adapters are an FSDP unit of their own, whatever the policy (as PEFT's FSDP policy wraps
    // every adapter): a flat buffer is all frozen or all trained, so only the adapters hold and reduce gradients.
    for (int l = 0; l < n_layers && layout.has_adapters(); ++l) wrap({layout.adapter_unit(l)});
    if (layout.head_adapter_unit() >= 0) wrap({layout.head_adapter_unit()});
    for (int u = 0; u < layout.num_units(); ++u) {
        if (!wrapped[u]) groups[0].push_back(u);
    }
    return groups;
}

}  // namespace trainer
