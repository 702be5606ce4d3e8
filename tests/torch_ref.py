"""PyTorch reference of the trainer's model and training step.

The C++ trainer is checked against fixtures produced from this module (see
tests/make_fixtures.py); scripts/bench_torch.py uses the same model as its
PyTorch peer benchmark.

Everything is built from a config dict in the trainer's JSON format (OLMo key
names): {"model": {...}, "optimizer": {...}, "scheduler": {...},
"max_grad_norm": ..., "global_train_batch_size": ...,
"device_train_microbatch_size": ..., "max_duration": ...}. Unknown keys are
ignored.

Semantics follow OLMo (allenai/OLMo, olmo/model.py and olmo/optim.py):
  * pre-norm blocks: x += attn_out(attn(LN(x))); x += ff_out(act(ff_proj(LN(x))));
    with norm_after (OLMo-2): x += LN(attn_out(attn(x))); x += LN(ff_out(act(ff_proj(x))))
  * LN: LayerNorm, or RMSNorm with layer_norm_type rms (OLMo's RMSLayerNorm), eps layer_norm_eps
  * QK-norm (attention_layer_norm): LN over each token's whole q and whole k before RoPE
  * z-loss (softmax_auxiliary_loss): + auxiliary_loss_multiplier * logsumexp(logits)^2 per token in the
    objective; the reported loss is the cross-entropy
  * fused att_proj (C -> C + 2 KV) split into q, k, v row blocks; with n_kv_heads < n_heads (grouped-query
    attention) k and v have n_kv_heads heads, query head h reading key/value head h // (n_heads / n_kv_heads)
  * RoPE non-interleaved ("rotate_half")
  * SwiGLU: x, gate = ff_proj(x).chunk(2); out = silu(gate) * x
  * loss: cross entropy over all embedding_size logits
  * clipping on the global L2 norm, coef = min(1, max_norm / (norm + 1e-6))
  * AdamW with two groups (decay on Linear weights only, by default)
  * OLMo's LR schedulers, step counted from 1

Parameter names are OLMo's internal names (transformer.wte.weight,
transformer.blocks.N.att_proj.weight, ...). hf_state_dict() / load_hf_state_dict()
convert to and from the Hugging Face names (GPT2LMHeadModel, OlmoForCausalLM,
Olmo2ForCausalLM or LlamaForCausalLM).

Only torch and the Python standard library are used.
"""

import json
import math
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

class ModelConfig:
    """The model section of the config, with the trainer's defaults."""

    def __init__(self, model):
        self.d_model = int(model["d_model"])
        self.n_heads = int(model["n_heads"])
        self.n_layers = int(model["n_layers"])
        self.mlp_ratio = int(model.get("mlp_ratio", 4))
        self.mlp_hidden_size = model.get("mlp_hidden_size")
        self.activation_type = model.get("activation_type", "swiglu")
        self.rope = bool(model.get("rope", False))
        self.rope_theta = float(model.get("rope_theta", 10000))
        self.layer_norm_with_affine = bool(model.get("layer_norm_with_affine", False))
        self.include_bias = bool(model.get("include_bias", False))
        bias_ln = model.get("bias_for_layer_norm")
        self.bias_for_layer_norm = self.include_bias if bias_ln is None else bool(bias_ln)
        self.weight_tying = bool(model.get("weight_tying", True))
        self.vocab_size = int(model["vocab_size"])
        emb = model.get("embedding_size")
        self.embedding_size = self.vocab_size if emb is None else int(emb)
        self.max_sequence_length = int(model["max_sequence_length"])
        self.layer_norm_type = model.get("layer_norm_type", "default")
        self.layer_norm_eps = float(model.get("layer_norm_eps", 1e-5))
        self.attention_layer_norm = bool(model.get("attention_layer_norm", False))
        self.attention_layer_norm_with_affine = bool(model.get("attention_layer_norm_with_affine", True))
        self.norm_after = bool(model.get("norm_after", False))
        if self.layer_norm_type not in ("default", "low_precision", "rms"):
            raise ValueError(f"unsupported layer_norm_type {self.layer_norm_type!r}")

        if self.activation_type not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"unsupported activation_type {self.activation_type!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError("d_model must be divisible by n_heads")
        self.head_size = self.d_model // self.n_heads
        # Grouped-query attention: n_kv_heads key/value heads, each shared by n_heads / n_kv_heads query heads
        # (query head h reads key/value head h // group, HF's repeat_kv order).
        kv = model.get("n_kv_heads")
        self.n_kv_heads = self.n_heads if kv is None else int(kv)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError("n_kv_heads must divide n_heads")
        self.kv_size = self.n_kv_heads * self.head_size

        # Width of ff_proj's output (P) and of ff_out's input (P/2 for SwiGLU).
        if self.mlp_hidden_size is not None:
            self.ff_proj_size = int(self.mlp_hidden_size)
        else:
            self.ff_proj_size = self.mlp_ratio * self.d_model
        if self.activation_type == "swiglu":
            if self.ff_proj_size % 2 != 0:
                raise ValueError("SwiGLU needs an even ff_proj width")
            self.ff_hidden_size = self.ff_proj_size // 2
        else:
            self.ff_hidden_size = self.ff_proj_size

        # Norm parameters: weight when affine, bias when affine and bias_for_layer_norm.
        self.norm_weight = self.layer_norm_with_affine
        self.norm_bias = self.layer_norm_with_affine and self.bias_for_layer_norm
        self.qk_norm_weight = self.attention_layer_norm and self.attention_layer_norm_with_affine
        self.qk_norm_bias = self.qk_norm_weight and self.bias_for_layer_norm


