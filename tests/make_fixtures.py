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

`make_fixtures.py lora` writes the LoRA fixtures of gpt2_tiny, olmo2_tiny and llama_tiny from their init and
tokens (which it leaves as they are): an adapter on every module of the shape (the untied LM head's, lm_head,
included) (rank 4, alpha 6, A and B drawn
at random so that B A is not 0), in PEFT's names (base_model.model.<module>.lora_A/B.weight):
  <name>_lora_adapter.safetensors  the adapters
  <name>_lora_grads.safetensors    their step-1 gradients (the whole global batch, float64, stored as float32)
  <name>_lora_expected.json        the step-1 loss, r, alpha and the targets
computed by hf_forward with each adapted module's output plus scaling * (x A^T) B^T (PEFT's and LitGPT's LoRA,
no dropout), the base frozen; the gradients are of the loss plus the config's z-loss, as in training; and
tests/fixtures/double_quant.bin, QLoRA's double quantization of absmaxes (make_double_quant says its layout).

`make_fixtures.py downstream` writes tests/fixtures/downstream_tiny.jsonl and downstream_tiny_expected.json: a
multiple-choice task on olmo_tiny's initial weights, each row's log-likelihood and OLMo's metrics (make_downstream).
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


def hf_forward(hf, mc, tokens, lora=None, scaling=1.0):
    """Logits from the Hugging Face-named tensors, written independently of
    torch_ref the way HF's GPT2LMHeadModel / OlmoForCausalLM / Olmo2ForCausalLM /
    LlamaForCausalLM compute them (hand-written layer and RMS norms, GELU-tanh, SiLU,
    softmax, and repeat_kv for grouped-query attention). Checks the name mapping
    (Conv1D transposes, q/k/v blocks, up = value / gate halves, Olmo2's q/k norms and
    post-sublayer norms, Llama's norms before the sublayers). `lora`: {HF module name:
    (A, B)}, each adapted module's output plus scaling * (x A^T) B^T."""
    B, T = tokens.shape

    def lin(x, module):  # nn.Linear's x W^T, plus the module's adapter
        y = x @ hf[module + ".weight"].t()
        if lora is not None and module in lora:
            a, b = lora[module]
            y = y + scaling * ((x @ a.t()) @ b.t())
        return y

    def conv(x, module):  # GPT-2's Conv1D, x W + b (W stored (in, out)), plus the module's adapter
        y = x @ hf[module + ".weight"] + hf[module + ".bias"]
        if lora is not None and module in lora:
            a, b = lora[module]
            y = y + scaling * ((x @ a.t()) @ b.t())
        return y
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
            qkv = conv(a, h + "attn.c_attn")
            q, k, v = split_heads(qkv[..., :C], qkv[..., C:2 * C], qkv[..., 2 * C:])
            y = softmax_attention(q, k, v)
            x = x + conv(y, h + "attn.c_proj")
            m = layer_norm(x, hf[h + "ln_2.weight"], hf[h + "ln_2.bias"])
            u = conv(m, h + "mlp.c_fc")
            if mc.activation_type == "gelu_tanh":  # HF "gelu_new"
                g = 0.5 * u * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (u + 0.044715 * u ** 3)))
            else:
                g = 0.5 * u * (1 + torch.erf(u / 2 ** 0.5))
            x = x + conv(g, h + "mlp.c_proj")
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
            q = rms_norm(lin(x, h + "self_attn.q_proj"), hf[h + "self_attn.q_norm.weight"])
            k = rms_norm(lin(x, h + "self_attn.k_proj"), hf[h + "self_attn.k_norm.weight"])
            q, k, v = split_heads(q, k, lin(x, h + "self_attn.v_proj"))
            y = lin(softmax_attention(rope(q), rope(k), v), h + "self_attn.o_proj")
            x = x + rms_norm(y, hf[h + "post_attention_layernorm.weight"])
            gate = lin(x, h + "mlp.gate_proj")
            up = lin(x, h + "mlp.up_proj")
            y = lin(gate * torch.sigmoid(gate) * up, h + "mlp.down_proj")
            x = x + rms_norm(y, hf[h + "post_feedforward_layernorm.weight"])
        return lin(rms_norm(x, hf["model.norm.weight"]), "lm_head")
    if ref.hf_flavor(mc) == "llama":
        # LlamaForCausalLM: RMSNorms with weights before each sublayer and at the end.
        for i in range(mc.n_layers):
            h = f"model.layers.{i}."
            a = rms_norm(x, hf[h + "input_layernorm.weight"])
            q, k, v = split_heads(lin(a, h + "self_attn.q_proj"), lin(a, h + "self_attn.k_proj"),
                                  lin(a, h + "self_attn.v_proj"))
            x = x + lin(softmax_attention(rope(q), rope(k), v), h + "self_attn.o_proj")
            m = rms_norm(x, hf[h + "post_attention_layernorm.weight"])
            gate = lin(m, h + "mlp.gate_proj")
            up = lin(m, h + "mlp.up_proj")
            x = x + lin(gate * torch.sigmoid(gate) * up, h + "mlp.down_proj")
        if "lm_head.weight" in hf:
            return lin(rms_norm(x, hf["model.norm.weight"]), "lm_head")
        return rms_norm(x, hf["model.norm.weight"]) @ hf["model.embed_tokens.weight"].t()
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
    return lin(x, "lm_head")


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


