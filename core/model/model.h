// The model: a fixed decoder-only transformer (OLMo / GPT-2 shapes) with explicit forward and backward
// per layer over Backend ops, and activations in one arena planned for a micro-batch before the first
// step. No autograd (as llm.c).
//
// Data flow for one micro-batch of B instances of L tokens: inputs are tokens[:, :-1], targets
// tokens[:, 1:], so the model runs on T = L-1 positions (the L-th position would predict nothing).
//   x0 = wte[in] (+ wpe[t]);  per block l: x += attn_out(attn(rope(qk_norm(att_proj(LN(x))))));
//   x += ff_out(act(ff_proj(LN(x))));  logits = LN_f(x) @ W_head^T;  loss = CE(logits, targets) (+ z-loss)
// where LN is LayerNorm or RMSNorm (layer_norm_type) and qk_norm only with attention_layer_norm; with
// norm_after (OLMo-2) each sublayer's output is normed instead of its input: x += LN(attn_out(...(x))),
// x += LN(ff_out(act(ff_proj(x)))).
// The LM head is fused with the loss and its backward, chunked over rows, so the full (N, V) logits are
// never materialised: a chunk's logits become its dlogits in place, then feed dx and dW_head at once.
//
// Parameters come from the Strategy per unit (unit_params / unit_grads, inside its hooks); parameter
// gradients accumulate (+=) so micro-batches sum; activations are overwritten.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "base/lora.h"
#include "core/model/arena.h"
#include "kernels/backend.h"
#include "kernels/graph.h"
#include "parallel/strategy/strategy.h"

namespace trainer {

// The loss sums of a pass: the cross-entropy of every predicted token, and the z-loss (0 without one).
struct LossSums {
    double ce = 0.0, z = 0.0;
    LossSums& operator+=(const LossSums& o) {
        ce += o.ce, z += o.z;
        return *this;
    }
};

class Model {
   public:
    // Plans and allocates the activation arena for micro-batches of up to `max_batch` instances (0: none, for a
    // model that only decodes).
    Model(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy* strategy, int max_batch);

    // Forward, loss and backward of one micro-batch: `tokens` is (batch, L) on the host. Each predicted
    // token's loss gradient is scaled by dloss_scale (1 / tokens of the global batch, so micro-batch
    // gradients sum to the gradient of the global mean). keep (nullable, one flag an instance): an instance with
    // keep 0 predicts nothing (its targets are ignored: OLMo's instance filter). label_mask (nullable, (batch, L)
    // like tokens): a token whose value is 0 is no target (its position's loss and gradient are 0; OLMo's label
    // masks), though it is still read as input. Returns the sums of the token losses.
    LossSums forward_backward(const int32_t* tokens, int batch, float dloss_scale, const uint8_t* keep = nullptr,
                              const uint8_t* label_mask = nullptr);
    // Forward and loss only (evaluation): the sum of the token losses of (batch, L) tokens (label_mask as
    // forward_backward's).
    double forward_loss(const int32_t* tokens, int batch, const uint8_t* label_mask = nullptr);
    // Forward only: each position's loss, -log p(next token), of (batch, L) tokens into `losses` on the host,
    // (batch, T) floats (downstream evaluation sums a continuation's).
    void forward_token_losses(const int32_t* tokens, int batch, float* losses);
    // Forward only, the logits of (batch, L) tokens: rows r0.. r0+rows-1 of the (batch * T, embedding_size)
    // logits handed to `sink` in fp32 on the host, chunk by chunk (`trainer logits`).
    using LogitsSink = std::function<void(int r0, int rows, const float* logits)>;
    void forward_logits(const int32_t* tokens, int batch, const LogitsSink& sink);

    // LoRA's dropout keys for the next forward_backward: its rows are instances[b] of their dataset (null: b, their
    // place in the micro-batch) at optimizer step `step_key` (lora_step_key of the seed and the step), so the masks
    // do not depend on which rank or micro-batch runs an instance.
    void set_dropout_rows(uint64_t step_key, const int64_t* instances) {
        dropout_step_key_ = step_key;
        dropout_instances_ = instances;
    }