class TrainConfig:
    """The optimizer, scheduler and batch settings of the config."""

    def __init__(self, cfg):
        opt = cfg.get("optimizer", {})
        sch = cfg.get("scheduler", {})
        self.optimizer_name = opt.get("name", "adamw")
        if self.optimizer_name != "adamw":
            raise ValueError(f"unsupported optimizer {self.optimizer_name!r}")
        self.learning_rate = float(opt.get("learning_rate", 1e-4))
        self.betas = tuple(float(b) for b in opt.get("betas", (0.9, 0.999)))
        self.eps = float(opt.get("eps", 1e-8))
        self.weight_decay = float(opt.get("weight_decay", 0.01))
        self.decay_norm_and_bias = bool(opt.get("decay_norm_and_bias", False))
        self.decay_embeddings = bool(opt.get("decay_embeddings", False))

        self.scheduler_name = sch.get("name", "cosine_with_warmup")
        self.t_warmup = int(sch.get("t_warmup", 100))
        self.alpha_f = float(sch.get("alpha_f", 0.1))
        self.warmup_min_lr = sch.get("warmup_min_lr")
        # OLMo keeps the clip warmup in the scheduler section; accept it at top level too.
        gcws = sch.get("grad_clip_warmup_steps", cfg.get("grad_clip_warmup_steps"))
        gcwf = sch.get("grad_clip_warmup_factor", cfg.get("grad_clip_warmup_factor"))
        self.grad_clip_warmup_steps = None if gcws is None else int(gcws)
        self.grad_clip_warmup_factor = None if gcwf is None else float(gcwf)

        t_max = sch.get("t_max")
        self.t_max = None if t_max is None else float(t_max)
        self.z_loss = float(cfg.get("auxiliary_loss_multiplier", 1e-4)) if cfg.get("softmax_auxiliary_loss") else 0.0

        mgn = cfg.get("max_grad_norm")
        self.max_grad_norm = None if mgn is None else float(mgn)
        self.global_train_batch_size = int(cfg["global_train_batch_size"])
        self.device_train_microbatch_size = int(
            cfg.get("device_train_microbatch_size", self.global_train_batch_size))
        self.max_duration = int(cfg["max_duration"])


def load_config(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

class LayerNorm(nn.Module):
    """LayerNorm with an optional weight and an optional bias (eps 1e-5)."""

    def __init__(self, size, with_weight, with_bias, eps=1e-5):
        super().__init__()
        self.size = size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_weight else None
        self.bias = nn.Parameter(torch.zeros(size)) if with_bias else None

    def forward(self, x):
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)


class RMSNorm(LayerNorm):
    """OLMo's RMSLayerNorm: x * rsqrt(mean(x^2) + eps), then * weight (+ bias) where it has them."""

    def forward(self, x):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y


