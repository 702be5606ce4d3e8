// The activation arena's plan (see arena.h).
#include "core/model/arena.h"

#include <algorithm>

namespace trainer {

// OLMo's policies: which blocks recompute, and what (one_in_N: the blocks with layer % N == 0; two_in_three
// and three_in_four: the others).
std::vector<ArenaKeep> checkpointing_policy(ActivationCheckpointing policy, int layers) {
    const auto keep_for = [&](int l) {
        using A = ActivationCheckpointing;
        const auto whole_if = [](bool recomputed) { return recomputed ? ArenaKeep::kInput : ArenaKeep::kAll; };
        switch (policy) {
            case A::kNull:
                return ArenaKeep::kAll;
            case A::kWholeLayer:
                return ArenaKeep::kInput;
            case A::kOneInTwo:
                return whole_if(l % 2 == 0);
            case A::kOneInThree:
                return whole_if(l % 3 == 0);
            case A::kOneInFour:
                return whole_if(l % 4 == 0);
            case A::kOneInEight:
                return whole_if(l % 8 == 0);
            case A::kTwoInThree:
                return whole_if(l % 3 != 0);
            case A::kThreeInFour:
                return whole_if(l % 4 != 0);
            case A::kFineGrained:
                return ArenaKeep::kGemmOutputs;
        }
        return ArenaKeep::kAll;
    };
    std::vector<ArenaKeep> keep;
    for (int l = 0; l < layers; ++l) keep.push_back(keep_for(l));
    return keep;
}

ArenaPlan plan_arena(const ArenaShape& s, const std::vector<ArenaKeep>& keep) {
    ArenaPlan a;
    const size_t N = static_cast<size_t>(s.max_batch) * s.T;
    const size_t NC = N * s.C;
    const bool rms = s.rms;
    const auto count = [&](ArenaKeep k) { return std::count(keep.begin(), keep.end(), k); };
    size_t off = 0;
    auto take = [&](size_t n) {
        const size_t o = off;
        off += (n + 15) / 16 * 16;  // 64-byte alignment of every activation
        return o;
    };
    // A GemmOperand activation of n elements (backend.h): half the floats where the backend keeps them in bf16.
    auto take_operand = [&](size_t n) { return take(s.operands_bf16 ? (n + 1) / 2 : n); };
    const size_t lse_n = static_cast<size_t>(s.max_batch) * s.NH * s.T;
    // What a block's backward reads, by who provides it when the block does not keep everything: its input
    // (kept, unless streamed below), the GEMM and attention outputs (kept by fine_grained blocks, recomputed by whole
    // ones) and the cheap ones (recomputed by every block that does not keep everything: the pre-norms and their
    // statistics, the sublayers' GEMM inputs and the MLP activation). The post-norms' statistics are N floats
    // each and their recompute would need the GEMM before them: fine_grained keeps them.
    enum class Need { kInput, kGemm, kCheap };
    struct Slot {
        size_t ArenaSlots::*field;
        size_t n;
        bool operand;
        Need need;
    };
    const Need norm_stats = s.norm_after ? Need::kGemm : Need::kCheap;
    std::vector<Slot> slots = {{&ArenaSlots::resid, NC, false, Need::kInput}};
    // With norm_after and fp32 operands the sublayers' GEMMs read the residual stream in place.
    const bool sublayer_inputs = !s.norm_after || s.operands_bf16;
    if (sublayer_inputs) slots.push_back({&ArenaSlots::ln1, NC, true, Need::kCheap});
    if (!rms) slots.push_back({&ArenaSlots::ln1_mean, N, false, norm_stats});
    slots.push_back({&ArenaSlots::ln1_rstd, N, false, norm_stats});
    if (s.qk_norm) {
        slots.push_back({&ArenaSlots::qk, N * (s.C + s.KV), true, Need::kGemm});
        if (!rms) slots.push_back({&ArenaSlots::qk_mean, 2 * N, false, Need::kGemm});
        slots.push_back({&ArenaSlots::qk_rstd, 2 * N, false, Need::kGemm});
    }
    slots.push_back({&ArenaSlots::qkv, 3 * NC, true, Need::kGemm});
    slots.push_back({&ArenaSlots::att, NC, true, Need::kGemm});
    slots.push_back({&ArenaSlots::lse, lse_n, false, Need::kGemm});
    if (s.norm_after) slots.push_back({&ArenaSlots::att_o, NC, true, Need::kGemm});
    slots.push_back({&ArenaSlots::resid_mid, NC, false, Need::kGemm});
    if (sublayer_inputs) slots.push_back({&ArenaSlots::ln2, NC, true, Need::kCheap});
    if (!rms) slots.push_back({&ArenaSlots::ln2_mean, N, false, norm_stats});
    slots.push_back({&ArenaSlots::ln2_rstd, N, false, norm_stats});
    slots.push_back({&ArenaSlots::fch, N * s.P, true, Need::kGemm});
    slots.push_back({&ArenaSlots::fch_act, N * s.H, true, Need::kCheap});
    if (s.norm_after) slots.push_back({&ArenaSlots::ff_o, NC, true, Need::kGemm});
    const auto take_slot = [&](const Slot& slot) { return slot.operand ? take_operand(slot.n) : take(slot.n); };
    // With s.norm_from_output the pre-norms' outputs and statistics are all their backward reads, and the
    // outputs are the GEMMs' inputs, kept anyway: a fine_grained block keeps them (N floats of statistics
    // each) instead of recomputing them from the residual stream, so that it needs no stream either.
    const auto pre_norm = [&](size_t ArenaSlots::*f) {
        return f == &ArenaSlots::ln1 || f == &ArenaSlots::ln1_mean || f == &ArenaSlots::ln1_rstd ||
               f == &ArenaSlots::ln2 || f == &ArenaSlots::ln2_mean || f == &ArenaSlots::ln2_rstd;
    };
    const auto kept = [&](ArenaKeep k, const Slot& slot) {
        if (k == ArenaKeep::kAll || slot.need == Need::kInput) return true;
        return k == ArenaKeep::kGemmOutputs &&
               (slot.need == Need::kGemm || (s.norm_from_output && pre_norm(slot.field)));
    };
    // With s.norm_from_output a block that keeps its norms' outputs (null and fine_grained) has no use for the
    // residual stream in its backward: its input and resid_mid live only through its forward, in two stream
    // buffers that every such block shares (a block's output overwrites its input there once resid_mid holds
    // the sum), laid over the backward's gradient scratch, dead while the forward runs.
    const auto streamed = [&](int l, size_t ArenaSlots::*field) {
        return s.norm_from_output && keep[l] != ArenaKeep::kInput &&
               (field == &ArenaSlots::resid || field == &ArenaSlots::resid_mid);
    };
    // 1. What each block keeps for its backward.
    for (int l = 0; l < s.L; ++l) {
        ArenaSlots p;
        for (const Slot& slot : slots) {
            if (kept(keep[l], slot) && !streamed(l, slot.field)) p.*slot.field = take_slot(slot);
        }
        a.layers.push_back(p);
    }
    // 2. What lives across the head: its input and output, the losses, and the gradients it writes.
    a.resid_final = take(NC);
    a.lnf = take_operand(NC);
    a.lnf_mean = rms ? ArenaSlots::kAbsent : take(N);
    a.lnf_rstd = take(N);
    a.losses = take(N);
    a.z_losses = s.z_loss ? take(N) : ArenaSlots::kAbsent;
    a.dresid = take(NC);
    a.dln = take(NC);
    // 3. What is dead while the head runs, shared with the head's logits chunk: the work plan (the recomputed
    // activations, one block's worth, only what the policy recomputes), the forward's projection scratch and
    // the blocks' backward scratch.
    const size_t region = off;
    ArenaSlots work;
    for (const Slot& slot : slots) {
        bool needed = false;  // by a block that neither keeps it nor streams it
        for (int l = 0; l < s.L; ++l) needed = needed || (!kept(keep[l], slot) && !streamed(l, slot.field));
        if (needed) work.*slot.field = take_slot(slot);
    }
    // The gradients that only a GEMM or a bf16 kernel reads next are GemmOperands too (bf16 in amp_bf16, as
    // autocast's are): attention's and the MLP's inner ones, and with norm_after the sublayers' outputs'. The
    // residual stream's (dresid) and the pre-norms' (dln), which accumulate across paths, stay fp32.
    a.scratch = take(NC);
    const size_t backward_scratch = off;  // from here on only the blocks' backward writes (and the forward, proj)
    a.dqkv = take_operand(3 * NC);
    a.datt = take_operand(NC);
    a.dfch = take_operand(N * s.P);
    a.dfch_act = take_operand(N * s.H);
    a.dsub = s.norm_after ? take_operand(NC) : ArenaSlots::kAbsent;
    // The forward writes it too, while the backward scratch is dead: past the two stream buffers laid over the
    // scratch's start below (dqkv and datt alone are 2NC floats), and not read across the head.
    if (s.KV < s.C) a.proj = take_operand(N * (s.C + 2 * static_cast<size_t>(s.KV)));
    const size_t rows = static_cast<size_t>(s.head_chunk_rows);
    a.logits = region;
    const size_t logit_floats = s.operands_bf16 ? (rows * s.V + 1) / 2 : rows * s.V;
    off = std::max(off, region + (logit_floats + 15) / 16 * 16);
    const size_t stream_floats = (NC + 15) / 16 * 16;
    if (s.norm_from_output && count(ArenaKeep::kInput) < s.L) off = std::max(off, backward_scratch + 2 * stream_floats);
    for (int l = 0; l < s.L; ++l) {
        ArenaSlots& p = a.layers[l];
        if (streamed(l, &ArenaSlots::resid)) p.resid = backward_scratch, p.resid_mid = backward_scratch + stream_floats;
        for (const Slot& slot : slots) {
            if (p.*slot.field == ArenaSlots::kAbsent) p.*slot.field = work.*slot.field;
        }
    }
    a.floats = off;
    return a;
}

}  // namespace trainer