LORA_CONFIGS = ["gpt2_tiny", "olmo2_tiny", "llama_tiny"]
LORA_R, LORA_ALPHA = 4, 6.0


def lora_modules(mc):
    """Every adaptable module of the shape, HF names, with its (in, out) sizes, as the trainer's base/lora.h."""
    C, KV, P, H = mc.d_model, mc.kv_size, mc.ff_proj_size, mc.ff_hidden_size
    out = []
    for i in range(mc.n_layers):
        if ref.hf_flavor(mc) == "gpt2":
            h = f"transformer.h.{i}."
            out += [(h + "attn.c_attn", C, C + 2 * KV), (h + "attn.c_proj", C, C),
                    (h + "mlp.c_fc", C, P), (h + "mlp.c_proj", H, C)]
        else:
            h = f"model.layers.{i}."
            out += [(h + "self_attn.q_proj", C, C), (h + "self_attn.k_proj", C, KV),
                    (h + "self_attn.v_proj", C, KV), (h + "self_attn.o_proj", C, C),
                    (h + "mlp.gate_proj", C, P // 2), (h + "mlp.up_proj", C, P // 2),
                    (h + "mlp.down_proj", H, C)]
    if not mc.weight_tying:
        out.append(("lm_head", C, mc.embedding_size))  # an untied LM head: one adapter for the model
    return out


def make_lora(name):
    cfg = ref.load_config(os.path.join(FIXTURES, name + ".json"))
    mc = ref.ModelConfig(cfg["model"])
    tc = ref.TrainConfig(cfg)
    L = mc.max_sequence_length
    all_instances = ref.instances(ref.load_tokens(os.path.join(FIXTURES, name + "_tokens.u16")), L)
    init_hf = {k: v.double() for k, v in ref.load_safetensors(os.path.join(FIXTURES, name + "_init.safetensors")).items()}
    gen = torch.Generator().manual_seed(int(cfg.get("seed", 0)) + 77)
    adapters = {}
    for module, fan_in, fan_out in lora_modules(mc):
        a = (torch.rand(LORA_R, fan_in, generator=gen, dtype=torch.float64) * 2 - 1) / fan_in ** 0.5
        b = (torch.rand(fan_out, LORA_R, generator=gen, dtype=torch.float64) * 2 - 1) * 0.2
        adapters[module] = (a.float().double().requires_grad_(), b.float().double().requires_grad_())
    batch = ref.batch_for_step(all_instances, tc, 1)
    logits = hf_forward(init_hf, mc, batch[:, :-1], adapters, LORA_ALPHA / LORA_R)
    flat = logits.reshape(-1, logits.shape[-1])
    loss = torch.nn.functional.cross_entropy(flat, batch[:, 1:].reshape(-1))
    objective = loss  # what is differentiated: with the z-loss where the config has one (OLMo's)
    if tc.z_loss > 0.0:
        objective = objective + tc.z_loss * flat.logsumexp(-1).pow(2).mean()
    objective.backward()
    peft = "base_model.model."
    init = {}
    grads = {}
    for module, (a, b) in adapters.items():
        init[peft + module + ".lora_A.weight"] = a.detach()
        init[peft + module + ".lora_B.weight"] = b.detach()
        grads[peft + module + ".lora_A.weight"] = a.grad
        grads[peft + module + ".lora_B.weight"] = b.grad
    targets = sorted({m.rsplit(".", 1)[-1] if not m.endswith("mlp.c_proj") else "mlp.c_proj"
                      for m, _, _ in lora_modules(mc)})
    paths = [os.path.join(FIXTURES, name + s) for s in
             ("_lora_adapter.safetensors", "_lora_grads.safetensors", "_lora_expected.json")]
    ref.save_safetensors(init, paths[0])
    ref.save_safetensors(grads, paths[1])
    with open(paths[2], "w") as f:
        json.dump({"loss_step1": loss.item(), "r": LORA_R, "alpha": LORA_ALPHA, "targets": targets,
                   "dtype": "float64"}, f, indent=1)
        f.write("\n")
    print(f"== {name} LoRA: {len(adapters)} adapters, loss {loss.item():.7f}")
    for p in paths:
        print(f"  wrote {os.path.relpath(p, os.path.dirname(HERE))}: {os.path.getsize(p)} bytes")


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes' dynamic 8-bit map (functional.create_dynamic_map), the code QLoRA's double quantization stores
    each block's absmax in: for each exponent 10^-6 .. 10^0 the midpoints of a linspace(0.1, 1) of 2^i + 1 points,
    both signs, then 0 and 1, sorted; computed in float32 as torch computes it."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += (10 ** (-(max_exponent_bits - 1) + i) * means).tolist()
        if signed:
            data += (-10 ** (-(max_exponent_bits - 1) + i) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def dquantize(code, x):
    """bitsandbytes' dQuantize (its blockwise kernels' nearest code, non-stochastic): a binary search over the sorted
    256-value code from index 127 in steps of 64, 32, .. 1, then the nearer of the last value and its neighbour by
    their float32 midpoint."""
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))
    pivot, upper_pivot, lower_pivot = 127, 255, 0
    lower, upper = -1.0, 1.0
    val = code[pivot]
    i = 64
    while i > 0:
        if x > val:
            lower_pivot, lower, pivot = pivot, val, pivot + i
        else:
            upper_pivot, upper, pivot = pivot, val, pivot - i
        val = code[pivot]
        i >>= 1
    if upper_pivot == 255:
        upper = code[upper_pivot]
    if lower_pivot == 0:
        lower = code[lower_pivot]
    if x > val:
        return upper_pivot if x > f32((upper + val) * 0.5) else pivot
    return lower_pivot if x < f32((lower + val) * 0.5) else pivot