def make_norm(mc, with_weight, with_bias, size=None):
    cls = RMSNorm if mc.layer_norm_type == "rms" else LayerNorm
    return cls(mc.d_model if size is None else size, with_weight, with_bias, mc.layer_norm_eps)


def rotate_half(x):
    """Non-interleaved RoPE helper: (x1, x2) -> (-x2, x1) over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    """One pre-norm transformer block with OLMo's parameter names."""

    def __init__(self, mc):
        super().__init__()
        self.mc = mc
        C = mc.d_model
        self.attn_norm = make_norm(mc, mc.norm_weight, mc.norm_bias)
        self.att_proj = nn.Linear(C, C + 2 * mc.kv_size, bias=mc.include_bias)
        if mc.attention_layer_norm:  # over the whole q (C) and the whole k (kv_size)
            self.q_norm = make_norm(mc, mc.qk_norm_weight, mc.qk_norm_bias)
            self.k_norm = make_norm(mc, mc.qk_norm_weight, mc.qk_norm_bias, mc.kv_size)
        self.attn_out = nn.Linear(C, C, bias=mc.include_bias)
        self.ff_norm = make_norm(mc, mc.norm_weight, mc.norm_bias)
        self.ff_proj = nn.Linear(C, mc.ff_proj_size, bias=mc.include_bias)
        self.ff_out = nn.Linear(mc.ff_hidden_size, C, bias=mc.include_bias)

    def attention(self, q, k, v, rope_cos, rope_sin, causal_mask):
        # q, k, v: (B, T, NH, HS) -> (B, NH, T, HS)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        if rope_cos is not None:
            # cos/sin: (T, HS), broadcast over batch and heads.
            q = q * rope_cos + rotate_half(q) * rope_sin
            k = k * rope_cos + rotate_half(k) * rope_sin
        group = q.size(1) // k.size(1)
        if group > 1:  # every query head its group's key and value head
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scale = 1.0 / math.sqrt(q.size(-1))
        att = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, NH, T, T)
        att = att.masked_fill(causal_mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v)  # (B, NH, T, HS)
        B, NH, T, HS = y.shape
        return y.transpose(1, 2).reshape(B, T, NH * HS)

    def forward(self, x, rope_cos, rope_sin, causal_mask):
        mc = self.mc
        B, T, C = x.shape
        # Attention sub-block.
        h = x if mc.norm_after else self.attn_norm(x)
        qkv = self.att_proj(h)
        q, k, v = qkv.split([C, mc.kv_size, mc.kv_size], dim=-1)
        if mc.attention_layer_norm:  # over each token's whole q and k, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = q.view(B, T, mc.n_heads, mc.head_size)
        k = k.view(B, T, mc.n_kv_heads, mc.head_size)
        v = v.view(B, T, mc.n_kv_heads, mc.head_size)
        att = self.attn_out(self.attention(q, k, v, rope_cos, rope_sin, causal_mask))
        x = x + (self.attn_norm(att) if mc.norm_after else att)
        # MLP sub-block.
        h = x if mc.norm_after else self.ff_norm(x)
        u = self.ff_proj(h)
        if mc.activation_type == "gelu":
            a = F.gelu(u)  # exact (erf)
        elif mc.activation_type == "gelu_tanh":
            a = F.gelu(u, approximate="tanh")
        else:  # swiglu: first half is the value, second half the gate
            xv, g = u.chunk(2, dim=-1)
            a = F.silu(g) * xv
        m = self.ff_out(a)
        return x + (self.ff_norm(m) if mc.norm_after else m)


class Transformer(nn.Module):
    """Container so that parameter names start with 'transformer.' as in OLMo."""

    def __init__(self, mc):
        super().__init__()
        self.wte = nn.Embedding(mc.embedding_size, mc.d_model)
        if not mc.rope:
            self.wpe = nn.Embedding(mc.max_sequence_length, mc.d_model)
        self.blocks = nn.ModuleList([Block(mc) for _ in range(mc.n_layers)])
        self.ln_f = make_norm(mc, mc.norm_weight, mc.norm_bias)
        if not mc.weight_tying:
            self.ff_out = nn.Linear(mc.d_model, mc.embedding_size, bias=mc.include_bias)