    int max_batch() const { return max_batch_; }
    // Rows of the LM head's logits chunk for micro-batches of up to `max_batch` (model.cpp says why).
    static int head_chunk_rows(const ModelConfig& m, int max_batch, bool bf16_logits);
    int positions() const { return T_; }  // T = L - 1
    // kernels.cuda_graphs: how forward_backward ran its micro-batches (kernels/graph.h).
    const GraphRunner& graphs() const { return graphs_; }

    // Pointers into a block unit's flat buffer (parameters or gradients); null where the config has none.
    struct BlockParams {
        float *attn_norm_w = nullptr, *attn_norm_b = nullptr;
        float *att_proj_w = nullptr, *att_proj_b = nullptr;  // (C + 2KV, C), (C + 2KV)
        float *q_norm_w = nullptr, *q_norm_b = nullptr;      // (C), (C): QK-norm; k_norm's (KV), (KV)
        float *k_norm_w = nullptr, *k_norm_b = nullptr;
        float *attn_out_w = nullptr, *attn_out_b = nullptr;  // (C, C), (C)
        float *ff_norm_w = nullptr, *ff_norm_b = nullptr;
        float *ff_proj_w = nullptr, *ff_proj_b = nullptr;  // (P, C), (P)
        float *ff_out_w = nullptr, *ff_out_b = nullptr;    // (C, H), (C)
    };
    // Pointers into the head unit's flat buffer; null where the config has none.
    struct HeadParams {
        float *norm_w = nullptr, *norm_b = nullptr;  // ln_f
        float *w = nullptr, *b = nullptr;            // the untied LM head (V, C), (V)
    };

    // ---- generation with a KV cache (core/decode.cpp; core/generate.h drives it) ----
    // The keys and values of every block for `sequences` sequences of up to `length` positions (at most
    // max_sequence_length), and fp32 buffers for up to `rows` rows a call, counted as "other" memory.
    struct DecodeCache {
        int sequences = 0, length = 0, rows = 0;
        DeviceBuffer keys, values;  // (layers, sequences, KVH, length, HS) each
        DeviceBuffer x, ln, qkv, qk, att, sub, fch, fch_act, stats, logits, scratch;
        DeviceBuffer ids;        // tokens, sequences and positions of the rows, int32
        DeviceBuffer lora_work;  // LoRA: the adapters' scratch (rows x 2r)
    };
    DecodeCache make_decode_cache(int sequences, int length, int rows) const;
    // Runs `rows` tokens through the model, row r being token tokens[r] of sequence seqs[r] at position
    // positions[r]: their keys and values go into the cache (the rows of one sequence in one call see each other
    // causally, as a prompt's tokens do), each row attends to its sequence's cache up to its position, and the
    // logits of the rows for which `wanted` is set (nullable: every row), (those rows, embedding_size), reach
    // `sink` on the host in row order. Under the strategy's hooks: a sharded strategy gathers each unit, so every
    // rank calls it alike.
    void decode(DecodeCache& cache, const int32_t* tokens, const int32_t* seqs, const int32_t* positions, int rows,
                const uint8_t* wanted, const LogitsSink& sink);

   private:
    // What a block keeps for its backward (core/arena.h).
    using Keep = ArenaKeep;

