#!/usr/bin/env python3
"""A multiple-choice task from the State of the Union addresses, for the demo's downstream evaluator.

Each item is a short span of an address that stops inside a word, followed by four candidate continuations: the
rest of that word and the --words words after it as the address goes on, and three pieces of the same shape (the end of
a word cut at the same depth, then as many words) drawn from elsewhere in the addresses. The model is right where it
finds the real continuation most likely (acc; len_norm per character). Chance is 1 in 4. Cutting inside a word asks
what a small byte-level model learns first (spelling, then which words go together), so its accuracy rises within
the demo's 150 steps.

The items come from the addresses of --from-year on (2000: the demo's validation text, which its model never trains
on), drawn with a fixed seed, so the file is the same on every machine. Contexts and continuations fit the demo's
129-token byte-level instances with room to spare (--context-bytes + the longest continuation < 128).

Usage: scripts/make_sotu_choices.py [--texts data/sotu/package/data] [--from-year 2000] [--items 400]
                                    [--words 3] [--context-bytes 80] [--seed 1789] [-o data/sotu_choices.jsonl]
"""

import argparse
import glob
import json
import os
import random
import sys


def words_with_offsets(text):
    """(start, end) byte offsets of each whitespace-separated word of `text` (bytes)."""
    spans, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i] in b" \t\r\n":
            i += 1
        start = i
        while i < n and text[i] not in b" \t\r\n":
            i += 1
        if i > start:
            spans.append((start, i))
    return spans


def word(text, span):
    return text[span[0]:span[1]].decode("utf-8", "replace")


def cut_point(w, rng):
    """Where to cut a word: after 2 characters at least and before its last 2; None for a word too short."""
    return rng.randrange(2, len(w) - 1) if len(w) >= 5 else None


def continuation(text, spans, at, cut, words):
    """The rest of word `at` from character `cut`, then the next `words` words, single-spaced."""
    return word(text, spans[at])[cut:] + "".join(" " + word(text, sp) for sp in spans[at + 1:at + 1 + words])


def make_items(docs, items, words, context_bytes, seed):
    rng = random.Random(seed)
    split = [(text, words_with_offsets(text)) for text in docs]
    split = [(t, s) for t, s in split if len(s) > 4 * words + 40]
    if not split:
        raise SystemExit("make_sotu_choices.py: the addresses are too short to draw items from")
    out, seen = [], set()
    while len(out) < items:
        text, spans = rng.choice(split)
        at = rng.randrange(20, len(spans) - words - 1)  # the word the context stops inside
        cut = cut_point(word(text, spans[at]), rng)
        if cut is None or not word(text, spans[at]).isalpha():
            continue
        # The context: whole words before it, at most context_bytes of them, then the word's first `cut` characters.
        begin = at
        while begin > 0 and spans[at][0] - spans[begin - 1][0] <= context_bytes:
            begin -= 1
        context = "".join(word(text, sp) + " " for sp in spans[begin:at]) + word(text, spans[at])[:cut]
        gold = continuation(text, spans, at, cut, words)
        if (context, gold) in seen:
            continue
        candidates = [gold]
        while len(candidates) < 4:
            t, sp = rng.choice(split)
            k = rng.randrange(0, len(sp) - words - 1)
            w = word(t, sp[k])
            if len(w) <= cut + 1 or not w.isalpha():
                continue  # the distractor's word is cut at the same depth, leaving a piece of it
            other = continuation(t, sp, k, cut, words)
            if other not in candidates:
                candidates.append(other)
        if max(len(c.encode()) for c in candidates) + len(context.encode()) > 127:
            continue  # a rare run of long words: draw again rather than cut the context
        rng.shuffle(candidates)
        seen.add((context, gold))
        out.append({"context": context, "continuations": candidates, "label": candidates.index(gold)})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--texts", default="data/sotu/package/data")
    p.add_argument("--from-year", type=int, default=2000)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--words", type=int, default=3)
    p.add_argument("--context-bytes", type=int, default=80)
    p.add_argument("--seed", type=int, default=1789)
    p.add_argument("-o", "--output", default="data/sotu_choices.jsonl")
    a = p.parse_args()
    paths = sorted(f for f in glob.glob(os.path.join(a.texts, "*.txt"))
                   if os.path.basename(f)[:4].isdigit() and int(os.path.basename(f)[:4]) >= a.from_year)
    if not paths:
        raise SystemExit(f"make_sotu_choices.py: no address of {a.from_year} or later in {a.texts} "
                         "(scripts/fetch_sotu.sh fetches them)")
    docs = []
    for path in paths:
        with open(path, "rb") as f:
            docs.append(f.read())
    items = make_items(docs, a.items, a.words, a.context_bytes, a.seed)
    tmp = a.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    os.replace(tmp, a.output)
    print(f"wrote {a.output}: {len(items)} items of 4 candidates from {len(paths)} addresses "
          f"({a.from_year} on), chance 0.25", file=sys.stderr)


if __name__ == "__main__":
    main()
