// FSDP wrap policies: which of the layout's units (embedding, block.i, head) are sharded, gathered and
// reduced together as one FSDP unit. OLMo's fsdp.wrapping_strategy values, applied at unit granularity.
#pragma once

#include <vector>

#include "base/config.h"
#include "base/layout.h"

namespace trainer {

// FSDP units as lists of layout units in increasing order. Element 0 is the root unit (what no policy
// wraps: PyTorch's root FSDP module), possibly empty; every layout unit appears exactly once.
//   null                     everything in the root
//   by_block                 one unit per block; embedding and head in the root
//   by_block_and_size        by_block, plus the embedding and the untied LM head (with ln_f) as units
//   by_block_group           block_group_size consecutive blocks per unit (block_group_size > 1)
//   by_block_group_and_size  by_block_group plus the embedding and untied head
//   size_based               PyTorch's size_based_auto_wrap_policy (min_num_params) over the units:
//                            the embedding, each block and the head are wrapped when they hold at least
//                            min_num_params; the blocks left over are one unit when together they do
//   one_in_two..one_in_five  blocks with layer % N == 0 are units; the rest stays in the root
// Throws UserError for a bad combination (by_block_group with block_group_size 1).
std::vector<std::vector<int>> fsdp_unit_groups(const ParamLayout& layout, const FsdpConfig& fsdp);

}  // namespace trainer
