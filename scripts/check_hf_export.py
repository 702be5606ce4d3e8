#!/usr/bin/env python3
"""Checks an exported Hugging Face directory against the trainer, where `transformers` is installed.

`trainer logits --config C --init-from DIR --data TOKENS --instances K` writes the trainer's logits of the
first K instances of the token file (fp32 on the CPU); transformers' AutoModelForCausalLM loads DIR and
computes its logits of the same tokens. Every logit must agree to --atol + --rtol * |logit| (fp32 both, summed
in different orders), and so must the mean cross-entropy. Works for GPT2LMHeadModel, OlmoForCausalLM,
Olmo2ForCausalLM and LlamaForCausalLM, grouped-query attention included (whichever config.json names).

With --adapter ADAPTER (a PEFT adapter directory from `trainer export --adapter`), transformers' model is DIR with
the adapter loaded by peft (PeftModel.from_pretrained), and the trainer's logits are DIR's with the same adapter read
through lora.init_from; the config's lora.r, lora.alpha, lora.use_rslora and lora.targets come from the adapter's
adapter_config.json (its target_modules, as PEFT names them).

With --generate N, greedy decoding is compared too: `trainer generate --init-from DIR` continues the first
--prompt-length tokens of each instance by N tokens (one batch, no stop at EOS), and transformers' generate
(do_sample=False, exactly N new tokens) continues the same prompts; the tokens must be the same.

Usage: python3 scripts/check_hf_export.py --config C --dir DIR --data TOKENS [--instances 4] [--trainer BIN]
                                          [--atol 1e-4] [--rtol 1e-4] [--generate N] [--prompt-length 8]
                                          [--adapter ADAPTER]
  TOKENS: a token file the trainer reads (raw memmap as the config's data.memmap_dtype, .npy, or llm.c .bin);
  DIR from `trainer export --checkpoint CK -o DIR`. Prints one JSON line; exit status 0 when they agree.
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
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--trainer", default=os.environ.get("TRAINER_BIN", "build/bin/trainer"))
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--generate", type=int, default=0, help="also compare N greedy tokens (0: no)")
    ap.add_argument("--prompt-length", type=int, default=8)
    ap.add_argument("--adapter", help="a PEFT adapter directory on top of --dir (loaded with peft)")
    a = ap.parse_args()

    lora = []  # the trainer's flags for the adapter
    if a.adapter:
        with open(os.path.join(a.adapter, "adapter_config.json")) as f:
            ac = json.load(f)
        lora = ["--set", "lora.enabled=true", "--set", f"lora.init_from={a.adapter}", "--set", f"lora.r={ac['r']}",
                "--set", f"lora.alpha={ac['lora_alpha']}", "--set",
                f"lora.use_rslora={'true' if ac.get('use_rslora') else 'false'}", "--set",
                # GPT-2's attention output is attn.c_proj in PEFT's names, c_proj in lora.targets
                "lora.targets=" + json.dumps(sorted("c_proj" if t == "attn.c_proj" else t
                                                    for t in ac["target_modules"])), "--set", "lora.dropout=0"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npy")
        subprocess.run([a.trainer, "logits", "--config", a.config, "--init-from", a.dir, "--data", a.data,
                        "--device", "cpu", "--precision", "fp32", "--instances", str(a.instances), "-o", out] + lora,
                       check=True, stdout=subprocess.DEVNULL)
        ours = torch.from_numpy(np.load(out))
    cfg = json.load(open(a.config))
    L = cfg["model"]["max_sequence_length"]
    tokens = read_tokens(a.data, cfg.get("data", {}).get("memmap_dtype", "uint16"))
    batch = torch.from_numpy(np.ascontiguousarray(tokens[: a.instances * L].reshape(a.instances, L)))

    try:  # `dtype` since transformers 4.56, which deprecates `torch_dtype`
        model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32).eval()
    except TypeError:
        model = AutoModelForCausalLM.from_pretrained(a.dir, torch_dtype=torch.float32).eval()
    architecture = model.config.architectures[0]
    if a.adapter:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, a.adapter).eval()
    with torch.no_grad():
        theirs = model(batch[:, :-1]).logits.float()
    if theirs.shape != ours.shape:
        print(json.dumps({"error": f"logits of shape {tuple(theirs.shape)} from transformers, "
                                   f"{tuple(ours.shape)} from the trainer"}))
        sys.exit(1)
    diff = (theirs - ours).abs()
    bad = int((diff > a.atol + a.rtol * theirs.abs()).sum())
    targets = batch[:, 1:].reshape(-1)
    ce = lambda x: torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]).double(), targets).item()
    loss_ours, loss_theirs = ce(ours), ce(theirs)
    loss_rel = abs(loss_ours - loss_theirs) / abs(loss_theirs)
    result = {"architecture": architecture, "adapter": a.adapter, "instances": a.instances, "positions": L - 1,
              "max_abs_logit_difference": diff.max().item(), "max_abs_logit": theirs.abs().max().item(),
              "logits_out_of_tolerance": bad, "trainer_loss": loss_ours, "transformers_loss": loss_theirs,
              "loss_relative_difference": loss_rel}
    same_tokens = True
    if a.generate > 0 and a.adapter:
        print(json.dumps({"error": "--generate compares the base model only; leave it out with --adapter"}))
        sys.exit(2)
    if a.generate > 0:
        prompts = batch[:, : a.prompt_length]
        cmd = [a.trainer, "generate", "--config", a.config, "--init-from", a.dir, "--device", "cpu", "--precision",
               "fp32", "--max-new-tokens", str(a.generate), "--no-stop-at-eos", "--json", "--tokenizer", "none"]
        for row in prompts.tolist():
            cmd += ["--prompt-ids", ", ".join(str(t) for t in row)]
        lines = [json.loads(x) for x in subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split("\n")
                 if x.strip()]
        ours_ids = [x["ids"] for x in lines if "ids" in x]
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                 max_new_tokens=a.generate, min_new_tokens=a.generate,
                                 pad_token_id=cfg["model"].get("eos_token_id", 0))
        theirs_ids = out[:, a.prompt_length:].tolist()
        same_tokens = ours_ids == theirs_ids
        result.update({"generated_tokens": a.generate, "greedy_tokens_equal": same_tokens,
                       "first_difference": next(([b, i] for b, (x, y) in enumerate(zip(ours_ids, theirs_ids))
                                                 for i, (p, q) in enumerate(zip(x, y)) if p != q), None)})
    print(json.dumps(result))
    sys.exit(0 if bad == 0 and loss_rel <= a.rtol and same_tokens else 1)


if __name__ == "__main__":
    main()
