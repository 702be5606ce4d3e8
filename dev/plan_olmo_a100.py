#!/usr/bin/env python3
"""OLMo's A100 measurement against `trainer plan` (OLMo's published measurement: OLMo-1B on 4 A100s,
global batch 256, micro-batch 2: DDP 8,034 tokens/s/device, FSDP wrap null mixed 1,747, FSDP
SHARD_GRAD_OP by_block_and_size 1,790, both FSDP rows reducing on every micro-batch).

Prints three tables. First the plan with the a100-40gb entry as it is (NVLink 3 at 230 GB/s, the generic
roofline shares), then with the a100-40gb-pcie entry as it is (the same GPU with no NVLink: PCIe 4.0 at about
20 GB/s of bus bandwidth). Then the plan with the two things the entry cannot know about that machine fitted to two of
the three measurements: the bus bandwidth between the GPUs (intra_node of a copy of the hardware file) to the FSDP wrap
null row, and one factor on the entry's roofline shares (its gemm/attention/memory_efficiency) to the DDP
row; the SHARD_GRAD_OP row is then a prediction, and the plan's recommendation under the fitted machine is
compared with DDP. With --comm-calibration, a fourth table plans the three rows on links measured by
`trainer bench-comm` on a 4-GPU node (the machine a user has, where OLMo's machine is not recorded).

Usage: dev/plan_olmo_a100.py [--trainer build/bin/trainer] [--comm-calibration links.json [--hardware H]
       [--calibration cal.json]]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

MEASURED = {"ddp": 8034, "fsdp_null": 1747, "sgo_bbs": 1790}
ROWS = {
    "ddp": ("DDP", ["--strategy", "ddp", "--set", "ddp.grad_sync_mode=batch"]),
    "fsdp_null": ("FSDP FULL_SHARD wrap null mixed, sync micro_batch",
                  ["--strategy", "fsdp", "--set", "fsdp.sharding_strategy=FULL_SHARD", "--set",
                   "fsdp.wrapping_strategy=null", "--set", "fsdp.precision=mixed", "--set",
                   "fsdp.grad_sync_mode=micro_batch"]),
    "sgo_bbs": ("FSDP SHARD_GRAD_OP by_block_and_size mixed, sync micro_batch",
                ["--strategy", "fsdp", "--set", "fsdp.sharding_strategy=SHARD_GRAD_OP", "--set",
                 "fsdp.wrapping_strategy=by_block_and_size", "--set", "fsdp.precision=mixed", "--set",
                 "fsdp.grad_sync_mode=micro_batch"]),
}
SHARES = (0.7, 0.5, 0.8)  # the a100-40gb entry's GEMM, attention and memory-bound shares (configs/hardware)
SCRATCH = tempfile.mkdtemp(prefix="plan_olmo_a100_")


def edited_hardware(hardware, link, scale):
    """A copy of the hardware file with the fitted link and shares, as a user edits one."""
    with open(os.path.join("configs", "hardware", hardware + ".json")) as f:
        entry = json.load(f)
    if link is not None:
        entry["intra_node"]["bandwidth_gbs"] = link
    if scale is not None:
        for key, share in zip(("gemm", "attention", "memory"), SHARES):
            entry[f"{key}_efficiency"] = share * scale
        entry["attention_efficiency_64"] = None
    path = os.path.join(SCRATCH, f"{hardware}_{link}_{scale}.json")
    with open(path, "w") as f:
        json.dump(entry, f)
    return path


def plan(trainer, row, link=None, scale=None, hardware="a100-40gb", extra=()):
    if link is not None or scale is not None:
        hardware = edited_hardware(hardware, link, scale)
    args = [trainer, "plan", "--config", "configs/olmo_1b.json", "--device", "cuda", "--hardware", hardware,
            "--nproc-per-node", "4", "--json", "--set", "global_train_batch_size=256", "--set",
            "device_train_microbatch_size=2"] + ROWS[row][1] + list(extra)
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: {' '.join(args)}\n{out.stderr}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    given = next(r for r in rows if r["is_config"])
    best = next((r for r in rows if r["recommended"]), None)
    return given, best


def bisect(f, lo, hi, target):
    """x in [lo, hi] (geometric) with f(x) = target, f increasing."""
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def table(trainer, link=None, scale=None, hardware="a100-40gb", extra=()):
    planned = {row: plan(trainer, row, link, scale, hardware, extra) for row in ROWS}  # each row planned once
    tps = {row: given["predicted_tokens_per_second_per_device"] for row, (given, _) in planned.items()}
    print("| row | predicted tokens/s/device | measured | predicted / measured | step ms | exposed comm ms |")
    print("|---|---|---|---|---|---|")
    for row, (label, _) in ROWS.items():
        r = planned[row][0]
        print(f"| {label} | {tps[row]:,.0f} | {MEASURED[row]:,} | {tps[row] / MEASURED[row]:.2f} | "
              f"{r['predicted_step_ms']:,.0f} | {r['predicted_exposed_comm_ms']:,.0f} |")
    print()
    for row in ("fsdp_null", "sgo_bbs"):
        print(f"DDP / {ROWS[row][0]}: predicted {tps['ddp'] / tps[row]:.2f}x, "
              f"measured {MEASURED['ddp'] / MEASURED[row]:.2f}x")
    best = planned["ddp"][1]
    c = best["config"]
    name = " ".join(str(c[k]) for k in ("distributed_strategy", "fsdp.sharding_strategy", "fsdp.wrapping_strategy")
                    if c.get(k) is not None and (k == "distributed_strategy" or c["distributed_strategy"] == "fsdp"))
    sync = c.get("fsdp.grad_sync_mode") if c["distributed_strategy"] == "fsdp" else c.get("ddp.grad_sync_mode")
    best_tps = best["predicted_tokens_per_second_per_device"]
    print(f"recommended: {name}, sync {sync}: {best_tps:,.0f} tokens/s/device, {best_tps / tps['ddp']:.2f}x DDP\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", default="build/bin/trainer")
    ap.add_argument("--comm-calibration", help="also plan on the links `trainer bench-comm` measured on 4 GPUs "
                    "(its --calibration-out), with --hardware's GPU and, where given, --calibration's op times")
    ap.add_argument("--hardware", default="a100-40gb", help="the entry of that last table (default a100-40gb)")
    ap.add_argument("--calibration", help="op times of `trainer bench-kernels --calibration-out` for that table")
    a = ap.parse_args()
    print("### the a100-40gb entry as it is\n")
    table(a.trainer)
    print("### the a100-40gb-pcie entry as it is\n")
    table(a.trainer, hardware="a100-40gb-pcie")
    link, scale = 230.0, 1.0
    for _ in range(4):  # each fit moves the other a little: alternate until both hold
        scale = bisect(lambda s: plan(a.trainer, "ddp", link, s)[0]["predicted_tokens_per_second_per_device"],
                       0.01, 1.4, MEASURED["ddp"])
        link = bisect(lambda b: plan(a.trainer, "fsdp_null", b, scale)[0]["predicted_tokens_per_second_per_device"],
                      0.05, 1000.0, MEASURED["fsdp_null"])
    print(f"### fitted: GPUs linked at {link:.2f} GB/s (bus bandwidth), ops at {scale:.3f} of the entry's roofline "
          f"shares (GEMMs {SHARES[0] * scale:.3f} of the peak)\n")
    print("(fitted to the DDP and the FSDP wrap null rows; the SHARD_GRAD_OP row is predicted)\n")
    table(a.trainer, link, scale)
    if a.comm_calibration:
        extra = ["--comm-calibration", a.comm_calibration] + (["--calibration", a.calibration] if a.calibration else [])
        print(f"### the {a.hardware} entry on the links measured in {a.comm_calibration}"
              f"{', op times from ' + a.calibration if a.calibration else ''}\n")
        table(a.trainer, hardware=a.hardware, extra=extra)


if __name__ == "__main__":
    main()