class RefModel(nn.Module):
    """The trainer's model. forward(tokens (B, T)) -> logits (B, T, embedding_size)."""

    def __init__(self, model_cfg):
        super().__init__()
        self.mc = model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig(model_cfg)
        self.transformer = Transformer(self.mc)

    def _rope(self, T, device, dtype):
        """cos, sin of shape (T, HS), computed in float64 then cast to dtype."""
        HS = self.mc.head_size
        inv_freq = 1.0 / (self.mc.rope_theta ** (
            torch.arange(0, HS, 2, device=device, dtype=torch.float64) / HS))
        t = torch.arange(T, device=device, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)          # (T, HS/2)
        emb = torch.cat((freqs, freqs), dim=-1)    # (T, HS)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, tokens):
        mc = self.mc
        tr = self.transformer
        B, T = tokens.shape
        if T > mc.max_sequence_length:
            raise ValueError("sequence longer than max_sequence_length")
        x = tr.wte(tokens)
        if not mc.rope:
            pos = torch.arange(T, device=tokens.device)
            x = x + tr.wpe(pos)
        dtype = x.dtype
        if mc.rope:
            rope_cos, rope_sin = self._rope(T, tokens.device, dtype)
        else:
            rope_cos = rope_sin = None
        # True above the diagonal = future positions, masked out.
        causal_mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).triu(1)
        for block in tr.blocks:
            x = block(x, rope_cos, rope_sin, causal_mask)
        x = tr.ln_f(x)
        if mc.weight_tying:
            return F.linear(x, tr.wte.weight)
        return tr.ff_out(x)


# ---------------------------------------------------------------------------
# Initialisation
# ---------------------------------------------------------------------------

def init_normal(model, std=0.02):
    """Plain init: matrices and embeddings N(0, std), norm weights 1, biases 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name or "ln_f" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


def init_fixture(model, generator):
    """Fixture init (large enough to exercise every path):
    matrices and embeddings N(0, 0.1); norm weights 1 + N(0, 0.1); biases N(0, 0.05).
    Draws in named_parameters() order from `generator`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
            if name.endswith("bias"):
                p.copy_(0.05 * noise)
            elif "norm" in name or "ln_f" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


# ---------------------------------------------------------------------------
# Optimizer, scheduler, clipping
# ---------------------------------------------------------------------------

def param_groups(model, tc):
    """OLMo's two groups: weight decay on nn.Linear weights; none on embeddings,
    norm weights and biases unless decay_embeddings / decay_norm_and_bias."""
    decay, no_decay = [], []
    for mod_name, mod in model.named_modules():
        for pn, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pn}" if mod_name else pn
            if pn.endswith("bias"):
                (decay if tc.decay_norm_and_bias else no_decay).append((full, p))
            elif isinstance(mod, nn.Linear):
                decay.append((full, p))
            elif isinstance(mod, LayerNorm):
                (decay if tc.decay_norm_and_bias else no_decay).append((full, p))
            elif isinstance(mod, nn.Embedding):
                (decay if tc.decay_embeddings else no_decay).append((full, p))
            else:
                raise AssertionError(f"unclassified parameter {full}")
    decay.sort(key=lambda t: t[0])
    no_decay.sort(key=lambda t: t[0])
    groups = []
    if decay:
        groups.append({"params": [p for _, p in decay], "param_names": [n for n, _ in decay],
                       "weight_decay": tc.weight_decay})
    if no_decay:
        groups.append({"params": [p for _, p in no_decay], "param_names": [n for n, _ in no_decay],
                       "weight_decay": 0.0})
    return groups


def build_optimizer(model, tc):
    return torch.optim.AdamW(param_groups(model, tc), lr=tc.learning_rate,
                             betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)


