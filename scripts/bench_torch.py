"""PyTorch peer of the trainer's CPU benchmark.

Trains the trainer's model (the reference in tests/torch_ref.py: fused qkv
Linear, F.layer_norm, F.gelu / SwiGLU, masked-softmax attention, F.cross_entropy,
torch.autograd) in float32 on random token ids, one micro-batch per optimizer
step (no accumulation), with AdamW (config betas / eps / weight-decay groups),
clipping at max_grad_norm and the config's LR schedule, and prints one JSON line:

  {"impl": "pytorch", "torch_version": ..., "threads": ..., "tokens_per_second": ...,
   "step_time_ms": ..., "steps": ..., "micro_batch": ..., "seq_len": ...}

Tokens per step = micro_batch * seq_len (L tokens per instance, OLMo's count;
the model itself runs on L - 1 positions).

Memory allocator: glibc malloc returns PyTorch's large CPU buffers (logits,
activations) to the OS after every use, so each step page-faults them back in
(15-25% system time on a 2-core box). Running with
  MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736
(or jemalloc / tcmalloc via LD_PRELOAD) keeps them cached; say which was used
when quoting a figure.

Usage:
  /usr/bin/python3 scripts/bench_torch.py --config CFG.json --steps 3 \
      [--warmup 2] [--micro-batch 8] [--seq-len 256] [--threads 2] [--seed 0]
"""

import argparse
import copy
import json
import os
import sys
import time

import torch

# The model, optimizer groups and schedule come from the tested reference.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch_ref as ref  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer JSON config (unknown keys ignored)")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="override device_train_microbatch_size")
    p.add_argument("--seq-len", type=int, default=None, help="override max_sequence_length")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    with open(args.config) as f:
        cfg = copy.deepcopy(json.load(f))
    model_cfg = cfg["model"]
    if args.seq_len is not None:
        model_cfg["max_sequence_length"] = args.seq_len
    micro = args.micro_batch
    if micro is None:
        micro = int(cfg.get("device_train_microbatch_size", cfg.get("global_train_batch_size", 1)))
    # One micro-batch per optimizer step: global batch = micro-batch.
    cfg["device_train_microbatch_size"] = micro
    cfg["global_train_batch_size"] = micro
    total_steps = args.warmup + args.steps
    cfg.setdefault("max_duration", total_steps)
    if not isinstance(cfg["max_duration"], int):  # e.g. "2T" token budgets: not needed here
        cfg["max_duration"] = total_steps

    mc = ref.ModelConfig(model_cfg)
    tc = ref.TrainConfig(cfg)
    L = mc.max_sequence_length

    model = ref.RefModel(mc)  # float32
    ref.init_normal(model, std=0.02)
    model.train()
    optimizer = ref.build_optimizer(model, tc)

    # Random instances of L tokens (seeded); a fresh batch every step.
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(mc.vocab_size, (micro, L), generator=gen) for _ in range(total_steps)]

    times = []
    for i in range(total_steps):
        step = i + 1
        t0 = time.perf_counter()
        loss, _, _ = ref.train_step(model, optimizer, batches[i], tc, step)
        dt = time.perf_counter() - t0
        if not (loss == loss):  # NaN guard
            raise RuntimeError(f"loss is NaN at step {step}")
        if i >= args.warmup:
            times.append(dt)

    total = sum(times)
    tokens = micro * L * len(times)
    print(json.dumps({
        "impl": "pytorch",
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "tokens_per_second": tokens / total if total > 0 else None,
        "step_time_ms": 1000.0 * total / len(times) if times else None,
        "steps": len(times),
        "micro_batch": micro,
        "seq_len": L,
    }))


if __name__ == "__main__":
    main()
