"""Generate the trainer's correctness fixtures from the PyTorch reference.

Usage (system Python, which has torch 1.13; scripts/install_deps.sh --with-torch installs it):
    /usr/bin/python3 tests/make_fixtures.py [NAME...]     (default: every fixture)

For each config tests/fixtures/{gpt2_tiny,olmo_tiny,olmo2_tiny,llama_tiny,olmo2mqa_tiny}.json
(olmo2mqa: OLMo-2's shape with one key/value head) this writes into tests/fixtures/:
  <name>_tokens.u16         raw little-endian uint16 tokens, G * max_duration
                            instances of L tokens plus 5 tokens of remainder
  <name>_init.safetensors   initial weights, Hugging Face names, float32
  <name>_grads.safetensors  step 1 gradients (whole global batch, before
                            clipping), Hugging Face names, computed in float64,
                            stored as float32
  <name>_expected.json      loss / pre-clip grad norm / lr of every step of a
                            float64 run from the initial weights

and checks that a float32 run agrees with the float64 one on the first steps
and that the loss falls.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch_ref as ref  # noqa: E402

FIXTURES = os.path.join(HERE, "fixtures")
CONFIGS = ["gpt2_tiny", "olmo_tiny", "olmo2_tiny", "llama_tiny", "olmo2mqa_tiny"]
EXTRA_TOKENS = 5          # remainder the trainer must drop
FP32_CHECK_STEPS = 3      # steps whose float32 loss must match float64 to 1e-4 relative


def make_tokens(n_tokens, vocab_size, generator):
    """A random first-order Markov chain over [0, vocab_size): each token has
    a peaked next-token distribution (softmax of Gaussian logits with std 4),
    tilted towards small ids (-1.5 log(1 + id), a Zipf-like marginal), so there
    is something to learn in 20 steps and the loss falls below log(vocab)."""
    logits = 4.0 * torch.randn(vocab_size, vocab_size, generator=generator, dtype=torch.float64)
    logits = logits - 1.5 * torch.log1p(torch.arange(vocab_size, dtype=torch.float64))
    trans = torch.softmax(logits, dim=-1)
    toks = [int(torch.randint(vocab_size, (1,), generator=generator))]
    for _ in range(n_tokens - 1):
        toks.append(int(torch.multinomial(trans[toks[-1]], 1, generator=generator)))
    return toks


def write_u16(tokens, path):
    import struct
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def hf_forward(hf, mc, tokens):
    """Logits from the Hugging Face-named tensors, written independently of
    torch_ref the way HF's GPT2LMHeadModel / OlmoForCausalLM / Olmo2ForCausalLM /
    LlamaForCausalLM compute them (hand-written layer and RMS norms, GELU-tanh, SiLU,
    softmax, and repeat_kv for grouped-query attention). Checks the name mapping
    (Conv1D transposes, q/k/v blocks, up = value / gate halves, Olmo2's q/k norms and
    post-sublayer norms, Llama's norms before the sublayers)."""
    B, T = tokens.shape
    C, NH, HS = mc.d_model, mc.n_heads, mc.head_size
    KVH = mc.n_kv_heads

    def layer_norm(x, w=None, b=None):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5)
        return y * w + b if w is not None else y

    def rms_norm(x, w):  # Olmo2RMSNorm
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + mc.layer_norm_eps))

    def split_heads(*ts):  # (B, T, heads * HS) each -> (B, heads, T, HS) each
        return [t.reshape(B, T, t.shape[-1] // HS, HS).permute(0, 2, 1, 3) for t in ts]

    def repeat_kv(t):  # HF's: (B, KVH, T, HS) -> (B, NH, T, HS), each key/value head for NH / KVH query heads
        return t[:, :, None].expand(B, KVH, NH // KVH, T, HS).reshape(B, NH, T, HS)

    def softmax_attention(q, k, v):
        k, v = repeat_kv(k), repeat_kv(v)
        s = torch.einsum("bhtd,bhsd->bhts", q, k) / HS ** 0.5
        future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
        s = s.masked_fill(future, float("-inf"))
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        p = e / e.sum(-1, keepdim=True)
        y = torch.einsum("bhts,bhsd->bhtd", p, v)
        return y.permute(0, 2, 1, 3).reshape(B, T, C)

    if ref.hf_flavor(mc) == "gpt2":
        x = hf["transformer.wte.weight"][tokens] + hf["transformer.wpe.weight"][:T]
        for i in range(mc.n_layers):
            h = f"transformer.h.{i}."
            a = layer_norm(x, hf[h + "ln_1.weight"], hf[h + "ln_1.bias"])
            qkv = a @ hf[h + "attn.c_attn.weight"] + hf[h + "attn.c_attn.bias"]
            q, k, v = split_heads(qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:])
            y = softmax_attention(q, k, v)
            x = x + y @ hf[h + "attn.c_proj.weight"] + hf[h + "attn.c_proj.bias"]
            m = layer_norm(x, hf[h + "ln_2.weight"], hf[h + "ln_2.bias"])
            u = m @ hf[h + "mlp.c_fc.weight"] + hf[h + "mlp.c_fc.bias"]
            if mc.activation_type == "gelu_tanh":  # HF "gelu_new"
                g = 0.5 * u * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (u + 0.044715 * u ** 3)))
            else:
                g = 0.5 * u * (1 + torch.erf(u / 2 ** 0.5))
            x = x + g @ hf[h + "mlp.c_proj.weight"] + hf[h + "mlp.c_proj.bias"]
        x = layer_norm(x, hf["transformer.ln_f.weight"], hf["transformer.ln_f.bias"])
        return x @ hf["transformer.wte.weight"].t()
    # OlmoForCausalLM: non-parametric norms, RoPE (rotate_half), SwiGLU.
    inv_freq = 1.0 / (mc.rope_theta ** (torch.arange(0, HS, 2, dtype=torch.float64) / HS))
    freqs = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(hf["model.embed_tokens.weight"].dtype), emb.sin().to(
        hf["model.embed_tokens.weight"].dtype)

    def rope(t):
        t1, t2 = t[..., :HS // 2], t[..., HS // 2:]
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    x = hf["model.embed_tokens.weight"][tokens]
    if ref.hf_flavor(mc) == "olmo2":
        # Olmo2ForCausalLM: q/k RMSNorms over the whole projections, RMSNorms after each sublayer.
        for i in range(mc.n_layers):
            h = f"model.layers.{i}."
            q = rms_norm(x @ hf[h + "self_attn.q_proj.weight"].t(), hf[h + "self_attn.q_norm.weight"])
            k = rms_norm(x @ hf[h + "self_attn.k_proj.weight"].t(), hf[h + "self_attn.k_norm.weight"])
            q, k, v = split_heads(q, k, x @ hf[h + "self_attn.v_proj.weight"].t())
            y = softmax_attention(rope(q), rope(k), v) @ hf[h + "self_attn.o_proj.weight"].t()
            x = x + rms_norm(y, hf[h + "post_attention_layernorm.weight"])
            gate = x @ hf[h + "mlp.gate_proj.weight"].t()
            up = x @ hf[h + "mlp.up_proj.weight"].t()
            y = (gate * torch.sigmoid(gate) * up) @ hf[h + "mlp.down_proj.weight"].t()
            x = x + rms_norm(y, hf[h + "post_feedforward_layernorm.weight"])
        return rms_norm(x, hf["model.norm.weight"]) @ hf["lm_head.weight"].t()
    if ref.hf_flavor(mc) == "llama":
        # LlamaForCausalLM: RMSNorms with weights before each sublayer and at the end.
        for i in range(mc.n_layers):
            h = f"model.layers.{i}."
            a = rms_norm(x, hf[h + "input_layernorm.weight"])
            q, k, v = split_heads(a @ hf[h + "self_attn.q_proj.weight"].t(),
                                  a @ hf[h + "self_attn.k_proj.weight"].t(),
                                  a @ hf[h + "self_attn.v_proj.weight"].t())
            x = x + softmax_attention(rope(q), rope(k), v) @ hf[h + "self_attn.o_proj.weight"].t()
            m = rms_norm(x, hf[h + "post_attention_layernorm.weight"])
            gate = m @ hf[h + "mlp.gate_proj.weight"].t()
            up = m @ hf[h + "mlp.up_proj.weight"].t()
            x = x + (gate * torch.sigmoid(gate) * up) @ hf[h + "mlp.down_proj.weight"].t()
        head = hf["lm_head.weight"] if "lm_head.weight" in hf else hf["model.embed_tokens.weight"]
        return rms_norm(x, hf["model.norm.weight"]) @ head.t()
    for i in range(mc.n_layers):
        h = f"model.layers.{i}."
        a = layer_norm(x)
        q, k, v = split_heads(a @ hf[h + "self_attn.q_proj.weight"].t(),
                         a @ hf[h + "self_attn.k_proj.weight"].t(),
                         a @ hf[h + "self_attn.v_proj.weight"].t())
        y = softmax_attention(rope(q), rope(k), v)
        x = x + y @ hf[h + "self_attn.o_proj.weight"].t()
        m = layer_norm(x)
        gate = m @ hf[h + "mlp.gate_proj.weight"].t()
        up = m @ hf[h + "mlp.up_proj.weight"].t()
        x = x + (gate * torch.sigmoid(gate) * up) @ hf[h + "mlp.down_proj.weight"].t()
    x = layer_norm(x)
    return x @ hf["lm_head.weight"].t()


def check_hf_forward(cfg, init_hf, all_instances):
    """RefModel (OLMo names) and hf_forward (HF names) agree in float64."""
    mc = ref.ModelConfig(cfg["model"])
    model = ref.RefModel(mc).double()
    ref.load_hf_state_dict(model, init_hf)
    tokens = all_instances[:4, :-1]
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf_forward({k: v.double() for k, v in init_hf.items()}, mc, tokens)
    err = (ours - theirs).abs().max().item()
    assert err < 1e-10, f"HF-named forward differs from the reference by {err}"
    return err


def run_training(cfg, init_hf, all_instances, dtype):
    """max_duration steps from the given initial weights in `dtype`.
    Returns (losses, grad_norms, lrs, step-1 grads in HF names, step-1 loss)."""
    mc = ref.ModelConfig(cfg["model"])
    tc = ref.TrainConfig(cfg)
    model = ref.RefModel(mc).to(dtype)
    ref.load_hf_state_dict(model, init_hf)
    optimizer = ref.build_optimizer(model, tc)

    # Step 1 gradients of the full global batch (accumulated over micro-batches,
    # before clipping). Recomputed identically inside train_step below.
    batch1 = ref.batch_for_step(all_instances, tc, 1)
    model.zero_grad(set_to_none=True)
    loss1 = ref.forward_backward(model, batch1, tc)
    grads1 = ref.hf_grads(model)
    model.zero_grad(set_to_none=True)

    losses, norms, lrs = [], [], []
    for step in range(1, tc.max_duration + 1):
        batch = ref.batch_for_step(all_instances, tc, step)
        loss, norm, lr = ref.train_step(model, optimizer, batch, tc, step)
        losses.append(loss)
        norms.append(norm)
        lrs.append(lr)
    assert losses[0] == loss1, (losses[0], loss1)
    return losses, norms, lrs, grads1, loss1


def make(name):
    cfg = ref.load_config(os.path.join(FIXTURES, name + ".json"))
    mc = ref.ModelConfig(cfg["model"])
    tc = ref.TrainConfig(cfg)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    L = mc.max_sequence_length
    G = tc.global_train_batch_size
    n_instances = G * tc.max_duration

    # --- tokens -------------------------------------------------------------
    gen = torch.Generator().manual_seed(seed)
    tokens = make_tokens(n_instances * L + EXTRA_TOKENS, mc.vocab_size, gen)
    assert all(0 <= t < mc.vocab_size for t in tokens)
    tok_path = os.path.join(FIXTURES, name + "_tokens.u16")
    write_u16(tokens, tok_path)

    # Read the file back the way the trainer does: the remainder is dropped.
    all_instances = ref.instances(ref.load_tokens(tok_path), L)
    assert all_instances.shape == (n_instances, L)

    # --- initial weights ----------------------------------------------------
    model = ref.RefModel(mc)
    ref.init_fixture(model, torch.Generator().manual_seed(seed + 1))
    init_path = os.path.join(FIXTURES, name + "_init.safetensors")
    ref.save_safetensors(ref.hf_state_dict(dict(model.named_parameters()), mc), init_path)
    # Everything below starts from the float32 values actually written.
    init_hf = ref.load_safetensors(init_path)
    n_params = sum(p.numel() for p in model.parameters())

    # The HF-named weights mean the same model to an independent HF-style forward.
    hf_err = check_hf_forward(cfg, init_hf, all_instances)

    # --- float64 run: the expected values -----------------------------------
    losses, norms, lrs, grads1, loss1 = run_training(cfg, init_hf, all_instances, torch.float64)
    grads_path = os.path.join(FIXTURES, name + "_grads.safetensors")
    ref.save_safetensors(grads1, grads_path)
    expected = {
        "loss_step1": loss1,
        "grad_norm_step1": norms[0],
        "losses": losses,
        "grad_norms": norms,
        "lrs": lrs,
        "dtype": "float64",
    }
    exp_path = os.path.join(FIXTURES, name + "_expected.json")
    with open(exp_path, "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")

    # --- sanity checks ------------------------------------------------------
    # The gradient file's norm is the step-1 pre-clip norm.
    gnorm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads1.values())).item()
    assert abs(gnorm - norms[0]) <= 1e-6 * norms[0], (gnorm, norms[0])
    # Same names and shapes in the init and grads files.
    assert {k: tuple(v.shape) for k, v in init_hf.items()} == \
           {k: tuple(v.shape) for k, v in grads1.items()}

    losses32, norms32, lrs32, _, _ = run_training(cfg, init_hf, all_instances, torch.float32)
    print(f"== {name}: {n_params} parameters, {n_instances} instances of {L} tokens "
          f"(+{EXTRA_TOKENS} dropped), G={G}, micro={tc.device_train_microbatch_size}")
    print(f"  HF-style forward from the init file vs reference: max |diff| {hf_err:.1e}")
    print(f"{'step':>4} {'lr':>10} {'loss f64':>12} {'loss f32':>12} {'rel diff':>9} "
          f"{'norm f64':>10} {'norm f32':>10}")
    for i in range(tc.max_duration):
        rel = abs(losses32[i] - losses[i]) / abs(losses[i])
        print(f"{i + 1:>4} {lrs[i]:>10.6f} {losses[i]:>12.7f} {losses32[i]:>12.7f} {rel:>9.1e} "
              f"{norms[i]:>10.5f} {norms32[i]:>10.5f}")
    for i in range(FP32_CHECK_STEPS):
        rel = abs(losses32[i] - losses[i]) / abs(losses[i])
        assert rel < 1e-4, f"{name}: step {i + 1} float32 loss differs by {rel:.2e} relative"
    assert lrs32 == lrs
    # The loss must fall: the last steps' mean well under the first loss.
    tail = sum(losses[-3:]) / 3
    assert tail < 0.9 * losses[0], f"{name}: loss did not fall ({losses[0]} -> {tail})"
    for p in (tok_path, init_path, grads_path, exp_path):
        print(f"  wrote {os.path.relpath(p, os.path.dirname(HERE))}: {os.path.getsize(p)} bytes")


def main():
    torch.set_num_threads(1)  # deterministic and cheap; the models are tiny
    names = sys.argv[1:] or CONFIGS
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"make_fixtures.py: unknown fixture {name!r}; expected one of {CONFIGS}")
        make(name)


if __name__ == "__main__":
    main()
