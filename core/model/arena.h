// The activation arena's plan: where, in one device buffer, each activation the model's backward reads lives
// (in floats from the arena's start), given what each block keeps (activation_checkpointing) and the model's
// shape. Planned once, before the first step, as llm.c plans its activations; the Model allocates the arena
// and the dry runs count it, from this one plan.
#pragma once

#include <cstddef>
#include <vector>

#include "base/choices.h"

namespace trainer {

// What a block keeps for its backward: everything; its input only (whole_layer: the backward recomputes the
// block's forward); or its GEMM and attention outputs (fine_grained: the backward recomputes the norms and the
// MLP activation; only the activation where the pre-norms' backward reads their output, whose blocks keep the
// norms' outputs and no residual stream).
enum class ArenaKeep { kAll, kInput, kGemmOutputs };

// OLMo's policies per layer: which blocks recompute, and what (one_in_N: the blocks with layer % N == 0;
// two_in_three and three_in_four: the others).
std::vector<ArenaKeep> checkpointing_policy(ActivationCheckpointing policy, int layers);

// Offsets of each activation of a block: the block's own where it keeps it for its backward, else the shared
// work plan's (overwritten by every block that does not keep it); kAbsent where the config has no such
// activation. ln1/ln2: the attention and MLP sublayers' GEMM input (the pre-norms' outputs; with norm_after the
// bf16 copy of resid / resid_mid, absent when the GEMMs read the fp32 stream); ln1_*/ln2_*: attn_norm's and
// ff_norm's statistics, of resid / resid_mid or (norm_after) of att_o / ff_o, the outputs of attn_out and
// ff_out; qk and qk_*: the QK-norm's inputs (q | k, C + KV a row) and statistics; qkv: q | k | v with every head's
// own k and v, as attention reads it (3C a row).
struct ArenaSlots {
    static constexpr size_t kAbsent = static_cast<size_t>(-1);
    size_t resid = kAbsent, ln1 = kAbsent, ln1_mean = kAbsent, ln1_rstd = kAbsent, qk = kAbsent, qk_mean = kAbsent,
           qk_rstd = kAbsent, qkv = kAbsent, att = kAbsent, lse = kAbsent, att_o = kAbsent, resid_mid = kAbsent,
           ln2 = kAbsent, ln2_mean = kAbsent, ln2_rstd = kAbsent, fch = kAbsent, fch_act = kAbsent, ff_o = kAbsent;
};

// The model's shape as the arena sees it.
struct ArenaShape {
    int max_batch = 1, T = 1, C = 1, NH = 1, P = 1, H = 1, V = 1, L = 1;
    int KV = 1;                  // the width of k and of v (C, or less with grouped-query attention)
    int head_chunk_rows = 1;     // rows of the LM head's logits chunk (Model::head_chunk_rows)
    bool operands_bf16 = false;  // GemmOperand activations in bf16 (half the floats)
    bool norm_after = false, qk_norm = false, rms = false;
    bool norm_from_output = false;  // the pre-norms' backward reads their output, not the residual stream
    bool z_loss = false;
};

struct ArenaPlan {
    std::vector<ArenaSlots> layers;
    // Across the head: its input and output, the losses; the gradients it writes; the shared scratch.
    size_t resid_final = 0, lnf = 0, lnf_mean = 0, lnf_rstd = 0, logits = 0, losses = 0, z_losses = 0, scratch = 0;
    size_t dresid = 0, dln = 0, dqkv = 0, datt = 0, dfch = 0, dfch_act = 0, dsub = 0;
    // Grouped-query attention (KV < C): att_proj's output q | k | v (C + 2KV a row), before its shared heads are
    // expanded into qkv, and its gradient; kAbsent otherwise (att_proj writes qkv itself).
    size_t proj = ArenaSlots::kAbsent;
    size_t floats = 0;  // the arena's size
};

// The arena in three parts: what each block keeps for its backward; what lives across the head; and what is
// dead while the head runs, shared with the head's logits chunk (the recompute's work plan, the forward's
// projection scratch and the blocks' backward scratch). Every activation 64-byte aligned.
ArenaPlan plan_arena(const ArenaShape& shape, const std::vector<ArenaKeep>& keep);

}  // namespace trainer
