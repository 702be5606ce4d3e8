#!/usr/bin/python3
"""Pictures of trainer runs (Debian's python3-matplotlib; run with /usr/bin/python3).

  scripts/plot_metrics.py RUN.jsonl [RUN2.jsonl ...] -o run.png [--labels a,b]
      One figure of four panels, the runs overlaid: training loss (validation loss as markers), learning
      rate and tokens/s/device over steps (with the device's busy share of each measured step, dotted, on
      the right axis), and each run's peak memory of rank 0 by category (MiB, from the summary record).
      Each run is labelled by --labels or its file name.

  scripts/plot_metrics.py --strategies ROWS.json -o strategies.png
      The bar chart of scripts/bench_strategies.sh: tokens/s/device and every rank's peak memory (total,
      split by category for rank 0) per strategy. ROWS.json: [{"label", "tokens_per_second_per_device",
      "peak_memory_bytes_per_rank": [{category: bytes, ...}, ...]}, ...].
"""
import argparse
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("error: plot_metrics.py needs matplotlib: apt-get install python3-matplotlib, then run it with "
             "/usr/bin/python3")

CATEGORIES = ["parameters", "gradients", "optimizer_state", "gathered_units", "activations", "communication"]


def read_run(path):
    steps, summary = [], None
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    j = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"error: {path}:{n}: not a JSON line ({e})")
                if j.get("event") == "summary":
                    summary = j
                elif "step" in j and "loss" in j:
                    steps.append(j)
    except OSError as e:
        sys.exit(f"error: {path}: cannot be read ({e.strerror})")
    if not steps:
        sys.exit(f"error: {path}: no step records (a --metrics-file of the trainer is expected)")
    return steps, summary


def plot_runs(paths, labels, out):
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    (loss_ax, lr_ax), (tps_ax, mem_ax) = ax
    busy_ax = None
    for path, label in zip(paths, labels):
        steps, _ = read_run(path)
        x = [r["step"] for r in steps]
        line, = loss_ax.plot(x, [r["loss"] for r in steps], label=f"{label} train", linewidth=1)
        val = [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
        if val:
            loss_ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label} validation", markersize=4)
        lr_ax.plot(x, [r["lr"] for r in steps], label=label)
        tps_line, = tps_ax.plot(x, [r["tokens_per_second_per_device"] for r in steps], label=label)
        busy = [(r["step"], 100.0 * r["device_busy_fraction"]) for r in steps if "device_busy_fraction" in r]
        if busy:
            if busy_ax is None:
                busy_ax = tps_ax.twinx()
                busy_ax.set(ylabel="device busy %", ylim=(0, 105))
            busy_ax.plot(*zip(*busy), ":", color=tps_line.get_color(), label=f"{label} busy")
    # Memory: each run's peak by category at its end (rank 0), one stacked bar per run.
    peaks = []
    for path, label in zip(paths, labels):
        steps, summary = read_run(path)
        per_rank = summary["peak_memory_bytes_per_rank"] if summary else next(
            (r["peak_memory_bytes_per_rank"] for r in reversed(steps) if "peak_memory_bytes_per_rank" in r), None)
        if per_rank:
            peaks.append((label, per_rank[0]))
    left = [0.0] * len(peaks)
    for i, cat in enumerate(CATEGORIES):
        w = [m.get(cat, 0) / 2**20 for _, m in peaks]
        if any(w):
            mem_ax.barh(range(len(peaks)), w, left=left, label=cat, color=f"C{i}")
            left = [a + b for a, b in zip(left, w)]
    mem_ax.set(yticks=list(range(len(peaks))), yticklabels=[label for label, _ in peaks])
    mem_ax.invert_yaxis()
    loss_ax.set(title="loss", xlabel="step", ylabel="cross entropy")
    lr_ax.set(title="learning rate", xlabel="step")
    tps_ax.set(title="throughput", xlabel="step", ylabel="tokens/s/device")
    mem_ax.set(title="peak memory of rank 0 by category", xlabel="MiB")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_strategies(rows_path, out):
    try:
        rows = json.load(open(rows_path))
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"error: {rows_path}: cannot be read as JSON ({e})")
    labels = [r["label"] for r in rows]
    fig, (tps_ax, mem_ax) = plt.subplots(1, 2, figsize=(14, 0.5 * len(rows) + 2.5))
    y = range(len(rows))
    tps_ax.barh(list(y), [r["tokens_per_second_per_device"] for r in rows], color="tab:blue")
    tps_ax.set(title="tokens/s/device", yticks=list(y), yticklabels=labels)
    tps_ax.invert_yaxis()
    left = [0.0] * len(rows)
    for cat in CATEGORIES:
        w = [r["peak_memory_bytes_per_rank"][0].get(cat, 0) / 2**20 for r in rows]
        if any(w):
            mem_ax.barh(list(y), w, left=left, label=cat)
            left = [a + b for a, b in zip(left, w)]
    for i, r in enumerate(rows):  # every rank's accounted total, as dots
        for m in r["peak_memory_bytes_per_rank"]:
            mem_ax.plot(m["total"] / 2**20, i, "k|", markersize=12)
    mem_ax.set(title="peak memory per rank, MiB", yticks=list(y), yticklabels=[""] * len(rows))
    mem_ax.invert_yaxis()
    mem_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for a in (tps_ax, mem_ax):
        a.grid(axis="x", alpha=0.3)
    fig.text(0.5, 0.005, "memory bars: rank 0, each category at its own peak (the peaks need not coincide); "
             "|: each rank's peak of the accounted total", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", help="metrics files (--metrics-file) of trainer runs")
    ap.add_argument("-o", "--output", required=True, help="PNG to write")
    ap.add_argument("--labels", help="comma-separated labels, one per run (default: file names)")
    ap.add_argument("--strategies", help="rows JSON of scripts/bench_strategies.sh: draw its bar chart")
    a = ap.parse_args()
    if a.strategies:
        plot_strategies(a.strategies, a.output)
    else:
        if not a.runs:
            sys.exit("error: no metrics files given (usage: plot_metrics.py RUN.jsonl... -o run.png)")
        labels = a.labels.split(",") if a.labels else [os.path.splitext(os.path.basename(p))[0] for p in a.runs]
        if len(labels) != len(a.runs):
            sys.exit(f"error: --labels has {len(labels)} labels for {len(a.runs)} runs")
        plot_runs(a.runs, labels, a.output)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
