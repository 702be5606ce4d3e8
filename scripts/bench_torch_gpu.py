"""PyTorch peer of the trainer's GPU benchmark (scripts/bench_gpu.sh).

Trains the trainer's model (tests/torch_ref.py: OLMo's parameter layout, RoPE,
SwiGLU or GELU, tied or untied head; OLMo-2's RMSNorm after the sublayers,
QK-norm and z-loss; grouped-query attention) on one GPU the way a PyTorch user
would run it fast: bf16 autocast, F.scaled_dot_product_attention (causal, flash;
enable_gqa for shared key/value heads), F.rms_norm,
fused AdamW with the config's betas / eps / decay groups, clip_grad_norm_ at max_grad_norm,
one micro-batch per optimizer step (no accumulation, as bench_gpu.sh runs the
trainer), eager or torch.compile. Prints one JSON line:

  {"impl": "pytorch", "mode": "eager" | "compile", "torch_version": ...,
   "device": ..., "tokens_per_second": ..., "step_time_ms": ..., "steps": ...,
   "micro_batch": ..., "seq_len": ..., "peak_allocated_bytes": ...,
   "peak_reserved_bytes": ...}

Tokens per step = micro_batch * seq_len (L tokens per instance, OLMo's count,
as the trainer reports them; the model runs on L - 1 positions).

Usage:
  python3 scripts/bench_torch_gpu.py --config configs/olmo_1b.json --micro-batch 4 \
      [--seq-len 2048] [--steps 10] [--warmup 3] [--mode eager|compile]
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer JSON config")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=None, help="override max_sequence_length")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--mode", choices=["eager", "compile"], default="eager")
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
    mc = ref.ModelConfig(cfg["model"])
    tc = ref.TrainConfig(cfg)
    L, T = mc.max_sequence_length, mc.max_sequence_length - 1

    ref.Block.attention = sdpa_attention
    if hasattr(F, "rms_norm"):
        ref.RMSNorm.forward = rms_norm
    model = ref.RefModel(mc).to(dev)
    ref.init_normal(model, std=0.02)
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

    step_fn = torch.compile(loss_fn) if args.mode == "compile" else loss_fn
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    total = args.warmup + args.steps
    batches = [torch.randint(mc.vocab_size, (micro, L), generator=gen, device=dev) for _ in range(total)]

    times = []
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
    mean = sum(times) / len(times)
    print(json.dumps({
        "impl": "pytorch",
        "mode": args.mode,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "tokens_per_second": micro * L / mean,
        "step_time_ms": 1000.0 * mean,
        "steps": len(times),
        "micro_batch": micro,
        "seq_len": L,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    }))


if __name__ == "__main__":
    main()
