"""The PEFT peer of the trainer's LoRA on a GPU (dev/gpu_check.sh's lora_peft stage).

Trains LoRA adapters on a Hugging Face LlamaForCausalLM of the trainer config's shape (hidden size, layers, heads and
shared key/value heads, SwiGLU width, RoPE base, tied or untied head) the way a PEFT user runs it fast: the base in
bf16 (frozen), the adapters from peft.get_peft_model(LoraConfig(r, lora_alpha, lora_dropout, target_modules)),
SDPA attention, bf16 autocast, fused AdamW over the adapters, one micro-batch of random tokens a step. The trainer's
counterpart is the same config with lora.enabled (dev/gpu_check.sh runs both).

Prints one JSON line:
  {"impl": "peft", "peft_version": ..., "transformers_version": ..., "torch_version": ..., "device": ...,
   "tokens_per_second": ..., "step_time_ms": ..., "steps": ..., "micro_batch": ..., "seq_len": ...,
   "trainable_parameters": ..., "peak_allocated_bytes": ..., "peak_reserved_bytes": ...}
Tokens per step = micro_batch * seq_len (as the trainer counts them).

Usage:
  python3 scripts/bench_peft_gpu.py --config configs/llama_1b.json --micro-batch 4 [--seq-len 2048] \
      [--steps 10] [--warmup 3] [--r 16] [--alpha 32] [--dropout 0.05] [--targets q_proj,k_proj,...]
"""

import argparse
import json
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer JSON config (a RoPE/SwiGLU model: Llama's shape)")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, default=None, help="override max_sequence_length")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    p.add_argument("--lr", type=float, default=2e-4)
    args = p.parse_args()

    import peft
    import torch
    import transformers

    cfg = json.load(open(args.config))
    m = cfg["model"]
    C = m["d_model"]
    hidden = m.get("mlp_hidden_size") or m.get("mlp_ratio", 4) * C
    L = args.seq_len or m["max_sequence_length"]
    config = transformers.LlamaConfig(
        vocab_size=m.get("embedding_size") or m["vocab_size"], hidden_size=C, intermediate_size=hidden // 2,
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m.get("n_kv_heads") or m["n_heads"], max_position_embeddings=L,
        rms_norm_eps=m.get("layer_norm_eps", 1e-5), rope_theta=m.get("rope_theta", 10000),
        tie_word_embeddings=m.get("weight_tying", False), attention_bias=False, mlp_bias=False,
        torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                       torch_dtype=torch.bfloat16).cuda()
    lora = peft.LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                           target_modules=args.targets.split(","), bias="none", task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    trainable = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)
    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, L), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.time() - t0) / args.steps
    print(json.dumps({
        "impl": "peft", "peft_version": peft.__version__, "transformers_version": transformers.__version__,
        "torch_version": torch.__version__, "device": torch.cuda.get_device_name(),
        "tokens_per_second": args.micro_batch * L / seconds, "step_time_ms": 1e3 * seconds, "steps": args.steps,
        "micro_batch": args.micro_batch, "seq_len": L, "trainable_parameters": sum(q.numel() for q in trainable),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved()}))


if __name__ == "__main__":
    main()
