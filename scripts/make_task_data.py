"""The fine-tuning demo's task (scripts/finetune_demo.sh): chat records asking to write a word in capitals.

Usage: python3 scripts/make_task_data.py OUT_DIR [--train N] [--test N] [--seed S]

Writes OUT_DIR/train.jsonl (chat records for `trainer prepare-data --instruct`: the user's request, the assistant's
answer) and OUT_DIR/test.jsonl (held-out requests and their answers, one JSON object a line: {"prompt", "answer"},
the prompt rendered as the tulu chat template renders a user turn followed by the assistant's prefix). The words are
random strings of 4 to 7 lowercase letters, every one different, so no answer is right for more than one prompt of
the test set and none of them is seen in training.
"""

import json
import os
import random
import sys


def main():
    args = sys.argv[1:]
    if not args or args[0].startswith("--"):
        raise SystemExit(__doc__)
    out, opts = args[0], dict(zip(args[1::2], args[2::2]))
    n_train, n_test = int(opts.get("--train", 4000)), int(opts.get("--test", 400))
    rng = random.Random(int(opts.get("--seed", 7)))
    words = set()
    while len(words) < n_train + n_test:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 7))))
    words = sorted(words)
    rng.shuffle(words)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train.jsonl"), "w") as f:
        for w in words[:n_train]:
            f.write(json.dumps({"messages": [{"role": "user", "content": "capitals: " + w},
                                             {"role": "assistant", "content": w.upper()}]}) + "\n")
    with open(os.path.join(out, "test.jsonl"), "w") as f:
        for w in words[n_train:]:
            f.write(json.dumps({"prompt": "<|user|>\ncapitals: " + w + "\n<|assistant|>\n",
                                "answer": w.upper()}) + "\n")


if __name__ == "__main__":
    main()