def lr_at(tc, step):
    """Learning rate of 1-based step `step`, OLMo's schedulers (t_max: max_duration unless set; it may be a
    fraction, as OLMo's token units give)."""
    lr = tc.learning_rate
    t_warmup = tc.t_warmup
    t_max = tc.t_max if tc.t_max is not None else tc.max_duration
    name = tc.scheduler_name
    if name == "constant":
        # OLMo's ConstantScheduler has no warmup.
        return lr
    warmup_min_lr = tc.warmup_min_lr if tc.warmup_min_lr is not None else 0.1 * lr
    if step < t_warmup:
        return warmup_min_lr + (lr - warmup_min_lr) * step / t_warmup
    if name == "inverse_sqrt_with_warmup":
        # OLMo's InvSqrtWithWarmup does not clamp at t_max.
        return lr * math.sqrt(t_warmup / max(t_warmup, step))
    eta_min = tc.alpha_f * lr
    if step >= t_max:
        return eta_min
    s = step - t_warmup
    span = t_max - t_warmup
    if name == "cosine_with_warmup":
        return eta_min + (lr - eta_min) * (1 + math.cos(math.pi * s / span)) / 2
    if name == "linear_with_warmup":
        return lr - (lr - eta_min) * s / span
    raise ValueError(f"unsupported scheduler {name!r}")


def max_grad_norm_at(tc, step):
    if tc.max_grad_norm is None:
        return None
    if (tc.grad_clip_warmup_steps is not None and tc.grad_clip_warmup_factor is not None
            and step <= tc.grad_clip_warmup_steps):
        return tc.max_grad_norm * tc.grad_clip_warmup_factor
    return tc.max_grad_norm


def global_grad_norm(model):
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            total = total + p.grad.detach().pow(2).sum()
    return torch.as_tensor(total).sqrt()


# ---------------------------------------------------------------------------
# Data and training step
# ---------------------------------------------------------------------------

def load_tokens(path):
    """Raw little-endian uint16 token file -> int64 tensor."""
    with open(path, "rb") as f:
        data = f.read()
    n = len(data) // 2
    return torch.tensor(struct.unpack(f"<{n}H", data[:2 * n]), dtype=torch.long)


def instances(tokens, L):
    """Consecutive L-token instances; the remainder is dropped. -> (N, L)."""
    n = tokens.numel() // L
    return tokens[: n * L].view(n, L)


def batch_for_step(all_instances, tc, step):
    """Global batch of 1-based step `step` (no shuffling): instances [(s-1)G, sG)."""
    G = tc.global_train_batch_size
    return all_instances[(step - 1) * G: step * G]


def forward_backward(model, batch, tc):
    """Loss and accumulated gradients of one global batch (B=G, L tokens each).
    Each micro-batch's loss = sum of token CE / (G * T), plus the z-loss
    z * sum of logsumexp^2 / (G * T) in what is differentiated (OLMo's
    cross_entropy_loss with compute_z_loss); returns the sum of the CE over
    micro-batches (= mean CE over the batch) as a Python float."""
    G, L = batch.shape
    T = L - 1
    micro = tc.device_train_microbatch_size
    total = 0.0
    for start in range(0, G, micro):
        mb = batch[start: start + micro]
        inp, tgt = mb[:, :-1], mb[:, 1:]
        logits = model(inp).reshape(-1, model.mc.embedding_size)
        loss = F.cross_entropy(logits, tgt.reshape(-1), reduction="sum") / (G * T)
        objective = loss
        if tc.z_loss > 0.0:
            objective = objective + tc.z_loss * logits.logsumexp(-1).pow(2).sum() / (G * T)
        objective.backward()
        total += loss.item()
    return total