    BlockParams block_params(const float* base, int layer) const;
    // Block l's forward from its input (layers_[l].resid) into its plan; the output goes to the next
    // block's input, or (out_resid false: a recompute) the pass stops after the MLP activation, the last
    // activation the backward reads.
    void block_forward(int l, int batch, const BlockParams& w, bool out_resid);
    // What block l's attention (which 1) or MLP (which 2) sublayer's first GEMM reads, into its plan: the
    // pre-norm's output, or with norm_after the sublayer's input as a GEMM operand (its bf16 copy where
    // operands are bf16; nothing to do where the fp32 stream is read in place). One code path for the forward
    // and the recompute, so the recomputed values are the forward's.
    void block_sublayer_input(int l, int which, int N, const BlockParams& w);
    // That GEMM operand.
    GemmOperand sublayer_input(int l, int which) const;
    // The backward of block l's attention (which 1) or MLP (which 2) pre-norm into dresid from dln: from the
    // norm's output where it has no weight or bias (norm_from_output_), else from its input.
    void pre_norm_backward(int l, int which, const BlockParams& w, const BlockParams& g, int N);
    // What block l's backward reads and the block did not keep, recomputed into the shared work plan.
    void recompute_block(int l, int batch, const BlockParams& w);
    HeadParams head_params(const float* base) const;  // all null for a null base
    // Block l's strategy hooks for its forward (backward false) or backward, its LoRA adapters' unit's inside its
    // own; open_block also points adapter_w_ / adapter_g_ at the adapters.
    void open_block(int l, bool backward);
    void close_block(int l, bool backward);
    // LoRA: whether block Linear `linear` has an adapter; adds its adapters' update to its output `out` (rows ld
    // apart, the Linear's first output column) from its input x; and their backward, given the output's gradient
    // dout (rows ld apart), into the adapters' gradients and (+=) dinp.
    bool has_lora(LoraLinear linear) const;
    // Block l's adapter `mod`'s dropout in this pass (none outside training), and the rows' keys it reads, uploaded
    // for each training micro-batch (set_dropout_rows' instances).
    LoraDropout adapter_dropout(int l, const LoraModule& mod) const;
    void upload_dropout_keys(int batch);
    void lora_add(int l, LoraLinear linear, GemmOperand out, int ld, GemmOperand x, int N, float* work) const;
    void lora_grad(int l, LoraLinear linear, GemmOperand dinp, GemmOperand dout, int ld, GemmOperand x, int N);
    void upload_tokens(const int32_t* tokens, int batch, const uint8_t* keep, const uint8_t* label_mask = nullptr);
    void forward_blocks(int batch, bool backward_follows);
    // The final norm and the LM head: the loss (and with `backward` the head's backward), or with a sink the
    // logits instead of the loss.
    void head(int batch, float dloss_scale, bool backward, const LogitsSink* sink = nullptr);
    void backward_blocks(int batch);
    float* act(size_t offset) const { return arena_.f32() + offset; }
    // A norm's mean: null where the plan has none (RMSNorm).
    float* mean_at(size_t offset) const;
    // The GemmOperand activation at `offset` (the norms' outputs, qkv, attention's output, the ff_proj output,
    // the MLP activation, and the gradients only a GEMM or a bf16 kernel reads), in the storage the backend
    // keeps them in: bf16 where gemm_operands_bf16(), which halves their size.
    GemmOperand op(size_t offset) const {
        return operands_bf16_ ? GemmOperand::in_bf16(reinterpret_cast<uint16_t*>(act(offset)))
                              : GemmOperand(act(offset));
    }
    // amp_fp8: the block Linears' inputs and output gradients whose producers write their amax beside them
    // (GemmOperand::amax), so the FP8 casts take none of their own: each block's two pre-norm outputs and MLP
    // activation (kept from the forward to the backward, as the tensors are), and the gradient of the ff_proj output
    // (one for the pass). `which`: the tensor's slot in amax_.
    enum AmaxSlot { kAmaxLn1, kAmaxLn2, kAmaxAct, kAmaxPerLayer };
    GemmOperand with_amax(GemmOperand x, int l, AmaxSlot which) const {
        return amax_.data() == nullptr ? x : x.with_amax(amax_.f32() + l * kAmaxPerLayer + which);
    }
    GemmOperand dfch_with_amax() const {
        return amax_.data() == nullptr ? op(dfch_) : op(dfch_).with_amax(amax_.f32() + L_ * kAmaxPerLayer);
    }

    const TrainConfig& config_;
    // precision amp_fp8: the blocks' Linear layers compute on FP8 operands (Backend::set_linear_precision).
    bool fp8_linears() const { return config_.precision == Precision::kAmpFp8; }
    const ModelConfig& m_;
    const ParamLayout& layout_;
    Backend* backend_;
    Strategy* strategy_;
    int max_batch_, T_, C_, NH_, HS_, P_, H_, V_, L_;
    // Grouped-query attention: KVH_ key/value heads of KV_ = KVH_ * HS_ channels (NH_ and C_ without it), att_proj
    // W_ = C_ + 2 KV_ wide; with fewer than NH_, att_proj writes proj_ and kv_heads_expand fills qkv from it.
    int KVH_, KV_, W_;
    bool operands_bf16_ = false;  // the backend keeps GemmOperand activations in bf16
    GraphRunner graphs_;          // forward_backward's device work, replayed (kernels.cuda_graphs)
    int head_chunk_rows_;
    NormKind norm_kind_ = NormKind::kLayerNorm;  // every norm's (layer_norm_type)
    float norm_eps_ = 1e-5f;
    bool norm_after_ = false, qk_norm_ = false;
    // The pre-norms have neither weight nor bias (OLMo's): their backward reads their own output (the
    // sublayers' GEMM input, kept anyway), not the residual stream (Backend::norm_backward_from_output).
    bool norm_from_output_ = false;
    float z_loss_ = 0.0f;  // z-loss multiplier; 0: none

