"""Exact match of `trainer generate --json` answers against the fine-tuning demo's test set.

Usage: python3 scripts/score_task.py TEST_JSONL GENERATED_JSONL

TEST_JSONL: scripts/make_task_data.py's test.jsonl ({"prompt", "answer"} a line, in the order the prompts were given);
GENERATED_JSONL: generate's --json output (one object a prompt, then a summary). A prompt scores when its text, up to
the EOS that ends it, is the answer exactly. Prints the score and a few examples; exits 0.
"""

import json
import sys


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    tests = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    outs = [json.loads(line) for line in open(sys.argv[2]) if line.strip()]
    outs = [o for o in outs if o.get("event") != "summary"]
    if len(outs) != len(tests):
        raise SystemExit(f"score_task.py: {len(outs)} generations for {len(tests)} prompts")
    right = sum(1 for t, o in zip(tests, outs) if o["text"] == t["answer"] and o["stopped_at_eos"])
    print(f"exact match: {right} of {len(tests)} ({100.0 * right / len(tests):.1f}%)")
    for t, o in list(zip(tests, outs))[:3]:
        print(f"  {t['prompt'].splitlines()[1]!r} -> {o['text']!r} (expected {t['answer']!r})")


if __name__ == "__main__":
    main()
