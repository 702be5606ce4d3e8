"""PyTorch peer of the trainer's GPU benchmark (scripts/bench_gpu.sh).

Trains the trainer's model (tests/torch_ref.py: OLMo's parameter layout, RoPE,
SwiGLU or GELU, tied or untied head; OLMo-2's RMSNorm after the sublayers,
QK-norm and z-loss; grouped-query attention) on one GPU the way a PyTorch user
would run it fast: bf16 autocast, F.scaled_dot_product_attention (causal, flash;
enable_gqa for shared key/value heads), F.rms_norm,
fused AdamW with the config's betas / eps / decay groups, clip_grad_norm_ at max_grad_norm,
one micro-batch per optimizer step (no accumulation, as bench_gpu.sh runs the
trainer), eager, torch.compile in its default mode, or torch.compile with
mode="max-autotune-no-cudagraphs" (--mode max-autotune; its compile time, the
warm-up steps', reported apart). The RoPE tables are made once per length (the
parity model remakes them every forward).

--fp8: the blocks' Linear layers (att_proj, attn_out, ff_proj, ff_out) on
torch._scaled_mm with tensorwise scales from the current amax (torchao's
"tensorwise" recipe written out: torchao is not on the GPU machine): e4m3 inputs
and weights, e5m2 output gradients, bf16 outputs; the same recipe as the
trainer's amp_fp8. The weight gradient sums over the tokens, padded with zero
rows to a multiple of 16 (_scaled_mm's rule).

--check-parity: no benchmark; the fast model (SDPA, F.rms_norm, cached RoPE)
against tests/torch_ref.py's at step 0 from the same weights, fp32, no compile:
the loss within 1e-5 (relative) and every gradient within 1e-5 of its tensor's
scale; prints one JSON line and exits 1 where they differ.

Prints one JSON line:

  {"impl": "pytorch", "mode": "eager" | "compile" | "max-autotune", "fp8": ...,
   "torch_version": ..., "device": ..., "tokens_per_second": ...,
   "step_time_ms": ..., "steps": ..., "micro_batch": ..., "seq_len": ...,
   "warmup_seconds": ..., "peak_allocated_bytes": ..., "peak_reserved_bytes": ...}

Tokens per step = micro_batch * seq_len (L tokens per instance, OLMo's count,
as the trainer reports them; the model runs on L - 1 positions).

Usage:
  python3 scripts/bench_torch_gpu.py --config configs/olmo_1b.json --micro-batch 4 \
      [--seq-len 2048] [--steps 10] [--warmup 3] [--mode eager|compile|max-autotune] [--fp8]
  python3 scripts/bench_torch_gpu.py --config configs/tiny.json --micro-batch 2 --check-parity
"""

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch_ref as ref  # noqa: E402


def sdpa_attention(self, q, k, v, rope_cos, rope_sin, causal_mask):
    """Block.attention with PyTorch's fused causal attention instead of the masked softmax."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if rope_cos is not None:
        q = q * rope_cos + ref.rotate_half(q) * rope_sin
        k = k * rope_cos + ref.rotate_half(k) * rope_sin
    if k.size(1) == q.size(1):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # grouped-query attention: SDPA reads the shared heads in place (PyTorch 2.5 and later)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    B, NH, T, HS = y.shape
    return y.transpose(1, 2).reshape(B, T, NH * HS)


def rms_norm(self, x):
    """RMSNorm through PyTorch's own op (fused on the GPU) where this PyTorch has it."""
    return F.rms_norm(x, (self.size,), self.weight, self.eps) + (self.bias if self.bias is not None else 0)


_rope_tables = {}


def cached_rope(self, T, device, dtype):
    """RefModel._rope made once per (length, device, dtype)."""
    key = (T, str(device), dtype, self.mc.head_size, self.mc.rope_theta)
    if key not in _rope_tables:
        _rope_tables[key] = _plain_rope(self, T, device, dtype)
    return _rope_tables[key]