def make_double_quant():
    """QLoRA's double quantization of a tensor's absmaxes, as bitsandbytes' quantize_4bit(compress_statistics=True)
    does it: the mean taken off (float64 mean rounded to float32 here, where torch's float32 mean sums its own way),
    then blocks of 256 each scaled by the reciprocal of its absmax and coded in the dynamic map. Writes the map and
    one case: tests/fixtures/double_quant.bin, little-endian: the 256-value map (f32), n (u32), the n absmaxes (f32),
    the offset (f32), the n codes (u8), the blocks' absmaxes (f32 each), the n dequantized absmaxes (f32)."""
    import struct
    code = create_dynamic_map()
    values = [float(v) for v in code]
    gen = torch.Generator().manual_seed(2023)
    n = 700  # two full blocks of 256 and a partial one
    absmax = (torch.rand(n, generator=gen, dtype=torch.float64) * 0.2 + 0.01).float()
    absmax[5] = 0.5  # an outlier
    absmax[300] = absmax.double().mean().float()  # exactly the offset: code 0 -> 127's neighbourhood
    offset = float(absmax.double().mean().float())
    centred = [float(torch.tensor(float(a) - offset, dtype=torch.float32)) for a in absmax]
    codes, scales, back = [], [], []
    for b0 in range(0, n, 256):
        block = centred[b0:b0 + 256]
        m = max(abs(v) for v in block)
        scales.append(m)
        inv = float(torch.tensor(1.0 / m, dtype=torch.float32)) if m > 0 else 0.0
        for v in block:
            q = dquantize(values, float(torch.tensor(v * inv, dtype=torch.float32)))
            codes.append(q)
            back.append(float(torch.tensor(float(torch.tensor(values[q] * m, dtype=torch.float32)) + offset,
                                           dtype=torch.float32)))
    path = os.path.join(FIXTURES, "double_quant.bin")
    with open(path, "wb") as f:
        f.write(struct.pack("<256f", *values))
        f.write(struct.pack("<I", n))
        f.write(struct.pack(f"<{n}f", *[float(a) for a in absmax]))
        f.write(struct.pack("<f", offset))
        f.write(bytes(codes))
        f.write(struct.pack(f"<{len(scales)}f", *scales))
        f.write(struct.pack(f"<{n}f", *back))
    print(f"  wrote {os.path.relpath(path, os.path.dirname(HERE))}: {os.path.getsize(path)} bytes")


DOWNSTREAM_TEXT = "abcdefghijklmnopqrstuvwxyz\u00e9\u00df\u20ac\U0001d11e"  # 1-, 2-, 3- and 4-byte characters


def downstream_text(rng):
    """A continuation's text for its lengths: a leading space or none, then 1-6 characters of 1 to 4 UTF-8 bytes."""
    return (" " if rng.random() < 0.7 else "") + "".join(rng.choice(DOWNSTREAM_TEXT) for _ in range(rng.randint(1, 6)))