def train_step(model, optimizer, batch, tc, step):
    """One optimizer step. Returns (loss, pre-clip grad norm, lr)."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, batch, tc)
    norm = global_grad_norm(model)
    max_norm = max_grad_norm_at(tc, step)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
    lr = lr_at(tc, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return loss, norm.item(), lr


# ---------------------------------------------------------------------------
# Hugging Face names
# ---------------------------------------------------------------------------

def hf_flavor(mc):
    """'gpt2' (learned positions, affine norms), 'olmo' (RoPE, SwiGLU, no norm params),
    'olmo2' (norm_after, RMSNorm with weights, QK-norm) or 'llama' (RMSNorm with weights before the sublayers)."""
    if not mc.rope:
        return "gpt2"
    if mc.norm_after:
        return "olmo2"
    return "llama" if mc.layer_norm_type == "rms" else "olmo"


# Olmo2ForCausalLM's per-layer norm weights and the OLMo names they hold: the QK-norms, and the norms after
# attention and the MLP (OLMo's attn_norm and ff_norm with norm_after).
OLMO2_NORMS = (("self_attn.q_norm", "q_norm"), ("self_attn.k_norm", "k_norm"),
               ("post_attention_layernorm", "attn_norm"), ("post_feedforward_layernorm", "ff_norm"))
# LlamaForCausalLM's: the norms before attention and the MLP (OLMo's attn_norm and ff_norm).
LLAMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ff_norm"))


def hf_state_dict(state, mc):
    """OLMo-named tensors -> Hugging Face-named tensors (copies)."""
    C = mc.d_model
    out = {}
    flavor = hf_flavor(mc)
    if flavor == "gpt2":
        # GPT2LMHeadModel: Conv1D weights are (in, out) = transposed Linear weights.
        if not (mc.weight_tying and mc.norm_weight and mc.norm_bias and mc.include_bias):
            raise ValueError("GPT-2 export needs tied weights, affine norms with bias, and biases")
        if mc.activation_type == "swiglu":
            raise ValueError("GPT-2 export needs a gelu MLP")
        out["transformer.wte.weight"] = state["transformer.wte.weight"]
        out["transformer.wpe.weight"] = state["transformer.wpe.weight"]
        for i in range(mc.n_layers):
            s, h = f"transformer.blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("ff_norm", "ln_2")):
                out[h + theirs + ".weight"] = state[s + ours + ".weight"]
                out[h + theirs + ".bias"] = state[s + ours + ".bias"]
            for ours, theirs in (("att_proj", "attn.c_attn"), ("attn_out", "attn.c_proj"),
                                 ("ff_proj", "mlp.c_fc"), ("ff_out", "mlp.c_proj")):
                out[h + theirs + ".weight"] = state[s + ours + ".weight"].t()
                out[h + theirs + ".bias"] = state[s + ours + ".bias"]
        out["transformer.ln_f.weight"] = state["transformer.ln_f.weight"]
        out["transformer.ln_f.bias"] = state["transformer.ln_f.bias"]
    else:
        # OlmoForCausalLM: non-parametric LayerNorm, no biases, SwiGLU. Olmo2ForCausalLM: RMSNorm weights
        # after the sublayers (post_*), QK-norm weights, the final norm's weight. LlamaForCausalLM: RMSNorm
        # weights before the sublayers, the final norm's weight. k and v are kv_size rows each.
        olmo2, llama = flavor == "olmo2", flavor == "llama"
        KV = mc.kv_size
        if mc.include_bias or mc.activation_type != "swiglu":
            raise ValueError("OLMo and Llama export needs no biases and SwiGLU")
        if olmo2 and not (mc.layer_norm_type == "rms" and mc.norm_weight and not mc.norm_bias
                          and mc.qk_norm_weight and not mc.qk_norm_bias):
            raise ValueError("OLMo-2 export needs RMSNorm weights without biases and QK-norm weights")
        if llama and not (mc.norm_weight and not mc.norm_bias and not mc.attention_layer_norm):
            raise ValueError("Llama export needs RMSNorm weights without biases and no QK-norm")
        if flavor == "olmo" and (mc.norm_weight or mc.attention_layer_norm):
            raise ValueError("OLMo export needs non-affine LayerNorms and no QK-norm")
        out["model.embed_tokens.weight"] = state["transformer.wte.weight"]
        for i in range(mc.n_layers):
            s, h = f"transformer.blocks.{i}.", f"model.layers.{i}."
            w = state[s + "att_proj.weight"]
            out[h + "self_attn.q_proj.weight"] = w[0:C]
            out[h + "self_attn.k_proj.weight"] = w[C:C + KV]
            out[h + "self_attn.v_proj.weight"] = w[C + KV:C + 2 * KV]
            out[h + "self_attn.o_proj.weight"] = state[s + "attn_out.weight"]
            w = state[s + "ff_proj.weight"]
            half = w.shape[0] // 2
            out[h + "mlp.up_proj.weight"] = w[:half]     # value
            out[h + "mlp.gate_proj.weight"] = w[half:]   # gate
            out[h + "mlp.down_proj.weight"] = state[s + "ff_out.weight"]
            for theirs, ours in (OLMO2_NORMS if olmo2 else LLAMA_NORMS if llama else ()):
                out[h + theirs + ".weight"] = state[s + ours + ".weight"]
        if olmo2 or llama:
            out["model.norm.weight"] = state["transformer.ln_f.weight"]
        if not mc.weight_tying:
            out["lm_head.weight"] = state["transformer.ff_out.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def olmo_state_from_hf(hf, mc):
    """Inverse of hf_state_dict: Hugging Face-named tensors -> OLMo-named tensors."""
    st = {}
    if hf_flavor(mc) == "gpt2":
        st["transformer.wte.weight"] = hf["transformer.wte.weight"]
        st["transformer.wpe.weight"] = hf["transformer.wpe.weight"]
        for i in range(mc.n_layers):
            s, h = f"transformer.blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("ff_norm", "ln_2")):
                st[s + ours + ".weight"] = hf[h + theirs + ".weight"]
                st[s + ours + ".bias"] = hf[h + theirs + ".bias"]
            for ours, theirs in (("att_proj", "attn.c_attn"), ("attn_out", "attn.c_proj"),
                                 ("ff_proj", "mlp.c_fc"), ("ff_out", "mlp.c_proj")):
                st[s + ours + ".weight"] = hf[h + theirs + ".weight"].t()
                st[s + ours + ".bias"] = hf[h + theirs + ".bias"]
        st["transformer.ln_f.weight"] = hf["transformer.ln_f.weight"]
        st["transformer.ln_f.bias"] = hf["transformer.ln_f.bias"]
    else:
        olmo2, llama = hf_flavor(mc) == "olmo2", hf_flavor(mc) == "llama"
        st["transformer.wte.weight"] = hf["model.embed_tokens.weight"]
        for i in range(mc.n_layers):
            s, h = f"transformer.blocks.{i}.", f"model.layers.{i}."
            st[s + "att_proj.weight"] = torch.cat([hf[h + f"self_attn.{x}_proj.weight"]
                                                   for x in "qkv"], dim=0)
            st[s + "attn_out.weight"] = hf[h + "self_attn.o_proj.weight"]
            st[s + "ff_proj.weight"] = torch.cat([hf[h + "mlp.up_proj.weight"],
                                                  hf[h + "mlp.gate_proj.weight"]], dim=0)
            st[s + "ff_out.weight"] = hf[h + "mlp.down_proj.weight"]
            for theirs, ours in (OLMO2_NORMS if olmo2 else LLAMA_NORMS if llama else ()):
                st[s + ours + ".weight"] = hf[h + theirs + ".weight"]
        if olmo2 or llama:
            st["transformer.ln_f.weight"] = hf["model.norm.weight"]
        if not mc.weight_tying:
            st["transformer.ff_out.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in st.items()}


def load_hf_state_dict(model, hf):
    """Copy Hugging Face-named tensors into the model (dtype converted)."""
    st = olmo_state_from_hf(hf, model.mc)
    own = dict(model.named_parameters())
    if set(st) != set(own):
        raise ValueError(f"name mismatch: {sorted(set(st) ^ set(own))}")
    with torch.no_grad():
        for k, v in st.items():
            if own[k].shape != v.shape:
                raise ValueError(f"{k}: shape {tuple(v.shape)} != {tuple(own[k].shape)}")
            own[k].copy_(v.to(own[k].dtype))


def hf_grads(model):
    """Gradients of the model, in Hugging Face names."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    return hf_state_dict(grads, model.mc)


# ---------------------------------------------------------------------------
# safetensors (written and read by hand: torch 1.13 has no safetensors package)
# ---------------------------------------------------------------------------

def save_safetensors(tensors, path):
    """Write float32 tensors: 8-byte LE header length, JSON header padded with
    spaces to a multiple of 8, then raw LE float32 data in name order."""
    names = sorted(tensors)
    header = {}
    blobs = []
    offset = 0
    for name in names:
        t = tensors[name].detach().to(torch.float32).contiguous().cpu()
        flat = t.reshape(-1).tolist()
        blob = struct.pack(f"<{len(flat)}f", *flat)
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - len(hjson) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path):
    """Read a float32 safetensors file written by save_safetensors -> {name: tensor}."""
    with open(path, "rb") as f:
        data = f.read()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{name}: only F32 supported")
        b, e = info["data_offsets"]
        vals = struct.unpack(f"<{(e - b) // 4}f", data[base + b: base + e])
        out[name] = torch.tensor(vals, dtype=torch.float32).reshape(info["shape"])
    return out
