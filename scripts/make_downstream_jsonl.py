#!/usr/bin/env python3
"""Convert the published rows of common multiple-choice tasks into the trainer's downstream format.

Each input row becomes one example the way OLMo's in-loop evaluators (olmo/eval/downstream.py) build it: the same
context, the same candidate continuations (each with its leading space), the same label, and OLMo's unconditioned
context for pmi_dc. The trainer's format is in docs/downstream.md; OLMo's YAML runs an evaluator labelled TASK where
data/downstream/TASK.jsonl exists (or $TRAINER_DOWNSTREAM_DIR/TASK.jsonl).

Tasks and the rows they take (the Hugging Face datasets' columns; the original releases' layouts too where noted):
  piqa           goal, sol1, sol2, label (the original release: --labels FILE, one label a line)
  hellaswag      activity_label, ctx_a, ctx_b, endings, label
  arc_easy, arc_challenge
                 question, choices {text, label}, answerKey (the original: question {stem, choices [{text, label}]})
  boolq          question, passage, answer (true/false; SuperGLUE's label 1/0 too)
  sciq           question, support, distractor1, distractor2, distractor3, correct_answer
  winogrande     sentence (with one "_"), option1, option2, answer ("1" or "2")
  copa           premise, choice1, choice2, question ("cause" or "effect"), label
  openbook_qa    question_stem, choices {text, label}, answerKey (the original: question {stem, choices [...]})

Input: JSON Lines, a JSON array of rows, or {"data": [...]} / {"rows": [...]} (a datasets-server page, each item
{"row": {...}} or the row itself); Parquet (.parquet) where pyarrow is installed. Text is written as text, tokenized by
the trainer with the run's tokenizer; --hf-tokenizer NAME_OR_PATH writes each piece as {"ids", "text"} instead, ids
from that Hugging Face tokenizer (transformers), for a run whose tokenizer the trainer does not have (OLMo-1B's
GPT-NeoX one).

Usage: scripts/make_downstream_jsonl.py --task TASK INPUT [INPUT...] -o OUT.jsonl [--labels FILE] [--limit N]
                                        [--hf-tokenizer NAME_OR_PATH]
"""

import argparse
import json
import os
import re
import sys

ANSWER = "Answer:"


def fail(message):
    raise SystemExit(f"make_downstream_jsonl.py: {message}")


def need(row, key, where):
    if key not in row:
        fail(f"{where}: no \"{key}\" (columns: {', '.join(sorted(row))})")
    return row[key]


def choices_of(row, where):
    """ARC's and OpenBookQA's choices, as (texts, labels), in the Hugging Face or the original layout."""
    if "choices" in row:
        c = row["choices"]
        if isinstance(c, dict):
            return list(c["text"]), list(c["label"])
        return [x["text"] for x in c], [x["label"] for x in c]
    q = need(row, "question", where)
    if isinstance(q, dict) and "choices" in q:
        return [x["text"] for x in q["choices"]], [x["label"] for x in q["choices"]]
    fail(f"{where}: no \"choices\"")


def stem_of(row, key, where):
    q = row.get(key)
    if isinstance(q, str):
        return q
    q = need(row, "question", where)
    return q["stem"] if isinstance(q, dict) else q


def hellaswag_preprocess(text):
    text = text.strip()
    text = text.replace(" [title]", ". ")  # WikiHow's artifacts, as OLMo removes them
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def piqa(row, where):
    return {"context": "Question: " + need(row, "goal", where) + "\nAnswer:",
            "continuations": [" " + need(row, "sol1", where), " " + need(row, "sol2", where)],
            "label": int(need(row, "label", where)), "unconditioned_context": ANSWER}


def hellaswag(row, where):
    ctx_a, ctx_b = need(row, "ctx_a", where), need(row, "ctx_b", where)
    dc = hellaswag_preprocess(ctx_b.capitalize())
    if not dc:
        dc = hellaswag_preprocess(ctx_a).split(" ")[-1]
    return {"context": hellaswag_preprocess(need(row, "activity_label", where) + ": " + ctx_a + " " + ctx_b.capitalize()),
            "continuations": [" " + hellaswag_preprocess(e) for e in need(row, "endings", where)],
            "label": int(need(row, "label", where)), "unconditioned_context": dc}