_plain_rope = ref.RefModel._rope


def use_fast_ops():
    """The parity model's ops swapped for PyTorch's fast ones (what a skilled PyTorch user writes)."""
    ref.Block.attention = sdpa_attention
    if hasattr(F, "rms_norm"):
        ref.RMSNorm.forward = rms_norm
    ref.RefModel._rope = cached_rope


# ---- FP8 linears through torch._scaled_mm, tensorwise scales from the current amax ----
E4M3, E5M2 = getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)


def to_fp8(x, dtype):
    """x's codes in `dtype` with the per-tensor scale that maps its amax onto the format's largest finite value
    (saturating), and the inverse scale _scaled_mm multiplies by."""
    amax = x.abs().max().float()
    fmax = torch.finfo(dtype).max
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype), scale.reciprocal()


def pad_rows(x, multiple=16):
    pad = (-x.size(0)) % multiple
    return x if pad == 0 else torch.cat([x, x.new_zeros(pad, x.size(1))])


class Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x2 = x.reshape(-1, x.size(-1))
        x8, xs = to_fp8(x2, E4M3)
        w8, ws = to_fp8(w, E4M3)
        # mat2 column-major: w8.t() of the row-major (N, K) weight.
        y = torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        ctx.save_for_backward(x2, w)
        ctx.shape = x.shape
        return y.reshape(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.size(-1))
        g8, gs = to_fp8(dy2, E5M2)
        w8, ws = to_fp8(w, E4M3)
        x8, xs = to_fp8(x2, E4M3)
        # dx (M, K) = dy (M, N) @ w (N, K): mat2 column-major = the (K, N) transpose's .t()
        dx = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16)
        # dw (N, K) = dy^T (N, M) @ x (M, K), M padded to a multiple of 16 with zero rows
        gt = pad_rows(g8.float()).to(E5M2).t().contiguous()
        xp = pad_rows(x8.float()).to(E4M3)
        dw = torch._scaled_mm(gt, xp.t().contiguous().t(), scale_a=gs, scale_b=xs, out_dtype=torch.float32)
        return dx.reshape(ctx.shape), dw.to(w.dtype)