def make_downstream():
    """tests/fixtures/downstream_tiny.jsonl: multiple-choice examples as token ids of olmo_tiny (vocab 90,
    max_sequence_length 17), each continuation with a text for its lengths, every example with an unconditioned
    context; both forms (a context with candidate continuations, candidate contexts with one continuation), contexts
    long enough to be cut from the left. tests/fixtures/downstream_tiny_expected.json: every row's log-likelihood under
    olmo_tiny's initial weights in float64, and OLMo's metrics (acc, len_norm, pmi_dc, bpb) computed from them here.
    Examples whose best candidates are within 1e-3 under any metric are drawn again, so float32 decides alike."""
    import math
    import random
    cfg = ref.load_config(os.path.join(FIXTURES, "olmo_tiny.json"))
    mc = ref.ModelConfig(cfg["model"])
    model = ref.RefModel(mc).double()
    ref.load_hf_state_dict(model, ref.load_safetensors(os.path.join(FIXTURES, "olmo_tiny_init.safetensors")))
    L, V = mc.max_sequence_length, mc.vocab_size
    rng = random.Random(5150)

    def loglik(context, continuation):
        keep = min(len(context), L - len(continuation))  # the context cut from the left to fit
        seq = context[len(context) - keep:] + continuation
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).double(), dim=-1)[0]
        return sum(logp[keep - 1 + i, t].item() for i, t in enumerate(continuation))

    def ids(n):
        return [rng.randrange(V) for _ in range(n)]

    def best_gap(scores):
        top = sorted(scores, reverse=True)
        return top[0] - top[1]

    examples, rows = [], []
    acc = len_norm = pmi = bits = 0.0
    while len(examples) < 18:
        contexts_form = len(examples) % 3 == 2
        k = rng.choice([2, 3, 4]) if not contexts_form else 2
        texts = [downstream_text(rng) for _ in range(1 if contexts_form else k)]
        conts = [ids(rng.randint(1, 8)) for _ in texts]
        ctxs = [ids(rng.randint(1, 30)) for _ in range(k if contexts_form else 1)]
        uncond = ids(rng.randint(1, 3))
        ctx_of = (lambda c: ctxs[c]) if contexts_form else (lambda c: ctxs[0])
        cont_of = (lambda c: conts[0]) if contexts_form else (lambda c: conts[c])
        text_of = (lambda c: texts[0]) if contexts_form else (lambda c: texts[c])
        ll = [loglik(ctx_of(c), cont_of(c)) for c in range(k)]
        ll_u = [loglik(uncond, cont_of(c)) for c in range(k)]
        scored = [text_of(c)[1:] if text_of(c).startswith(" ") else text_of(c) for c in range(k)]
        per_char = [ll[c] / len(scored[c]) for c in range(k)]
        ratio = [ll[c] / ll_u[c] for c in range(k)]
        if min(best_gap(ll), best_gap(per_char), best_gap(ratio)) < 1e-3:
            continue
        label = rng.randrange(k)
        piece = lambda i, t: {"ids": i, "text": t}  # noqa: E731
        if contexts_form:
            ex = {"contexts": ctxs, "continuation": piece(conts[0], texts[0]), "label": label}
        else:
            ex = {"context": ctxs[0], "continuations": [piece(c, t) for c, t in zip(conts, texts)], "label": label}
        ex["unconditioned_context"] = uncond
        examples.append(ex)
        e = len(examples) - 1
        rows += [{"example": e, "candidate": c, "unconditioned": False, "loglik": ll[c]} for c in range(k)]
        rows += [{"example": e, "candidate": c, "unconditioned": True, "loglik": ll_u[c]} for c in range(k)]
        argmax = lambda s: max(range(k), key=lambda c: (s[c], -c))  # noqa: E731  (the first highest)
        acc += argmax(ll) == label
        len_norm += argmax(per_char) == label
        pmi += argmax(ratio) == label
        bits += -ll[label] / len(scored[label].encode("utf-8")) / math.log(2)
    n = len(examples)
    jsonl = os.path.join(FIXTURES, "downstream_tiny.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    expected = {"rows": rows, "metrics": {"acc": acc / n, "len_norm": len_norm / n, "pmi_dc": pmi / n,
                                          "bpb": bits / n, "examples": n}, "dtype": "float64"}
    out = os.path.join(FIXTURES, "downstream_tiny_expected.json")
    with open(out, "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(f"== downstream: {n} examples, {len(rows)} rows; metrics {expected['metrics']}")
    for p in (jsonl, out):
        print(f"  wrote {os.path.relpath(p, os.path.dirname(HERE))}: {os.path.getsize(p)} bytes")


def main():
    torch.set_num_threads(1)  # deterministic and cheap; the models are tiny
    if sys.argv[1:] == ["downstream"]:
        make_downstream()
        return
    if sys.argv[1:] == ["lora"]:
        for name in LORA_CONFIGS:
            make_lora(name)
        make_double_quant()
        return
    names = sys.argv[1:] or CONFIGS
    for name in names:
        if name not in CONFIGS:
            raise SystemExit(f"make_fixtures.py: unknown fixture {name!r}; expected one of {CONFIGS}")
        make(name)


if __name__ == "__main__":
    main()
