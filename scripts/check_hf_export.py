#!/usr/bin/env python3
"""Checks an exported Hugging Face directory against the trainer, where `transformers` is installed.

The trainer's first step reports the loss of its initial weights (the forward runs before the update), so
`trainer --init-from DIR --max-duration 1 --set data.shuffle=false` gives the mean cross entropy of the
first global batch of the token file; transformers' AutoModelForCausalLM loads DIR and computes the same
mean over the same instances. The two must agree to --rtol (fp32 both; they sum in different orders).

Usage: python3 scripts/check_hf_export.py --config C --dir DIR --data TOKENS [--trainer BIN] [--rtol 1e-5]
  TOKENS: a token file the trainer reads (raw uint16 memmap, .npy, or llm.c .bin); DIR from
  `trainer export --checkpoint CK -o DIR`. Exit status 0 when they agree, 1 when not.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def read_tokens(path, dtype):
    if path.endswith(".npy"):
        return np.load(path, mmap_mode="r").astype(np.int64)
    raw = np.fromfile(path, dtype=np.uint8)
    head = raw[:12].view(np.int32) if raw.size >= 1024 else None
    if head is not None and head[0] == 20240520:  # llm.c shard: 256 int32 header, then uint16 tokens
        return raw[1024:].view(np.uint16)[: head[2]].astype(np.int64)
    return raw.view(np.uint16 if dtype == "uint16" else np.uint32).astype(np.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/bin/trainer"))
    ap.add_argument("--rtol", type=float, default=1e-5)
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        subprocess.run([a.trainer, "--config", a.config, "--init-from", a.dir, "--data", a.data, "--device", "cpu",
                        "--precision", "fp32", "--max-duration", "1", "--set", "data.shuffle=false",
                        "--metrics-file", metrics], check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(l) for l in open(metrics) if '"step"' in l]
    trainer_loss = rows[0]["loss"]
    cfg = json.load(open(a.config))
    L = cfg["model"]["max_sequence_length"]
    G = cfg["global_train_batch_size"]
    tokens = read_tokens(a.data, cfg.get("data", {}).get("memmap_dtype", "uint16"))
    batch = torch.from_numpy(np.ascontiguousarray(tokens[: G * L].reshape(G, L)))

    model = AutoModelForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits.float()
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    hf_loss = hf_loss.item()
    rel = abs(hf_loss - trainer_loss) / abs(trainer_loss)
    print(json.dumps({"architecture": model.config.architectures[0], "instances": G, "positions": L - 1,
                      "trainer_loss": trainer_loss, "transformers_loss": hf_loss, "relative_difference": rel}))
    sys.exit(0 if rel <= a.rtol else 1)


if __name__ == "__main__":
    main()