class Fp8Module(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x):
        y = Fp8Linear.apply(x.to(torch.bfloat16), self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def use_fp8_linears(model):
    if E4M3 is None or not hasattr(torch, "_scaled_mm"):
        sys.exit(f"error: --fp8 needs torch._scaled_mm and float8 types (PyTorch {torch.__version__} has not)")
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor < 89:
        sys.exit(f"error: --fp8 needs FP8 tensor cores (compute capability 8.9 or newer); this GPU is {major}.{minor}")
    for block in model.transformer.blocks:
        for name in ("att_proj", "attn_out", "ff_proj", "ff_out"):
            setattr(block, name, Fp8Module(getattr(block, name)))


def check_parity(cfg, micro, seed):
    """Step 0 of the fast model against tests/torch_ref.py's from the same weights, fp32, no compile."""
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mc, tc = ref.ModelConfig(cfg["model"]), ref.TrainConfig(cfg)
    L = mc.max_sequence_length
    batch = torch.randint(mc.vocab_size, (micro, L), generator=torch.Generator().manual_seed(seed)).to(dev)
    results = []
    for fast in (False, True):
        torch.manual_seed(seed)
        model = ref.RefModel(mc).to(dev)
        ref.init_normal(model, std=0.02)
        saved = (ref.Block.attention, ref.RMSNorm.forward, ref.RefModel._rope)
        if fast:
            use_fast_ops()
        try:
            logits = model(batch[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
            if tc.z_loss > 0.0:
                loss = loss + tc.z_loss * logits.reshape(-1, logits.size(-1)).logsumexp(-1).pow(2).mean()
            loss.backward()
        finally:
            ref.Block.attention, ref.RMSNorm.forward, ref.RefModel._rope = saved
        params = sum(p.numel() for p in model.parameters())
        results.append((loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, params))
    (l0, g0, n0), (l1, g1, n1) = results
    worst = max(((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-30)).item() for n in g0)
    loss_rel = abs(l1 - l0) / abs(l0)
    ok = n0 == n1 and loss_rel <= 1e-5 and worst <= 1e-5
    print(json.dumps({"check": "parity", "params": n1, "reference_params": n0, "loss": l1, "reference_loss": l0,
                      "loss_rel": loss_rel, "worst_grad_rel": worst, "ok": ok}))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer JSON config")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=None, help="override max_sequence_length")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--mode", choices=["eager", "compile", "max-autotune"], default="eager")
    p.add_argument("--fp8", action="store_true", help="the blocks' Linear layers on torch._scaled_mm (FP8)")
    p.add_argument("--check-parity", action="store_true", help="step 0 against tests/torch_ref.py, then exit")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_torch_gpu.py needs a CUDA GPU")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")

    with open(args.config) as f:
        cfg = copy.deepcopy(json.load(f))
    if args.seq_len is not None:
        cfg["model"]["max_sequence_length"] = args.seq_len
    micro = args.micro_batch
    cfg["device_train_microbatch_size"] = micro
    cfg["global_train_batch_size"] = micro
    cfg["max_duration"] = args.warmup + args.steps
    if args.check_parity:
        sys.exit(check_parity(cfg, micro, args.seed))
    mc = ref.ModelConfig(cfg["model"])
    tc = ref.TrainConfig(cfg)
    L, T = mc.max_sequence_length, mc.max_sequence_length - 1

    use_fast_ops()
    model = ref.RefModel(mc).to(dev)
    ref.init_normal(model, std=0.02)
    if args.fp8:
        use_fp8_linears(model)
    model.train()
    groups = ref.param_groups(model, tc)
    for g in groups:
        g.pop("param_names", None)
    optimizer = torch.optim.AdamW(groups, lr=tc.learning_rate, betas=tc.betas, eps=tc.eps, fused=True)

    def loss_fn(inp, tgt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inp)
        flat = logits.float().reshape(-1, logits.size(-1))
        loss = F.cross_entropy(flat, tgt.reshape(-1), reduction="sum") / (micro * T)
        if tc.z_loss > 0.0:  # OLMo-2's softmax_auxiliary_loss, as the trainer adds it
            loss = loss + tc.z_loss * flat.logsumexp(-1).pow(2).sum() / (micro * T)
        return loss

    if args.mode == "compile":
        step_fn = torch.compile(loss_fn)
    elif args.mode == "max-autotune":
        step_fn = torch.compile(loss_fn, mode="max-autotune-no-cudagraphs")
    else:
        step_fn = loss_fn
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    total = args.warmup + args.steps
    batches = [torch.randint(mc.vocab_size, (micro, L), generator=gen, device=dev) for _ in range(total)]

    times, warmup_seconds = [], 0.0
    for i in range(total):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = step_fn(batches[i][:, :-1], batches[i][:, 1:])
        loss.backward()
        if tc.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm, foreach=True)
        lr = ref.lr_at(tc, i + 1)
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.step()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if not torch.isfinite(loss):
            sys.exit(f"error: loss is {loss.item()} at step {i + 1}")
        if i >= args.warmup:
            times.append(dt)
        else:
            warmup_seconds += dt
    mean = sum(times) / len(times)
    print(json.dumps({
        "impl": "pytorch",
        "mode": args.mode,
        "fp8": args.fp8,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "tokens_per_second": micro * L / mean,
        "step_time_ms": 1000.0 * mean,
        "steps": len(times),
        "micro_batch": micro,
        "seq_len": L,
        "warmup_seconds": warmup_seconds,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }))


if __name__ == "__main__":
    main()
