"""scripts/make_downstream_jsonl.py on rows written here in each dataset's published format: each task's examples are
the contexts, continuations, labels and unconditioned contexts OLMo builds from them, Parquet is refused by name
where pyarrow is missing, and the trainer (its path the first argument) scores every converted file.

Usage: python3 tests/test_make_downstream.py TRAINER
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "make_downstream_jsonl.py")

# (task, input rows as published, their file layout, the examples OLMo builds from them)
CASES = [
    ("piqa", [{"goal": "How do I ready a cage?", "sol1": "Add paper strips.", "sol2": "Add jeans.", "label": 0}],
     "jsonl",
     [{"context": "Question: How do I ready a cage?\nAnswer:", "continuations": [" Add paper strips.", " Add jeans."],
       "label": 0, "unconditioned_context": "Answer:"}]),
    ("hellaswag", [{"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
                    "endings": ["is using wrap [title] to wrap skis.", "starts  pulling up roofing."], "label": "1"}],
     "json",
     [{"context": "Roof shingle removal: A man is sitting on a roof. He",
       "continuations": [" is using wrap. to wrap skis.", " starts pulling up roofing."], "label": 1,
       "unconditioned_context": "He"}]),
    ("arc_easy", [{"question": "Which was developed most recently?",
                   "choices": {"text": ["cellular telephone", "television"], "label": ["A", "B"]}, "answerKey": "A"},
                  {"question": {"stem": "Which is a gas?", "choices": [{"text": "ice", "label": "1"},
                                                                      {"text": "steam", "label": "2"}]},
                   "answerKey": "2"}],
     "jsonl",
     [{"context": "Question: Which was developed most recently?\nAnswer:",
       "continuations": [" cellular telephone", " television"], "label": 0, "unconditioned_context": "Answer:"},
      {"context": "Question: Which is a gas?\nAnswer:", "continuations": [" ice", " steam"], "label": 1,
       "unconditioned_context": "Answer:"}]),
    ("boolq", [{"question": "is the sky blue", "passage": "The sky is blue.", "answer": True},
               {"question": "is ice hot", "passage": "Ice is cold.", "label": 0}],
     "rows",
     [{"context": "The sky is blue.\nQuestion: is the sky blue?\nAnswer:", "continuations": [" yes", " no"],
       "label": 0, "unconditioned_context": "Answer:"},
      {"context": "Ice is cold.\nQuestion: is ice hot?\nAnswer:", "continuations": [" yes", " no"], "label": 1,
       "unconditioned_context": "Answer:"}]),
    ("sciq", [{"question": "Who proposed natural selection?", "distractor1": "Linnaeus", "distractor2": "shaw",
               "distractor3": "Scopes", "correct_answer": "darwin", "support": "  Evolution.\n"}],
     "jsonl",
     [{"context": "Evolution.\nQuestion: Who proposed natural selection?\nAnswer:",
       "continuations": [" Linnaeus", " shaw", " Scopes", " darwin"], "label": 3, "unconditioned_context": "Answer:"}]),
    ("winogrande", [{"sentence": "People think _ is embarrassed, because Samantha made snide comments.",
                     "option1": "Samantha", "option2": "Rebecca", "answer": "2"}],
     "jsonl",
     [{"contexts": ["People think Samantha", "People think Rebecca"],
       "continuation": " is embarrassed, because Samantha made snide comments.", "label": 1,
       "unconditioned_contexts": ["Samantha", "Rebecca"]}]),
    ("copa", [{"premise": "The students came under scrutiny.", "choice1": "They got good grades.",
               "choice2": "Their answers were identical.", "question": "cause", "label": 1}],
     "jsonl",
     [{"context": "The students came under scrutiny because",
       "continuations": [" they got good grades.", " their answers were identical."], "label": 1,
       "unconditioned_context": "because"}]),
    ("openbook_qa", [{"question_stem": "Deep sea fish are known as",
                      "choices": {"text": ["deep sea animals", "fish"], "label": ["A", "B"]}, "answerKey": "A"}],
     "jsonl",
     [{"context": "Deep sea fish are known as", "continuations": [" deep sea animals", " fish"], "label": 0,
       "unconditioned_context": "as"}]),
]


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def main():
    trainer = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        evaluators = []
        for task, rows, layout, expected in CASES:
            src = os.path.join(tmp, f"{task}.{'json' if layout != 'jsonl' else 'jsonl'}")
            with open(src, "w") as f:
                if layout == "jsonl":
                    f.write("".join(json.dumps(r) + "\n" for r in rows))
                elif layout == "json":
                    json.dump(rows, f, indent=2)
                else:  # a datasets-server page
                    json.dump({"rows": [{"row_idx": i, "row": r} for i, r in enumerate(rows)]}, f)
            out = os.path.join(tmp, f"{task}.out.jsonl")
            r = run([sys.executable, SCRIPT, "--task", task, src, "-o", out])
            if r.returncode != 0:
                print(f"FAIL {task}: exit {r.returncode}: {r.stderr}")
                failures += 1
                continue
            with open(out) as f:
                got = [json.loads(line) for line in f]
            if got != expected:
                print(f"FAIL {task}:\n  got      {got}\n  expected {expected}")
                failures += 1
            evaluators.append({"label": task, "type": "downstream", "data": {"paths": [out]}})
        # piqa's original release: the labels in a file of their own.
        rows = os.path.join(tmp, "piqa_orig.jsonl")
        with open(rows, "w") as f:
            f.write(json.dumps({"goal": "g", "sol1": "a", "sol2": "b"}) + "\n")
        with open(os.path.join(tmp, "labels.lst"), "w") as f:
            f.write("1\n")
        r = run([sys.executable, SCRIPT, "--task", "piqa", rows, "--labels", os.path.join(tmp, "labels.lst"), "-o",
                 os.path.join(tmp, "po.jsonl")])
        if r.returncode != 0 or json.loads(open(os.path.join(tmp, "po.jsonl")).read())["label"] != 1:
            print(f"FAIL piqa --labels: {r.stderr}")
            failures += 1
        # A row without a column the task needs, and Parquet without pyarrow, are refused by name.
        with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
            f.write(json.dumps({"goal": "g", "sol1": "a", "label": 0}) + "\n")
        r = run([sys.executable, SCRIPT, "--task", "piqa", os.path.join(tmp, "bad.jsonl"), "-o",
                 os.path.join(tmp, "bad.out")])
        if r.returncode == 0 or "bad.jsonl line 1: no \"sol2\"" not in r.stderr:
            print(f"FAIL missing column: {r.returncode} {r.stderr}")
            failures += 1
        try:
            import pyarrow  # noqa: F401
            have_pyarrow = True
        except ImportError:
            have_pyarrow = False
        pq = os.path.join(tmp, "rows.parquet")
        if have_pyarrow:
            import pyarrow as pa
            import pyarrow.parquet as pqm
            pqm.write_table(pa.Table.from_pylist(CASES[0][1]), pq)
            r = run([sys.executable, SCRIPT, "--task", "piqa", pq, "-o", os.path.join(tmp, "pq.jsonl")])
            if r.returncode != 0 or [json.loads(x) for x in open(os.path.join(tmp, "pq.jsonl"))] != CASES[0][3]:
                print(f"FAIL parquet: {r.stderr}")
                failures += 1
        else:
            open(pq, "wb").write(b"PAR1")
            r = run([sys.executable, SCRIPT, "--task", "piqa", pq, "-o", os.path.join(tmp, "pq.jsonl")])
            if r.returncode == 0 or "Parquet needs the pyarrow package" not in r.stderr:
                print(f"FAIL parquet without pyarrow: {r.returncode} {r.stderr}")
                failures += 1
        # The trainer scores every converted file (text, through the byte tokenizer of configs/tiny.json).
        metrics = os.path.join(tmp, "m.jsonl")
        r = run([trainer, "--config", "configs/tiny.json", "--data",
                 os.path.join(ROOT, "tests", "fixtures", "olmo_tiny_tokens.u16"), "--max-duration", "1", "--threads",
                 "1", "--metrics-file", metrics, "--set", "eval_on_startup=true", "--set",
                 "evaluators=" + json.dumps(evaluators)], cwd=ROOT)
        if r.returncode != 0:
            print(f"FAIL trainer: exit {r.returncode}: {r.stderr}")
            failures += 1
        else:
            scored = {}
            for line in open(metrics):
                j = json.loads(line)
                if j.get("event") == "eval":
                    scored = j["downstream"]
            for task, _, _, expected in CASES:
                s = scored.get(task, {})
                if s.get("examples") != len(expected) or not {"acc", "len_norm", "pmi_dc", "bpb"} <= set(s):
                    print(f"FAIL trainer scores of {task}: {s}")
                    failures += 1
    print(f"{len(CASES)} tasks, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
