#!/usr/bin/env python3
"""Merges the per-rank Chrome traces of one run (trainer --trace-file T: T.rank0.json, T.rank1.json, ...)
into one file that Perfetto or chrome://tracing opens with every rank as a process.

Usage: scripts/merge_traces.py OUT.json RANK_TRACE.json [RANK_TRACE.json ...]
       scripts/merge_traces.py --coverage TRACE.json [...]   # per step: the share of the step's time its
                                                             # direct child spans account for
"""
import json
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {path}: not a trainer trace ({e})")


def coverage(events):
    """(step name, step ms, covered ms) for each step span of each rank's compute track, and of its device
    track on a GPU (the same spans when the device ran them, named with the track)."""
    spans = [e for e in events if e.get("ph") == "X"]
    tracks = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows = []
    for step in (e for e in spans if e.get("cat") == "step"):
        begin, end = step["ts"], step["ts"] + step["dur"]
        inside = [e for e in spans if e is not step and e["pid"] == step["pid"] and e["tid"] == step["tid"]
                  and e["ts"] >= begin and e["ts"] + e["dur"] <= end]
        # Direct children: not inside another span that is inside the step.
        children = [c for c in inside
                    if not any(o is not c and o["ts"] <= c["ts"] and c["ts"] + c["dur"] <= o["ts"] + o["dur"]
                               and o["dur"] > c["dur"] for o in inside)]
        covered = sum(c["dur"] for c in children)
        track = tracks.get((step["pid"], step["tid"]), "")
        where = f" ({track})" if track and track != "compute" else ""
        rows.append((f"rank {step['pid']} {step['name']}{where}", step["dur"] / 1e3, covered / 1e3))
    return rows


def main(argv):
    if len(argv) >= 2 and argv[0] == "--coverage":
        events = [e for path in argv[1:] for e in load(path)]
        for name, total, covered in coverage(events):
            print(f"{name}: {total:.3f} ms, direct children {covered:.3f} ms ({100 * covered / total:.1f}%)")
        return 0
    if len(argv) < 2:
        sys.exit(__doc__)
    out, inputs = argv[0], argv[1:]
    events = [e for path in inputs for e in load(path)]
    with open(out, "w") as f:
        json.dump({"displayTimeUnit": "ms", "traceEvents": events}, f)
    print(f"{out}: {len(events)} events from {len(inputs)} rank(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