def arc(row, where):
    texts, labels = choices_of(row, where)
    key = str(need(row, "answerKey", where)).strip()
    key = {"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}.get(key, key)
    labels = [{"1": "A", "2": "B", "3": "C", "4": "D", "5": "E"}.get(str(x), str(x)) for x in labels]
    if key not in labels:
        fail(f"{where}: answerKey {key!r} is none of the choices' labels {labels}")
    return {"context": "Question: " + stem_of(row, "question", where) + "\nAnswer:",
            "continuations": [" " + t for t in texts], "label": labels.index(key), "unconditioned_context": ANSWER}


def boolq(row, where):
    if "answer" in row:
        yes = bool(row["answer"])
    else:
        yes = int(need(row, "label", where)) == 1
    return {"context": need(row, "passage", where) + "\nQuestion: " + need(row, "question", where) + "?\nAnswer:",
            "continuations": [" yes", " no"], "label": 0 if yes else 1, "unconditioned_context": ANSWER}


def sciq(row, where):
    return {"context": need(row, "support", where).strip() + "\nQuestion: " + need(row, "question", where) +
            "\nAnswer:",
            "continuations": [" " + need(row, k, where) for k in ("distractor1", "distractor2", "distractor3",
                                                                  "correct_answer")],
            "label": 3, "unconditioned_context": ANSWER}


def winogrande(row, where):
    sentence = need(row, "sentence", where)
    if sentence.count("_") != 1:
        fail(f"{where}: the sentence has {sentence.count('_')} \"_\"; expected one, where an option goes")
    at = sentence.index("_")
    options = [need(row, "option1", where), need(row, "option2", where)]
    return {"contexts": [sentence[:at] + o for o in options], "continuation": " " + sentence[at + 1:].strip(),
            "label": int(need(row, "answer", where)) - 1, "unconditioned_contexts": options}


def copa(row, where):
    connector = "because" if need(row, "question", where) == "cause" else "therefore"
    lower = lambda c: c[0].lower() + c[1:]  # noqa: E731
    return {"context": need(row, "premise", where).strip()[:-1] + " " + connector,
            "continuations": [" " + lower(need(row, "choice1", where)), " " + lower(need(row, "choice2", where))],
            "label": int(need(row, "label", where)), "unconditioned_context": connector}


def openbook_qa(row, where):
    texts, labels = choices_of(row, where)
    stem = stem_of(row, "question_stem", where)
    key = str(need(row, "answerKey", where)).strip()
    return {"context": stem, "continuations": [" " + t for t in texts],
            "label": ["A", "B", "C", "D"].index(key), "unconditioned_context": stem.strip().split(" ")[-1]}


TASKS = {"piqa": piqa, "hellaswag": hellaswag, "arc_easy": arc, "arc_challenge": arc, "boolq": boolq, "sciq": sciq,
         "winogrande": winogrande, "copa": copa, "openbook_qa": openbook_qa}


def read_rows(path):
    """The rows of one input file, as dicts, with a name for each ("FILE line N" or "FILE row N")."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            fail(f"{path}: Parquet needs the pyarrow package, which is not installed here; convert the file to "
                 "JSON Lines, or run this where pyarrow is")
        return [(f"{path} row {i + 1}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        fail(f"{path}: not UTF-8 (byte {e.start})")
    except OSError as e:
        fail(f"{path}: cannot be read ({e.strerror})")
    try:
        doc = json.loads(text)  # one JSON document; else JSON Lines
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and "rows" not in doc and "data" not in doc:
        return [(f"{path} line 1", doc)]  # JSON Lines of one row
    if isinstance(doc, (list, dict)):
        if isinstance(doc, dict):
            doc = doc.get("rows", doc.get("data", [doc]))
        return [(f"{path} row {i + 1}", r.get("row", r) if isinstance(r, dict) else r) for i, r in enumerate(doc)]
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append((f"{path} line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                fail(f"{path} line {n}: not JSON ({e.msg})")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, choices=sorted(TASKS))
    p.add_argument("inputs", nargs="+")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--labels", help="piqa's original release: its labels file, one label a line")
    p.add_argument("--limit", type=int, default=0, help="the first N rows only")
    p.add_argument("--hf-tokenizer", help="write token ids from this Hugging Face tokenizer (needs transformers)")
    a = p.parse_args()
    rows = [r for path in a.inputs for r in read_rows(path)]
    if a.labels:
        with open(a.labels) as f:
            labels = [line.strip() for line in f if line.strip()]
        if len(labels) != len(rows):
            fail(f"--labels {a.labels}: {len(labels)} labels for {len(rows)} rows")
        for (_, row), label in zip(rows, labels):
            row["label"] = int(label)
    if a.limit > 0:
        rows = rows[:a.limit]
    if not rows:
        fail(f"{', '.join(a.inputs)}: no rows")
    encode = None
    if a.hf_tokenizer:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            fail("--hf-tokenizer needs the transformers package, which is not installed here")
        tok = AutoTokenizer.from_pretrained(a.hf_tokenizer)
        encode = lambda t: {"ids": tok.encode(t, add_special_tokens=False), "text": t}  # noqa: E731
    convert = TASKS[a.task]
    tmp = a.output + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for where, row in rows:
            if not isinstance(row, dict):
                fail(f"{where}: {json.dumps(row)[:80]} is not an object (a row of {a.task})")
            ex = convert(row, where)
            if encode:
                for key, value in list(ex.items()):
                    if isinstance(value, str):
                        ex[key] = encode(value)
                    elif isinstance(value, list) and value and isinstance(value[0], str):
                        ex[key] = [encode(v) for v in value]
            out.write(json.dumps(ex, ensure_ascii=False) + "\n")
    os.replace(tmp, a.output)
    print(f"wrote {a.output}: {len(rows)} {a.task} examples", file=sys.stderr)


if __name__ == "__main__":
    main()
