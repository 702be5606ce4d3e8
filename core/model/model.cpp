// Forward and backward of the transformer over Backend ops (see model.h).
#include "core/model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/common.h"
#include "base/trace.h"
#include "kernels/element.h"

namespace trainer {

namespace {

// Each block parameter's name (after "transformer.blocks.N.") and its field in BlockParams.
constexpr std::pair<const char*, float * Model::BlockParams::*> kBlockFields[] = {
    {"attn_norm.weight", &Model::BlockParams::attn_norm_w}, {"attn_norm.bias", &Model::BlockParams::attn_norm_b},
    {"att_proj.weight", &Model::BlockParams::att_proj_w},   {"att_proj.bias", &Model::BlockParams::att_proj_b},
    {"q_norm.weight", &Model::BlockParams::q_norm_w},       {"q_norm.bias", &Model::BlockParams::q_norm_b},
    {"k_norm.weight", &Model::BlockParams::k_norm_w},       {"k_norm.bias", &Model::BlockParams::k_norm_b},
    {"attn_out.weight", &Model::BlockParams::attn_out_w},   {"attn_out.bias", &Model::BlockParams::attn_out_b},
    {"ff_norm.weight", &Model::BlockParams::ff_norm_w},     {"ff_norm.bias", &Model::BlockParams::ff_norm_b},
    {"ff_proj.weight", &Model::BlockParams::ff_proj_w},     {"ff_proj.bias", &Model::BlockParams::ff_proj_b},
    {"ff_out.weight", &Model::BlockParams::ff_out_w},       {"ff_out.bias", &Model::BlockParams::ff_out_b},
};
constexpr size_t kNumBlockFields = sizeof(kBlockFields) / sizeof(kBlockFields[0]);

// The head unit's parameters by name and their fields in HeadParams (the LM head only when untied).
constexpr std::pair<const char*, float * Model::HeadParams::*> kHeadFields[] = {
    {"transformer.ln_f.weight", &Model::HeadParams::norm_w},
    {"transformer.ln_f.bias", &Model::HeadParams::norm_b},
    {"transformer.ff_out.weight", &Model::HeadParams::w},
    {"transformer.ff_out.bias", &Model::HeadParams::b},
};
constexpr size_t kNumHeadFields = sizeof(kHeadFields) / sizeof(kHeadFields[0]);
static_assert(kNumBlockFields == 16, "Model::block_offsets_ holds one offset per entry of kBlockFields");
static_assert(kNumHeadFields == 4, "Model::head_offsets_ holds one offset per entry of kHeadFields");

}  // namespace

// Pointers into the head unit's flat buffer from the offsets found once in the constructor.
Model::HeadParams Model::head_params(const float* base) const {
    HeadParams p;
    if (base == nullptr) return p;
    float* b = const_cast<float*>(base);
    for (size_t f = 0; f < kNumHeadFields; ++f) {
        if (head_offsets_[f] != kAbsent) p.*(kHeadFields[f].second) = b + head_offsets_[f];
    }
    return p;
}

// Pointers into a block unit's flat buffer from the offsets found once in the constructor.
Model::BlockParams Model::block_params(const float* base, int layer) const {
    BlockParams p;
    if (base == nullptr) return p;  // a frozen unit's gradients
    float* b = const_cast<float*>(base);
    const auto& offsets = block_offsets_[layer];
    for (size_t f = 0; f < kNumBlockFields; ++f) {
        if (offsets[f] != kAbsent) p.*(kBlockFields[f].second) = b + offsets[f];
    }
    return p;
}

int Model::head_chunk_rows(const ModelConfig& m, int max_batch, bool bf16_logits) {
    // Enough rows to keep the GEMMs efficient (at least 16), few enough that a chunk of logits stays within
    // a cap and within one block's activations (what a block keeps without checkpointing, counted in the
    // logits' storage), so the head never needs more than a block: the same chunks under every
    // activation_checkpointing policy (the dW_head sums, and so the results, do not depend on it), and a
    // checkpointed run's arena is its blocks' inputs plus about one block. Each chunk is written and read
    // back at once. fp32 logits (the CPU): 256 MiB, (64 << 20) / V rows of V floats. bf16 logits (a GPU):
    // 512 MiB, in chunks of equal size: fewer and larger GEMMs, no small last one (OLMo-1B's 2 x 4094 rows
    // at micro-batch 4 fit in the backward scratch they share; GPT-2's 4 x 4092 need 62 MB more).
    const size_t T = static_cast<size_t>(m.predicted_positions()), N = static_cast<size_t>(max_batch) * T;
    const size_t NC = N * m.d_model, lse = static_cast<size_t>(max_batch) * m.n_heads * T;
    const size_t block_floats = 8 * NC + 4 * N + lse + N * (m.ff_proj_size() + m.ff_hidden_size());
    const size_t V = static_cast<size_t>(m.embedding_size);
    if (!bf16_logits) return static_cast<int>(std::clamp<size_t>(std::min(size_t(64) << 20, block_floats) / V, 16, N));
    const size_t cap = std::clamp<size_t>(std::min(size_t(256) << 20, 2 * block_floats) / V, 16, N);
    const size_t chunks = (N + cap - 1) / cap;
    return static_cast<int>((N + chunks - 1) / chunks);
}

Model::Model(const TrainConfig& config, const ParamLayout& layout, Backend* backend, Strategy* strategy, int max_batch)
    : config_(config),
      m_(config.model),
      layout_(layout),
      backend_(backend),
      strategy_(strategy),
      max_batch_(max_batch),
      graphs_(backend, config.kernels_cuda_graphs) {
    operands_bf16_ = backend_->gemm_operands_bf16();
    T_ = m_.predicted_positions();
    C_ = m_.d_model;
    NH_ = m_.n_heads;
    HS_ = m_.head_size();
    KVH_ = m_.n_kv_heads;
    KV_ = m_.kv_size();
    W_ = m_.qkv_size();
    P_ = m_.ff_proj_size();
    H_ = m_.ff_hidden_size();
    V_ = m_.embedding_size;
    L_ = m_.n_layers;
    for (int l = 0; l < L_; ++l) {
        std::array<size_t, kNumBlockFields> offsets;
        offsets.fill(kAbsent);
        const std::string prefix = fmt::format("transformer.blocks.{}.", l);
        for (const auto& spec : layout_.units()[layout_.block_unit(l)].params) {
            const std::string leaf = spec.name.substr(prefix.size());
            size_t f = 0;
            while (f < kNumBlockFields && leaf != kBlockFields[f].first) ++f;
            TRAINER_CHECK(f < kNumBlockFields, "unexpected block parameter {}", spec.name);
            offsets[f] = spec.offset;
        }
        block_offsets_.push_back(offsets);
    }
    head_offsets_.fill(kAbsent);
    for (const auto& spec : layout_.units()[layout_.head_unit()].params) {
        size_t f = 0;
        while (f < kNumHeadFields && spec.name != kHeadFields[f].first) ++f;
        TRAINER_CHECK(f < kNumHeadFields, "unexpected head parameter {}", spec.name);
        head_offsets_[f] = spec.offset;
    }
    keep_ = checkpointing_policy(config.activation_checkpointing, L_);
    norm_kind_ = m_.rms_norm() ? NormKind::kRms : NormKind::kLayerNorm;
    norm_eps_ = static_cast<float>(m_.layer_norm_eps);
    norm_after_ = m_.norm_after;
    qk_norm_ = m_.attention_layer_norm;
    norm_from_output_ = m_.norm_backward_from_output();
    z_loss_ = static_cast<float>(config.z_loss_multiplier);
    if (config.lora.enabled) {
        if (!backend_->has_lora()) {
            user_error("config lora.enabled: the {} backend has no LoRA kernels yet; run LoRA with device cpu",
                       backend_->name());
        }
        lora_modules_ = lora_modules(m_, config.lora.targets);
        lora_r_ = config.lora.r;
        lora_scale_ = static_cast<float>(config.lora.scaling());
        lora_p_ = static_cast<float>(config.lora.dropout);
        const Unit& adapters = layout_.units()[layout_.adapter_unit(0)];
        for (const LoraModule& mod : lora_modules_) {
            int unit = -1;
            const ParamSpec *a = nullptr, *b = nullptr;
            const std::string p = "transformer.blocks.0." + mod.name;
            TRAINER_CHECK(
                layout_.find(p + ".lora_A.weight", &unit, &a) && layout_.find(p + ".lora_B.weight", &unit, &b),
                "no adapter {} in unit {}", mod.name, adapters.name);
            lora_a_.push_back(a->offset), lora_b_.push_back(b->offset);
        }
        head_lora_ = lora_head_module(m_, config.lora.targets);
        if (head_lora_) {
            int unit = -1;
            const ParamSpec *a = nullptr, *b = nullptr;
            TRAINER_CHECK(layout_.find("lm_head.lora_A.weight", &unit, &a) &&
                              layout_.find("lm_head.lora_B.weight", &unit, &b) && unit == layout_.head_adapter_unit(),
                          "no LM head adapter in unit lora.head");
            head_lora_a_ = a->offset, head_lora_b_ = b->offset;
        }
    }
    if (max_batch_ == 0) return;  // generation only (decode): no training or evaluation passes, no arena
    ArenaShape shape;
    shape.max_batch = max_batch_, shape.T = T_, shape.C = C_, shape.NH = NH_, shape.P = P_, shape.H = H_;
    shape.L = L_, shape.V = V_, shape.KV = KV_;
    shape.head_chunk_rows = head_chunk_rows(m_, max_batch_, operands_bf16_);
    shape.operands_bf16 = operands_bf16_, shape.norm_after = norm_after_, shape.qk_norm = qk_norm_;
    shape.rms = m_.rms_norm(), shape.norm_from_output = norm_from_output_, shape.z_loss = z_loss_ > 0.0f;
    const ArenaPlan plan = plan_arena(shape, keep_);
    layers_ = plan.layers;
    resid_final_ = plan.resid_final, lnf_ = plan.lnf, lnf_mean_ = plan.lnf_mean, lnf_rstd_ = plan.lnf_rstd;
    logits_ = plan.logits, losses_ = plan.losses, z_losses_ = plan.z_losses, scratch_ = plan.scratch;
    dresid_ = plan.dresid, dln_ = plan.dln, dqkv_ = plan.dqkv, datt_ = plan.datt, dfch_ = plan.dfch;
    dfch_act_ = plan.dfch_act, dsub_ = plan.dsub, proj_ = plan.proj;
    head_chunk_rows_ = shape.head_chunk_rows;
    const size_t N = static_cast<size_t>(max_batch_) * T_;
    arena_ = DeviceBuffer(backend_, plan.floats * sizeof(float), MemCategory::kActivations);
    tokens_dev_ = DeviceBuffer(backend_, 2 * N * sizeof(int32_t), MemCategory::kActivations);
    tokens_host_.resize(2 * N);
    if (fp8_linears()) {
        amax_ = DeviceBuffer(backend_, (static_cast<size_t>(L_) * kAmaxPerLayer + 1) * sizeof(float),
                             MemCategory::kActivations);
    }
    if (has_adapters()) {
        const size_t K = static_cast<size_t>(std::max(C_, H_));
        lora_work_ = DeviceBuffer(backend_, N * (K + 2 * lora_r_) * sizeof(float), MemCategory::kActivations);
        if (lora_p_ > 0.0f) {
            row_keys_ = DeviceBuffer(backend_, N * sizeof(uint64_t), MemCategory::kActivations);
            row_keys_host_.resize(N);
        }
    }
}

void Model::open_block(int l, bool backward) {
    const int u = layout_.block_unit(l), a = layout_.adapter_unit(l);
    backward ? strategy_->before_backward(u) : strategy_->before_forward(u);
    if (a < 0) return;
    backward ? strategy_->before_backward(a) : strategy_->before_forward(a);
    adapter_w_ = strategy_->unit_params(a);
    adapter_g_ = backward ? strategy_->unit_grads(a) : nullptr;
}

void Model::close_block(int l, bool backward) {
    const int u = layout_.block_unit(l), a = layout_.adapter_unit(l);
    if (a >= 0) {
        backward ? strategy_->after_backward(a) : strategy_->after_forward(a);
        adapter_w_ = nullptr, adapter_g_ = nullptr;
    }
    backward ? strategy_->after_backward(u) : strategy_->after_forward(u);
}

LoraDropout Model::adapter_dropout(int l, const LoraModule& mod) const {
    LoraDropout drop;
    if (!dropout_on_ || lora_p_ <= 0.0f) return drop;
    drop.p = lora_p_, drop.row_keys = reinterpret_cast<const uint64_t*>(row_keys_.data());
    drop.adapter = static_cast<uint32_t>(l * 16 + mod.id);
    return drop;
}

void Model::head_lora(const float* w, float* g, GemmOperand logits, GemmOperand x, float* dinp, int r0, int rows,
                      float* work) const {
    const LoraModule& mod = *head_lora_;
    LoraDropout drop = adapter_dropout(L_, mod);  // keyed as a module of a layer after the last block
    if (drop.row_keys != nullptr) drop.row_keys += r0;
    const int C = static_cast<int>(mod.in), V = static_cast<int>(mod.rows());
    if (dinp == nullptr) {
        backend_->lora_forward(logits, V_, x, w + head_lora_a_, w + head_lora_b_, rows, C, lora_r_, V, lora_scale_,
                               drop, work);
    } else {
        backend_->lora_backward(dinp, g + head_lora_a_, g + head_lora_b_, logits, V_, x, w + head_lora_a_,
                                w + head_lora_b_, rows, C, lora_r_, V, lora_scale_, drop, work);
    }
}

bool Model::has_lora(LoraLinear linear) const {
    for (const LoraModule& mod : lora_modules_) {
        if (mod.linear == linear) return true;
    }
    return false;
}

void Model::lora_add(int l, LoraLinear linear, GemmOperand out, int ld, GemmOperand x, int N, float* work) const {
    for (size_t j = 0; j < lora_modules_.size(); ++j) {
        const LoraModule& mod = lora_modules_[j];
        if (mod.linear != linear) continue;
        const LoraDropout drop = adapter_dropout(l, mod);
        backend_->lora_forward(out.at(static_cast<size_t>(mod.row_begin)), ld, x, adapter_w_ + lora_a_[j],
                               adapter_w_ + lora_b_[j], N, static_cast<int>(mod.in), lora_r_,
                               static_cast<int>(mod.rows()), lora_scale_, drop, work);
    }
}

void Model::lora_grad(int l, LoraLinear linear, GemmOperand dinp, GemmOperand dout, int ld, GemmOperand x, int N) {
    for (size_t j = 0; j < lora_modules_.size(); ++j) {
        const LoraModule& mod = lora_modules_[j];
        if (mod.linear != linear) continue;
        const LoraDropout drop = adapter_dropout(l, mod);  // the training forward's masks
        backend_->lora_backward(dinp, adapter_g_ + lora_a_[j], adapter_g_ + lora_b_[j],
                                dout.at(static_cast<size_t>(mod.row_begin)), ld, x, adapter_w_ + lora_a_[j],
                                adapter_w_ + lora_b_[j], N, static_cast<int>(mod.in), lora_r_,
                                static_cast<int>(mod.rows()), lora_scale_, drop, lora_work_.f32());
    }
}

void Model::upload_tokens(const int32_t* tokens, int batch, const uint8_t* keep, const uint8_t* label_mask) {
    TRAINER_CHECK(batch >= 1 && batch <= max_batch_, "batch {} outside [1, {}]", batch, max_batch_);
    const int L = m_.max_sequence_length;
    const size_t N = static_cast<size_t>(batch) * T_;
    for (int b = 0; b < batch; ++b) {
        std::memcpy(&tokens_host_[b * T_], tokens + static_cast<size_t>(b) * L, T_ * sizeof(int32_t));
        int32_t* targets = &tokens_host_[N + b * T_];
        if (keep != nullptr && keep[b] == 0) {
            std::fill_n(targets, T_, -1);  // ignored targets: no loss, no gradient
            continue;
        }
        std::memcpy(targets, tokens + static_cast<size_t>(b) * L + 1, T_ * sizeof(int32_t));
        if (label_mask == nullptr) continue;
        // Position t predicts token t + 1: its mask value is that token's.
        const uint8_t* mask = label_mask + static_cast<size_t>(b) * L + 1;
        for (int t = 0; t < T_; ++t) {
            if (mask[t] == 0) targets[t] = -1;
        }
    }
    backend_->copy_host_to_device(tokens_dev_.data(), tokens_host_.data(), 2 * N * sizeof(int32_t));
}

void Model::upload_dropout_keys(int batch) {
    if (row_keys_host_.empty()) return;  // no dropout
    const size_t N = static_cast<size_t>(batch) * T_;
    for (int b = 0; b < batch; ++b) {
        const uint64_t instance = dropout_instances_ != nullptr ? static_cast<uint64_t>(dropout_instances_[b]) : b;
        for (int t = 0; t < T_; ++t) {
            row_keys_host_[static_cast<size_t>(b) * T_ + t] =
                lora_row_key(dropout_step_key_, instance, static_cast<uint32_t>(t));
        }
    }
    backend_->copy_host_to_device(row_keys_.data(), row_keys_host_.data(), N * sizeof(uint64_t));
}

void Model::forward_blocks(int batch, bool backward_follows) {
    strategy_->begin_forward(backward_follows);
    dropout_on_ = backward_follows;
    const int N = batch * T_;

    // Embedding.
    {
        const trace::Span span("forward", "forward embedding");
        const int emb = layout_.embedding_unit();
        strategy_->before_forward(emb);
        const float* wte = strategy_->unit_params(emb);
        const float* wpe = m_.rope ? nullptr : wte + static_cast<size_t>(V_) * C_;
        backend_->embedding_forward(act(layers_.empty() ? resid_final_ : layers_[0].resid), tokens_dev_.i32(), wte, wpe,
                                    N, T_, C_);
        strategy_->after_forward(emb);
    }
    for (int l = 0; l < L_; ++l) {
        const BlockLinears linears(backend_, fp8_linears());
        const trace::Span block("forward", trace::active() ? fmt::format("forward block.{}", l) : std::string());
        open_block(l, false);
        block_forward(l, batch, block_params(strategy_->unit_params(layout_.block_unit(l)), l), true);
        close_block(l, false);
    }
}

float* Model::mean_at(size_t offset) const { return offset == kAbsent ? nullptr : act(offset); }

GemmOperand Model::sublayer_input(int l, int which) const {
    const Plan& a = layers_[l];
    if (norm_after_ && !operands_bf16_) return GemmOperand(act(which == 1 ? a.resid : a.resid_mid));
    // norm_after's bf16 copies of the stream come from a cast that writes no amax; the pre-norms write theirs.
    const GemmOperand x = op(which == 1 ? a.ln1 : a.ln2);
    return norm_after_ ? x : with_amax(x, l, which == 1 ? kAmaxLn1 : kAmaxLn2);
}

void Model::block_sublayer_input(int l, int which, int N, const BlockParams& w) {
    const Plan& a = layers_[l];
    const size_t in = which == 1 ? a.resid : a.resid_mid, out = which == 1 ? a.ln1 : a.ln2;
    if (norm_after_) {
        // The sublayer reads its input itself: a bf16 copy where GEMM operands are bf16 (one rounding, as
        // autocast's Linear casts it), else the fp32 stream in place.
        if (operands_bf16_) backend_->cast_float_to_bf16(op(out).b16(), act(in), static_cast<size_t>(N) * C_);
        return;
    }
    if (which == 1) {
        backend_->layernorm_forward(sublayer_input(l, 1), mean_at(a.ln1_mean), act(a.ln1_rstd), act(in), w.attn_norm_w,
                                    w.attn_norm_b, N, C_, norm_eps_, norm_kind_);
    } else {
        backend_->layernorm_forward(sublayer_input(l, 2), mean_at(a.ln2_mean), act(a.ln2_rstd), act(in), w.ff_norm_w,
                                    w.ff_norm_b, N, C_, norm_eps_, norm_kind_);
    }
}

void Model::pre_norm_backward(int l, int which, const BlockParams& w, const BlockParams& g, int N) {
    const Plan& a = layers_[l];
    const size_t out = which == 1 ? a.ln1 : a.ln2, rstd = which == 1 ? a.ln1_rstd : a.ln2_rstd;
    if (norm_from_output_) {
        return backend_->norm_backward_from_output(act(dresid_), act(dln_), op(out), act(rstd), N, C_, norm_kind_);
    }
    if (which == 1) {
        backend_->layernorm_backward(act(dresid_), g.attn_norm_w, g.attn_norm_b, act(dln_), act(a.resid), w.attn_norm_w,
                                     mean_at(a.ln1_mean), act(a.ln1_rstd), N, C_, norm_kind_);
    } else {
        backend_->layernorm_backward(act(dresid_), g.ff_norm_w, g.ff_norm_b, act(dln_), act(a.resid_mid), w.ff_norm_w,
                                     mean_at(a.ln2_mean), act(a.ln2_rstd), N, C_, norm_kind_);
    }
}

void Model::block_forward(int l, int batch, const BlockParams& w, bool out_resid) {
    const int N = batch * T_;
    const float theta = static_cast<float>(m_.rope_theta);
    const bool tanh_gelu = m_.activation_type == ActivationType::kGeluTanh;
    const Plan& a = layers_[l];
    block_sublayer_input(l, 1, N, w);
    // With grouped-query attention att_proj's narrower output is expanded into qkv after the QK-norm: RoPE and
    // attention then run as with a head of k and v for every query head (torchtitan's and HF's repeat_kv).
    const GemmOperand proj = KVH_ < NH_ ? op(proj_) : op(a.qkv);
    backend_->matmul_forward(proj, sublayer_input(l, 1), w.att_proj_w, w.att_proj_b, N, C_, W_);
    lora_add(l, LoraLinear::kAttProj, proj, W_, sublayer_input(l, 1), N, lora_work_.f32());
    if (qk_norm_) {
        backend_->qk_norm_forward(proj, op(a.qk), mean_at(a.qk_mean), act(a.qk_rstd), w.q_norm_w, w.q_norm_b,
                                  w.k_norm_w, w.k_norm_b, N, C_, KV_, norm_eps_, norm_kind_);
    }
    if (KVH_ < NH_) backend_->kv_heads_expand(op(a.qkv), proj, N, NH_, KVH_, HS_);
    if (m_.rope) backend_->rope_forward(op(a.qkv), batch, T_, NH_, HS_, theta);
    backend_->attention_forward(op(a.att), act(a.lse), op(a.qkv), batch, T_, NH_, HS_);
    if (norm_after_) {
        backend_->matmul_forward(op(a.att_o), op(a.att), w.attn_out_w, w.attn_out_b, N, C_, C_);
        lora_add(l, LoraLinear::kAttnOut, op(a.att_o), C_, op(a.att), N, lora_work_.f32());
        backend_->norm_residual_forward(act(a.resid_mid), act(a.resid), mean_at(a.ln1_mean), act(a.ln1_rstd),
                                        op(a.att_o), w.attn_norm_w, w.attn_norm_b, N, C_, norm_eps_, norm_kind_);
    } else {
        backend_->matmul_residual_forward(act(a.resid_mid), act(a.resid), op(a.att), w.attn_out_w, w.attn_out_b, N, C_,
                                          C_, act(scratch_));
        lora_add(l, LoraLinear::kAttnOut, act(a.resid_mid), C_, op(a.att), N, lora_work_.f32());
    }
    block_sublayer_input(l, 2, N, w);
    const GemmOperand mlp_in = sublayer_input(l, 2);
    const GemmOperand fch_act = with_amax(op(a.fch_act), l, kAmaxAct);
    if (m_.activation_type == ActivationType::kSwiglu) {
        backend_->matmul_forward(op(a.fch), mlp_in, w.ff_proj_w, w.ff_proj_b, N, C_, P_);
        lora_add(l, LoraLinear::kFfProj, op(a.fch), P_, mlp_in, N, lora_work_.f32());
        backend_->swiglu_forward(fch_act, op(a.fch), N, H_);
    } else if (keep_[l] != Keep::kGemmOutputs &&
               !has_lora(LoraLinear::kFfProj)) {  // P == H: the GELU keeps the width (a GEMM epilogue on CUDA)
        backend_->matmul_gelu_forward(op(a.fch), fch_act, mlp_in, w.ff_proj_w, w.ff_proj_b, N, C_, P_, tanh_gelu);
    } else {
        // A block whose backward recomputes the GELU from the kept ff_proj output runs the kernel that recompute
        // runs, so the recomputed activation is the forward's bit for bit (cuBLASLt's epilogue computes the GELU
        // its own way). The CPU's matmul_gelu_forward is these two ops. An adapter on ff_proj adds between them.
        backend_->matmul_forward(op(a.fch), mlp_in, w.ff_proj_w, w.ff_proj_b, N, C_, P_);
        lora_add(l, LoraLinear::kFfProj, op(a.fch), P_, mlp_in, N, lora_work_.f32());
        backend_->gelu_forward(fch_act, op(a.fch), static_cast<size_t>(N) * H_, tanh_gelu);
    }
    if (!out_resid && !norm_after_) return;
    if (norm_after_) {
        // A recompute (!out_resid) needs ff_norm's input and statistics too: its output goes to the scratch,
        // not over the next block's kept input.
        const size_t next_resid = !out_resid ? scratch_ : (l + 1 < L_) ? layers_[l + 1].resid : resid_final_;
        backend_->matmul_forward(op(a.ff_o), fch_act, w.ff_out_w, w.ff_out_b, N, H_, C_);
        lora_add(l, LoraLinear::kFfOut, op(a.ff_o), C_, op(a.fch_act), N, lora_work_.f32());
        backend_->norm_residual_forward(act(next_resid), act(a.resid_mid), mean_at(a.ln2_mean), act(a.ln2_rstd),
                                        op(a.ff_o), w.ff_norm_w, w.ff_norm_b, N, C_, norm_eps_, norm_kind_);
        return;
    }
    const size_t next_resid = (l + 1 < L_) ? layers_[l + 1].resid : resid_final_;
    backend_->matmul_residual_forward(act(next_resid), act(a.resid_mid), fch_act, w.ff_out_w, w.ff_out_b, N, H_, C_,
                                      act(scratch_));
    lora_add(l, LoraLinear::kFfOut, act(next_resid), C_, op(a.fch_act), N, lora_work_.f32());
}

void Model::recompute_block(int l, int batch, const BlockParams& w) {
    if (keep_[l] == Keep::kInput) return block_forward(l, batch, w, false);
    // Fine-grained: the sublayers' GEMM inputs (the pre-norms, or norm_after's bf16 copies) from the kept
    // residual stream unless the block kept them (norm_from_output_), the activation from the kept ff_proj
    // output, with the kernels of the forward, so the values are the forward's.
    const int N = batch * T_;
    const Plan& a = layers_[l];
    if (!norm_from_output_) {
        block_sublayer_input(l, 1, N, w);
        block_sublayer_input(l, 2, N, w);
    }
    const GemmOperand fch_act = with_amax(op(a.fch_act), l, kAmaxAct);
    if (m_.activation_type == ActivationType::kSwiglu) {
        backend_->swiglu_forward(fch_act, op(a.fch), N, H_);
    } else {
        backend_->gelu_forward(fch_act, op(a.fch), static_cast<size_t>(N) * H_,
                               m_.activation_type == ActivationType::kGeluTanh);
    }
}

void Model::head(int batch, float dloss_scale, bool backward, const LogitsSink* sink) {
    const int N = batch * T_;
    const int hu = layout_.head_unit();
    const int emb = layout_.embedding_unit();
    const trace::Span span(backward ? "backward" : "forward", backward ? "head forward+backward" : "forward head");
    strategy_->before_forward(hu);
    if (m_.weight_tying) strategy_->before_forward(emb);
    if (backward) {
        strategy_->before_backward(hu);
        if (m_.weight_tying) strategy_->before_backward(emb);
    }
    const int ha = layout_.head_adapter_unit();  // lm_head's adapter, or -1
    if (ha >= 0) {
        strategy_->before_forward(ha);
        if (backward) strategy_->before_backward(ha);
    }
    const float* lora_w = ha >= 0 ? strategy_->unit_params(ha) : nullptr;
    float* lora_g = ha >= 0 && backward ? strategy_->unit_grads(ha) : nullptr;
    const HeadParams w = head_params(strategy_->unit_params(hu));
    const HeadParams g = head_params(backward ? strategy_->unit_grads(hu) : nullptr);
    const float *norm_w = w.norm_w, *norm_b = w.norm_b, *head_w = w.w, *head_b = w.b;
    float *dnorm_w = g.norm_w, *dnorm_b = g.norm_b, *dhead_w = g.w, *dhead_b = g.b;
    if (m_.weight_tying) {
        head_w = strategy_->unit_params(emb);  // wte (V, C) is the first parameter of the embedding unit
        dhead_w = backward ? strategy_->unit_grads(emb) : nullptr;
    }

    backend_->layernorm_forward(op(lnf_), mean_at(lnf_mean_), act(lnf_rstd_), act(resid_final_), norm_w, norm_b, N, C_,
                                norm_eps_, norm_kind_);
    backend_->hold_weight(head_w);  // every chunk multiplies by the same (V, C) weight
    for (int r0 = 0; r0 < N; r0 += head_chunk_rows_) {
        const int rows = std::min(head_chunk_rows_, N - r0);
        const GemmOperand logits = op(logits_);  // bf16 in amp_bf16, as autocast's LM head writes them
        const GemmOperand x = op(lnf_).at(static_cast<size_t>(r0) * C_);
        backend_->matmul_forward(logits, x, head_w, head_b, rows, C_, V_);
        if (ha >= 0) head_lora(lora_w, nullptr, logits, x, nullptr, r0, rows, lora_work_.f32());
        if (sink != nullptr) {
            const size_t n = static_cast<size_t>(rows) * V_;
            logits_host_.resize(n);
            if (logits.bf16) {
                std::vector<uint16_t> half(n);
                backend_->copy_device_to_host(half.data(), logits.b16(), n * sizeof(uint16_t));
                for (size_t i = 0; i < n; ++i) logits_host_[i] = bf16_to_float(half[i]);
            } else {
                backend_->copy_device_to_host(logits_host_.data(), logits.f32(), n * sizeof(float));
            }
            (*sink)(r0, rows, logits_host_.data());
            continue;
        }
        backend_->classifier_forward_backward(logits, act(losses_) + r0, tokens_dev_.i32() + N + r0, rows, V_,
                                              dloss_scale, backward, z_loss_,
                                              z_loss_ > 0.0f ? act(z_losses_) + r0 : nullptr);
        if (backward) {
            backend_->matmul_backward(act(dln_) + static_cast<size_t>(r0) * C_, dhead_w, dhead_b, logits, x, head_w,
                                      rows, C_, V_, false);
            if (ha >= 0) {
                head_lora(lora_w, lora_g, logits, x, act(dln_) + static_cast<size_t>(r0) * C_, r0, rows,
                          lora_work_.f32());
            }
        }
    }
    backend_->hold_weight(nullptr);
    if (backward) {
        backend_->fill_zero(act(dresid_), static_cast<size_t>(N) * C_ * sizeof(float));
        if (norm_from_output_) {
            backend_->norm_backward_from_output(act(dresid_), act(dln_), op(lnf_), act(lnf_rstd_), N, C_, norm_kind_);
        } else {
            backend_->layernorm_backward(act(dresid_), dnorm_w, dnorm_b, act(dln_), act(resid_final_), norm_w,
                                         mean_at(lnf_mean_), act(lnf_rstd_), N, C_, norm_kind_);
        }
        strategy_->after_backward(hu);
    }
    if (m_.weight_tying) strategy_->after_forward(emb);
    strategy_->after_forward(hu);
    if (ha >= 0) {
        if (backward) strategy_->after_backward(ha);
        strategy_->after_forward(ha);
    }
}

void Model::backward_blocks(int batch) {
    const int N = batch * T_;
    const float theta = static_cast<float>(m_.rope_theta);
    const bool tanh_gelu = m_.activation_type == ActivationType::kGeluTanh;
    for (int l = L_ - 1; l >= 0; --l) {
        const BlockLinears linears(backend_, fp8_linears());
        const Plan& a = layers_[l];
        const int u = layout_.block_unit(l);
        const trace::Span block("backward", trace::active() ? fmt::format("backward block.{}", l) : std::string());
        open_block(l, true);  // FULL_SHARD gathers the unit again: the recompute has its parameters
        const BlockParams w = block_params(strategy_->unit_params(u), l);
        const BlockParams g = block_params(strategy_->unit_grads(u), l);
        if (keep_[l] != Keep::kAll) {
            const trace::Span recompute("recompute",
                                        trace::active() ? fmt::format("recompute block.{}", l) : std::string());
            recompute_block(l, batch, w);
        }
        // MLP: x_out = resid_mid + ff_out(act(ff_proj(LN2(resid_mid)))), or with norm_after resid_mid +
        // LN2(ff_o), ff_o = ff_out(act(ff_proj(resid_mid))); dresid holds d(x_out).
        GemmOperand dff_out = act(dresid_);
        if (norm_after_) {
            backend_->norm_residual_backward(op(dsub_), g.ff_norm_w, g.ff_norm_b, act(dresid_), op(a.ff_o), w.ff_norm_w,
                                             mean_at(a.ln2_mean), act(a.ln2_rstd), N, C_, norm_kind_);
            dff_out = op(dsub_);
        }
        const GemmOperand fch_act = with_amax(op(a.fch_act), l, kAmaxAct), dfch = dfch_with_amax();
        if (m_.activation_type == ActivationType::kSwiglu) {
            backend_->matmul_backward(op(dfch_act_), g.ff_out_w, g.ff_out_b, dff_out, fch_act, w.ff_out_w, N, H_, C_,
                                      false);
            lora_grad(l, LoraLinear::kFfOut, op(dfch_act_), dff_out, C_, op(a.fch_act), N);
            backend_->swiglu_backward(dfch, op(a.fch), op(dfch_act_), N, H_);
        } else if (has_lora(LoraLinear::kFfOut)) {  // the adapter's input gradient adds before the GELU's backward
            backend_->matmul_backward(op(dfch_act_), g.ff_out_w, g.ff_out_b, dff_out, fch_act, w.ff_out_w, N, H_, C_,
                                      false);
            lora_grad(l, LoraLinear::kFfOut, op(dfch_act_), dff_out, C_, op(a.fch_act), N);
            backend_->gelu_backward(dfch, op(a.fch), op(dfch_act_), static_cast<size_t>(N) * H_, tanh_gelu);
        } else {  // ff_out's and the GELU's backward as one op (on CUDA one GEMM: the slope in its epilogue)
            backend_->matmul_gelu_backward(dfch, op(dfch_act_), g.ff_out_w, g.ff_out_b, dff_out, fch_act, w.ff_out_w,
                                           op(a.fch), N, H_, C_, tanh_gelu);
        }
        if (norm_after_) {  // ff_proj read resid_mid itself: its input gradient adds to the stream's
            backend_->matmul_backward(act(dresid_), g.ff_proj_w, g.ff_proj_b, dfch, sublayer_input(l, 2), w.ff_proj_w,
                                      N, C_, P_, true);
            lora_grad(l, LoraLinear::kFfProj, act(dresid_), op(dfch_), P_, sublayer_input(l, 2), N);
        } else {
            backend_->matmul_backward(act(dln_), g.ff_proj_w, g.ff_proj_b, dfch, sublayer_input(l, 2), w.ff_proj_w, N,
                                      C_, P_, false);
            lora_grad(l, LoraLinear::kFfProj, act(dln_), op(dfch_), P_, op(a.ln2), N);
            pre_norm_backward(l, 2, w, g, N);
        }
        // Attention: resid_mid = resid + attn_out(attn(rope(qk_norm(att_proj(LN1(resid)))))), or with norm_after
        // resid + LN1(att_o); dresid holds d(resid_mid).
        GemmOperand datt_out = act(dresid_);
        if (norm_after_) {
            backend_->norm_residual_backward(op(dsub_), g.attn_norm_w, g.attn_norm_b, act(dresid_), op(a.att_o),
                                             w.attn_norm_w, mean_at(a.ln1_mean), act(a.ln1_rstd), N, C_, norm_kind_);
            datt_out = op(dsub_);
        }
        backend_->matmul_backward(op(datt_), g.attn_out_w, g.attn_out_b, datt_out, op(a.att), w.attn_out_w, N, C_, C_,
                                  false);
        lora_grad(l, LoraLinear::kAttnOut, op(datt_), datt_out, C_, op(a.att), N);
        backend_->attention_backward(op(dqkv_), op(datt_), op(a.qkv), op(a.att), act(a.lse), batch, T_, NH_, HS_);
        if (m_.rope) backend_->rope_backward(op(dqkv_), batch, T_, NH_, HS_, theta);
        const GemmOperand dproj = KVH_ < NH_ ? op(proj_) : op(dqkv_);
        if (KVH_ < NH_) backend_->kv_heads_reduce(dproj, op(dqkv_), N, NH_, KVH_, HS_);
        if (qk_norm_) {
            backend_->qk_norm_backward(dproj, g.q_norm_w, g.q_norm_b, g.k_norm_w, g.k_norm_b, op(a.qk), w.q_norm_w,
                                       w.k_norm_w, mean_at(a.qk_mean), act(a.qk_rstd), N, C_, KV_, norm_kind_);
        }
        if (norm_after_) {
            backend_->matmul_backward(act(dresid_), g.att_proj_w, g.att_proj_b, dproj, sublayer_input(l, 1),
                                      w.att_proj_w, N, C_, W_, true);
            lora_grad(l, LoraLinear::kAttProj, act(dresid_), dproj, W_, sublayer_input(l, 1), N);
        } else {
            backend_->matmul_backward(act(dln_), g.att_proj_w, g.att_proj_b, dproj, sublayer_input(l, 1), w.att_proj_w,
                                      N, C_, W_, false);
            lora_grad(l, LoraLinear::kAttProj, act(dln_), dproj, W_, op(a.ln1), N);
            pre_norm_backward(l, 1, w, g, N);
        }
        close_block(l, true);
    }
    const int emb = layout_.embedding_unit();
    const trace::Span span("backward", "backward embedding");
    if (!m_.weight_tying) strategy_->before_backward(emb);  // a tied head already opened it
    float* dwte = strategy_->unit_grads(emb);
    float* dwpe = m_.rope || dwte == nullptr ? nullptr : dwte + static_cast<size_t>(V_) * C_;
    if (dwte != nullptr) backend_->embedding_backward(dwte, dwpe, act(dresid_), tokens_dev_.i32(), N, T_, C_);
    strategy_->after_backward(emb);
}

// The losses are summed on the host after the whole pass is queued: the sum waits for the device, and
// taken at the head it stalled the launches of the backward behind the forward. Between the upload and the
// sums the pass is device work only, the same for every micro-batch of this size and scale: with
// kernels.cuda_graphs it is recorded once and replayed (kernels/graph.h).
LossSums Model::forward_backward(const int32_t* tokens, int batch, float dloss_scale, const uint8_t* keep,
                                 const uint8_t* label_mask) {
    upload_tokens(tokens, batch, keep, label_mask);
    upload_dropout_keys(batch);  // a training pass: its adapters' dropout
    uint32_t scale_bits = 0;
    std::memcpy(&scale_bits, &dloss_scale, sizeof scale_bits);
    graphs_.run(static_cast<uint64_t>(batch) << 32 | scale_bits, [&] {
        forward_blocks(batch, true);
        head(batch, dloss_scale, true);
        backward_blocks(batch);
    });
    const size_t n = static_cast<size_t>(batch) * T_;
    LossSums sums;
    sums.ce = backend_->sum(act(losses_), n);
    if (z_loss_ > 0.0f) sums.z = backend_->sum(act(z_losses_), n);
    return sums;
}

void Model::forward_logits(const int32_t* tokens, int batch, const LogitsSink& sink) {
    upload_tokens(tokens, batch, nullptr);
    forward_blocks(batch, false);
    head(batch, 0.0f, false, &sink);
}

double Model::forward_loss(const int32_t* tokens, int batch, const uint8_t* label_mask) {
    upload_tokens(tokens, batch, nullptr, label_mask);
    forward_blocks(batch, false);
    head(batch, 0.0f, false);
    return backend_->sum(act(losses_), static_cast<size_t>(batch) * T_);
}

void Model::forward_token_losses(const int32_t* tokens, int batch, float* losses) {
    upload_tokens(tokens, batch, nullptr);
    forward_blocks(batch, false);
    head(batch, 0.0f, false);
    backend_->copy_device_to_host(losses, act(losses_), static_cast<size_t>(batch) * T_ * sizeof(float));
}

LossSums accumulate_gradients(Strategy& strategy, Model& model, long accumulation, int batch, float dloss_scale,
                              const std::function<MicroBatchTokens(long)>& tokens_for) {
    strategy.zero_grads();
    strategy.begin_step(static_cast<int>(accumulation));
    LossSums loss_sum;
    for (long k = 0; k < accumulation; ++k) {
        const trace::Span span("micro-batch", trace::active() ? fmt::format("micro-batch {}", k) : std::string());
        strategy.begin_micro_batch(static_cast<int>(k));
        const MicroBatchTokens mb = tokens_for(k);
        model.set_dropout_rows(mb.step_key, mb.instances);
        loss_sum += model.forward_backward(mb.tokens, batch, dloss_scale, mb.keep, mb.label_mask);
    }
    const trace::Span span("comm", "finish backward");
    strategy.finish_backward();
    return loss_sum;
}

}  // namespace trainer
