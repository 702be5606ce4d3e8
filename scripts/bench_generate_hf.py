#!/usr/bin/env python3
"""`trainer generate` against transformers' `generate` on the same exported model, where transformers is installed.

Both continue the same batch of --batch prompts (--prompt-length tokens each, cut from --data at spread-out
offsets) greedily by exactly --new tokens with a KV cache, on --device in --precision (amp_bf16: transformers in
bfloat16 with its default attention; fp32: float32 both), round after round alternating the two so a slower minute
touches both. The trainer's rate is its own summary's tokens_per_second (new tokens over the decode's seconds, the
model already loaded); transformers' is the new tokens over the seconds of one `generate` call, the model loaded
and warmed by one call first, the device synchronised around it. Prints one JSON line: each one's median tokens/s,
their ratio, and how many of the prompts' continuations are the same tokens (in bf16 the two sum in different
orders, so a near tie may go either way; in fp32 all should agree).

Usage: python3 scripts/bench_generate_hf.py --config C --dir HF_DIR --data TOKENS [--trainer BIN] [--batch 8]
                                            [--prompt-length 32] [--new 256] [--rounds 3] [--device cuda]
                                            [--precision amp_bf16|fp32]
  HF_DIR from `trainer export`; C the config the checkpoint was trained with.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_hf_export import read_tokens  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/bin/trainer"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", choices=["amp_bf16", "fp32"], default="amp_bf16")
    a = ap.parse_args()

    cfg = json.load(open(a.config))
    tokens = read_tokens(a.data, cfg.get("data", {}).get("memmap_dtype", "uint16"))
    vocab = cfg["model"]["vocab_size"]
    span = len(tokens) // a.batch
    if span < a.prompt_length:
        sys.exit(f"error: {a.data}: {len(tokens)} tokens; {a.batch} prompts of {a.prompt_length} need more")
    prompts = np.stack([tokens[i * span: i * span + a.prompt_length] for i in range(a.batch)])
    if prompts.max() >= vocab:
        sys.exit(f"error: {a.data}: token {prompts.max()} is past the model's vocabulary of {vocab}")

    cmd = [a.trainer, "generate", "--config", a.config, "--init-from", a.dir, "--device", a.device, "--precision",
           a.precision, "--max-new-tokens", str(a.new), "--no-stop-at-eos", "--json", "--tokenizer", "none",
           "--set", f"model.max_sequence_length={a.prompt_length + a.new + 1}"]
    for row in prompts.tolist():
        cmd += ["--prompt-ids", ", ".join(str(t) for t in row)]

    dtype = torch.bfloat16 if a.precision == "amp_bf16" else torch.float32
    try:  # `dtype` since transformers 4.56, which deprecates `torch_dtype`
        model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=dtype)
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(a.dir, torch_dtype=dtype)
    model = model.to(a.device).eval()
    ids = torch.from_numpy(prompts.astype(np.int64)).to(a.device)

    def theirs():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True,
                                  max_new_tokens=a.new, min_new_tokens=a.new,
                                  pad_token_id=cfg["model"].get("eos_token_id", 0))

    theirs()  # loads kernels and plans
    ours_rates, their_rates, ours_ids, their_ids = [], [], None, None
    for _ in range(a.rounds):
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        lines = [json.loads(x) for x in out.split("\n") if x.strip()]
        ours_ids = [x["ids"] for x in lines if "ids" in x]
        ours_rates.append(next(x["tokens_per_second"] for x in lines if "tokens_per_second" in x))
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out_ids = theirs()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        their_rates.append(a.batch * a.new / seconds)
        their_ids = out_ids[:, a.prompt_length:].tolist()
    same = sum(x == y for x, y in zip(ours_ids, their_ids))
    ours, them = statistics.median(ours_rates), statistics.median(their_rates)
    print(json.dumps({"batch": a.batch, "prompt_length": a.prompt_length, "new_tokens": a.new, "device": a.device,
                      "precision": a.precision, "rounds": a.rounds, "trainer_tokens_per_second": round(ours, 1),
                      "transformers_tokens_per_second": round(them, 1), "ratio": round(ours / them, 3),
                      "prompts_with_equal_tokens": same, "transformers": __import__("transformers").__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
