// The model's generation path (model.h, "generation with a KV cache"): the block of block_forward on rows at
// positions of their own, attention reading each sequence's cached keys and values instead of a (B, T) batch.
// The same Backend ops as training (norms, GEMMs, activations), with RoPE at each row's position and attention
// with the cache, in fp32 buffers of their own.
#include <algorithm>
#include <cstring>

#include "base/common.h"
#include "core/model/model.h"

namespace trainer {

Model::DecodeCache Model::make_decode_cache(int sequences, int length, int rows) const {
    TRAINER_CHECK(sequences >= 1 && rows >= 1 && length >= 1 && length <= m_.max_sequence_length,
                  "decode cache of {} sequences, {} positions, {} rows", sequences, length, rows);
    DecodeCache c;
    c.sequences = sequences, c.length = length, c.rows = rows;
    const auto floats = [&](size_t n) { return DeviceBuffer(backend_, n * sizeof(float), MemCategory::kOther); };
    const size_t cache = static_cast<size_t>(L_) * sequences * KVH_ * length * HS_, R = static_cast<size_t>(rows);
    c.keys = floats(cache), c.values = floats(cache);
    c.x = floats(R * C_), c.ln = floats(R * C_), c.qkv = floats(R * W_), c.qk = floats(R * (C_ + KV_));
    c.att = floats(R * C_), c.sub = floats(R * C_), c.fch = floats(R * P_), c.fch_act = floats(R * H_);
    c.stats = floats(4 * R), c.logits = floats(R * V_), c.scratch = floats(R * C_);
    c.ids = DeviceBuffer(backend_, 3 * R * sizeof(int32_t), MemCategory::kOther);
    if (has_adapters()) c.lora_work = floats(R * 2 * lora_r_);  // no dropout: the rank-r product only
    return c;
}

void Model::decode(DecodeCache& c, const int32_t* tokens, const int32_t* seqs, const int32_t* positions, int rows,
                   const uint8_t* wanted, const LogitsSink& sink) {
    TRAINER_CHECK(rows >= 1 && rows <= c.rows, "{} rows for a decode cache of {}", rows, c.rows);
    for (int r = 0; r < rows; ++r) {
        TRAINER_CHECK(seqs[r] >= 0 && seqs[r] < c.sequences && positions[r] >= 0 && positions[r] < c.length,
                      "row {}: sequence {} position {} outside the cache", r, seqs[r], positions[r]);
    }
    const int N = rows;
    std::vector<int32_t> ids(3 * static_cast<size_t>(N));
    std::copy_n(tokens, N, ids.begin());
    std::copy_n(seqs, N, ids.begin() + N);
    std::copy_n(positions, N, ids.begin() + 2 * N);
    backend_->copy_host_to_device(c.ids.data(), ids.data(), ids.size() * sizeof(int32_t));
    const int32_t* tok_d = c.ids.i32();
    const int32_t *seq_d = tok_d + N, *pos_d = tok_d + 2 * N;
    float *x = c.x.f32(), *ln = c.ln.f32(), *qkv = c.qkv.f32(), *att = c.att.f32(), *sub = c.sub.f32();
    float *fch = c.fch.f32(), *fch_act = c.fch_act.f32(), *scratch = c.scratch.f32();
    // The norms' statistics, used by nothing after them: a norm's N means (none for RMSNorm) and N rstds, the
    // QK-norm's 2N and 2N.
    float* const stats = c.stats.f32();
    float *mean = m_.rms_norm() ? nullptr : stats, *rstd = stats + N, *qk_rstd = stats + 2 * N;
    const float theta = static_cast<float>(m_.rope_theta);
    const bool tanh_gelu = m_.activation_type == ActivationType::kGeluTanh;
    const size_t per_layer = static_cast<size_t>(c.sequences) * KVH_ * c.length * HS_;

    strategy_->begin_forward(false);
    dropout_on_ = false;
    float* const lora_work = c.lora_work.f32();
    const int emb = layout_.embedding_unit();
    strategy_->before_forward(emb);
    const float* wte = strategy_->unit_params(emb);
    backend_->embedding_forward(x, tok_d, wte, nullptr, N, N, C_);  // wte[token], no position yet (T = N: n % T = n)
    if (!m_.rope) {  // learned positions: wpe[position], gathered as rows of a table, then added
        backend_->embedding_forward(scratch, pos_d, wte + static_cast<size_t>(V_) * C_, nullptr, N, N, C_);
        backend_->residual_forward(x, x, scratch, static_cast<size_t>(N) * C_);
    }
    strategy_->after_forward(emb);

    // A sublayer's input: the pre-norm's output, or with norm_after the stream itself.
    const auto sublayer_input = [&](const float* norm_w, const float* norm_b) -> const float* {
        if (norm_after_) return x;
        backend_->layernorm_forward(ln, mean, rstd, x, norm_w, norm_b, N, C_, norm_eps_, norm_kind_);
        return ln;
    };
    // A sublayer's output Linear (K inputs) added to the stream: x += Linear(in), or with norm_after x +=
    // norm(Linear(in)).
    const auto add_sublayer = [&](int l, LoraLinear linear, const float* in, const float* weight, const float* bias,
                                  int K, const float* norm_w, const float* norm_b) {
        if (!norm_after_) {
            backend_->matmul_residual_forward(x, x, in, weight, bias, N, K, C_, scratch);
            return lora_add(l, linear, x, C_, in, N, lora_work);
        }
        backend_->matmul_forward(sub, in, weight, bias, N, K, C_);
        lora_add(l, linear, sub, C_, in, N, lora_work);
        backend_->norm_residual_forward(x, x, mean, rstd, sub, norm_w, norm_b, N, C_, norm_eps_, norm_kind_);
    };
    for (int l = 0; l < L_; ++l) {
        const BlockLinears linears(backend_, fp8_linears());
        const int u = layout_.block_unit(l);
        open_block(l, false);
        const BlockParams w = block_params(strategy_->unit_params(u), l);
        // Attention: x += attn_out(attn(rope(qk_norm(att_proj(LN1(x)))))), or with norm_after x + LN1(attn_out(...)).
        // Grouped-query attention's shared heads stay shared here: the cache holds KVH heads, and each query head
        // reads its group's.
        const float* in1 = sublayer_input(w.attn_norm_w, w.attn_norm_b);
        backend_->matmul_forward(qkv, in1, w.att_proj_w, w.att_proj_b, N, C_, W_);
        lora_add(l, LoraLinear::kAttProj, qkv, W_, in1, N, lora_work);
        if (qk_norm_) {
            backend_->qk_norm_forward(qkv, c.qk.f32(), mean, qk_rstd, w.q_norm_w, w.q_norm_b, w.k_norm_w, w.k_norm_b, N,
                                      C_, KV_, norm_eps_, norm_kind_);
        }
        if (m_.rope) backend_->rope_forward_at(qkv, pos_d, N, NH_, KVH_, HS_, theta, c.length);
        backend_->attention_with_cache(att, qkv, c.keys.f32() + l * per_layer, c.values.f32() + l * per_layer, seq_d,
                                       pos_d, N, NH_, KVH_, HS_, c.length);
        add_sublayer(l, LoraLinear::kAttnOut, att, w.attn_out_w, w.attn_out_b, C_, w.attn_norm_w, w.attn_norm_b);
        // MLP: x += ff_out(act(ff_proj(LN2(x)))), or with norm_after x + LN2(ff_out(act(ff_proj(x)))).
        const float* in2 = sublayer_input(w.ff_norm_w, w.ff_norm_b);
        if (m_.activation_type == ActivationType::kSwiglu) {
            backend_->matmul_forward(fch, in2, w.ff_proj_w, w.ff_proj_b, N, C_, P_);
            lora_add(l, LoraLinear::kFfProj, fch, P_, in2, N, lora_work);
            backend_->swiglu_forward(fch_act, fch, N, H_);
        } else if (has_lora(LoraLinear::kFfProj)) {
            backend_->matmul_forward(fch, in2, w.ff_proj_w, w.ff_proj_b, N, C_, P_);
            lora_add(l, LoraLinear::kFfProj, fch, P_, in2, N, lora_work);
            backend_->gelu_forward(fch_act, fch, static_cast<size_t>(N) * H_, tanh_gelu);
        } else {
            backend_->matmul_gelu_forward(fch, fch_act, in2, w.ff_proj_w, w.ff_proj_b, N, C_, P_, tanh_gelu);
        }
        add_sublayer(l, LoraLinear::kFfOut, fch_act, w.ff_out_w, w.ff_out_b, H_, w.ff_norm_w, w.ff_norm_b);
        close_block(l, false);
    }

    // The final norm and the LM head on the wanted rows only (a decode step wants every row; a prompt its last).
    const int hu = layout_.head_unit();
    strategy_->before_forward(hu);
    if (m_.weight_tying) strategy_->before_forward(emb);
    const int ha = layout_.head_adapter_unit();  // lm_head's adapter, or -1
    if (ha >= 0) strategy_->before_forward(ha);
    const HeadParams hp = head_params(strategy_->unit_params(hu));
    const float* head_w = m_.weight_tying ? strategy_->unit_params(emb) : hp.w;
    std::vector<int> keep;
    for (int r = 0; r < N; ++r) {
        if (wanted == nullptr || wanted[r]) keep.push_back(r);
    }
    // The wanted rows, gathered to the front of the stream (a prompt's rows are mostly not wanted).
    int K = 0;
    for (int r : keep) {
        if (r != K) {
            backend_->copy_device_to_device(x + static_cast<size_t>(K) * C_, x + static_cast<size_t>(r) * C_,
                                            C_ * sizeof(float));
        }
        ++K;
    }
    if (K > 0) {
        backend_->layernorm_forward(ln, mean, rstd, x, hp.norm_w, hp.norm_b, K, C_, norm_eps_, norm_kind_);
        backend_->matmul_forward(c.logits.f32(), ln, head_w, hp.b, K, C_, V_);
        if (ha >= 0)
            head_lora(strategy_->unit_params(ha), nullptr, c.logits.f32(), ln, nullptr, 0, K, c.lora_work.f32());
        std::vector<float> host(static_cast<size_t>(K) * V_);
        backend_->copy_device_to_host(host.data(), c.logits.f32(), host.size() * sizeof(float));
        for (int k = 0; k < K; ++k) sink(keep[k], 1, host.data() + static_cast<size_t>(k) * V_);
    }
    if (m_.weight_tying) strategy_->after_forward(emb);
    strategy_->after_forward(hu);
    if (ha >= 0) strategy_->after_forward(ha);
}

}  // namespace trainer