    // LoRA (lora.enabled): the target modules, each one's A and B offsets in a block's adapter unit.
    std::vector<LoraModule> lora_modules_;
    std::optional<LoraModule> head_lora_;       // lm_head's adapter (in the head adapter unit)
    size_t head_lora_a_ = 0, head_lora_b_ = 0;  // its A's and B's offsets in that unit
    bool has_adapters() const { return !lora_modules_.empty() || head_lora_.has_value(); }
    // The LM head's adapter on a chunk of `rows` rows starting at row r0 of the pass: out (the chunk's logits, rows V
    // apart) += its update of x (the chunk's normed rows); with dinp, its backward instead, dout the chunk's logit
    // gradients, into the unit's gradients (w, g: the head adapter unit's parameters and gradients).
    void head_lora(const float* w, float* g, GemmOperand logits, GemmOperand x, float* dinp, int r0, int rows,
                   float* work) const;
    std::vector<size_t> lora_a_, lora_b_;
    int lora_r_ = 0;
    float lora_scale_ = 0.0f, lora_p_ = 0.0f;
    const float* adapter_w_ = nullptr;  // the open block's adapters, and (backward) their gradients
    float* adapter_g_ = nullptr;
    bool dropout_on_ = false;  // a training pass: the adapters' inputs are dropped out
    uint64_t dropout_step_key_ = 0;
    const int64_t* dropout_instances_ = nullptr;
    DeviceBuffer lora_work_, row_keys_;  // the adapters' scratch; each row's dropout key (uint64)
    std::vector<uint64_t> row_keys_host_;

    // Arena offsets (in floats) of each block's activations (core/arena.h).
    static constexpr size_t kAbsent = ArenaSlots::kAbsent;
    using Plan = ArenaSlots;
    std::vector<Plan> layers_;
    std::vector<Keep> keep_;                             // per layer
    std::vector<std::array<size_t, 16>> block_offsets_;  // per layer: each block parameter's offset in its unit
    std::array<size_t, 4> head_offsets_;                 // each head parameter's offset in the head unit
    size_t resid_final_, lnf_, lnf_mean_, lnf_rstd_, logits_, losses_, z_losses_, scratch_;
    size_t dresid_, dln_, dqkv_, datt_, dfch_, dfch_act_, dsub_, proj_;
    DeviceBuffer arena_;
    DeviceBuffer amax_;        // amp_fp8's producer amaxes (with_amax), L_ * kAmaxPerLayer + 1 floats; none elsewhere
    DeviceBuffer tokens_dev_;  // inputs (N) then targets (N), int32
    std::vector<int32_t> tokens_host_;
    std::vector<float> logits_host_;  // forward_logits' chunk on the host
};

// The forward and backward passes of one optimizer step under the strategy's hooks: zero_grads and
// begin_step, each of the `accumulation` micro-batches of `batch` instances (tokens_for(k) gives micro-batch
// k's tokens), then finish_backward. Returns the sums of the token losses. The
// training loop and the dry runs (core/plan/dry_run.h) both take a step through it.
// A micro-batch's tokens, (batch, L) on the host, and which instances count (nullable: all; see
// Model::forward_backward).
struct MicroBatchTokens {
    const int32_t* tokens = nullptr;
    const uint8_t* keep = nullptr;
    const uint8_t* label_mask = nullptr;  // (batch, L), nullable: Model::forward_backward's
    // LoRA's dropout keys (Model::set_dropout_rows): the step's key and each instance's index in its dataset.
    uint64_t step_key = 0;
    const int64_t* instances = nullptr;
    MicroBatchTokens(const int32_t* t, const uint8_t* k = nullptr, const uint8_t* m = nullptr)  // NOLINT: implicit
        : tokens(t), keep(k), label_mask(m) {}
};
LossSums accumulate_gradients(Strategy& strategy, Model& model, long accumulation, int batch, float dloss_scale,
                              const std::function<MicroBatchTokens(long)>& tokens_for);

}  // namespace trainer
