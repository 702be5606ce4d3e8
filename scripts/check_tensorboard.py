#!/usr/bin/env python3
"""Checks the trainer's TensorBoard event files with TensorBoard's own reader, where `tensorboard` is installed.

TensorBoard's EventAccumulator loads every event file in --dir (a run's tensorboard_dir); each scalar it finds
must be the number of the same name in the metrics file's record of the same step (--metrics, the run's
metrics_file), and every number of every step record must be there: the record flattened as the trainer flattens
it (nested objects and arrays by their path, "peak_memory_bytes_per_rank/1/activations"; "step" is the event's
step; booleans and strings left out), each value rounded to float32 as TensorBoard's scalars are. Prints one
JSON line; exit status 0 when they agree.

Usage: python3 scripts/check_tensorboard.py --dir TENSORBOARD_DIR --metrics METRICS.jsonl
"""
import argparse
import glob
import json
import os
import struct
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def flatten(prefix, value, out):
    if isinstance(value, bool) or isinstance(value, str) or value is None:
        return
    if isinstance(value, (int, float)):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten(k if not prefix else f"{prefix}/{k}", v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            flatten(f"{prefix}/{i}", v, out)


def as_float32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--metrics", required=True)
    a = ap.parse_args()
    files = glob.glob(os.path.join(a.dir, "events.out.tfevents.*"))
    if not files:
        sys.exit(f"error: {a.dir}: no events.out.tfevents.* file")

    expected = {}  # (step, tag) -> value
    for n, line in enumerate(open(a.metrics, encoding="utf-8"), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if "step" not in record or "event" in record:  # the step records; not the summary
            continue
        flat = {}
        for k, v in record.items():
            if k != "step":
                flatten(k, v, flat)
        for tag, v in flat.items():
            expected[(record["step"], tag)] = as_float32(float(v))

    got = {}
    for path in sorted(files):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for ev in acc.Scalars(tag):
                got[(ev.step, tag)] = ev.value

    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if got[k] != expected[k])
    result = {"event_files": len(files), "scalars": len(got), "steps": len({s for s, _ in got}),
              "missing": len(missing), "extra": len(extra), "different": len(wrong),
              "equal": not (missing or extra or wrong) and bool(got)}
    if missing:
        result["first_missing"] = list(missing[0])
    if extra:
        result["first_extra"] = list(extra[0])
    if wrong:
        result["first_different"] = [*wrong[0], expected[wrong[0]], got[wrong[0]]]
    print(json.dumps(result))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
