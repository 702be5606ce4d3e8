#!/usr/bin/env python3
"""What has run on which GPU at which commit, and what the GPU has not yet seen.

Two files hold it: docs/gpu_runs.tsv, the ledger (one row per stage run on a GPU), and dev/gpu_stages.tsv, the
stages (each with the globs of the files it covers, a priority and an expected time). A stage is *stale* where the
hash of its covered files' contents differs from the `covered` column of its last `pass` row.

  gpu_ledger.py stale [--at REV]          CI's report: each queued stage, fresh or stale, with its last pass
  gpu_ledger.py covered [--at REV]        each queued stage's covered hash
  gpu_ledger.py manifest -o FILE          what the bundle carries to the GPU machine: the commit, each stage's
                                          covered hash, whether it is stale and its expected seconds
  gpu_ledger.py queue --manifest FILE --card NAME --rows FILE [--budget-s N] [--stages A,B] -- CMD...
                                          (on the GPU machine) runs `CMD STAGE` for the stale stages in priority
                                          order (or the named ones), each within what is left of the budget, and
                                          writes a ledger row for each stage it ran
  gpu_ledger.py append ROWS...            (here) checks rows from the GPU machine, appends them to the ledger and
                                          remakes docs/gpus.md's table
  gpu_ledger.py table [--check]           remakes docs/gpus.md's table from the ledger (--check: exit 1 if it
                                          differs)
  gpu_ledger.py check                     checks both files' format, and that every glob of the stages file
                                          matches a file and every exclusion removes one
  gpu_ledger.py files STAGE [--at REV]    the files a stage covers
  gpu_ledger.py churn [-n N] [--against REV]
                                          how many of the last N commits (default 120) changed each queued stage's
                                          covered files, under the stages file as it is and (--against) as it was at
                                          REV: what a change of the covers would have cost in GPU runs

The covered hash is the first 16 hex digits of the SHA-256 of the covered files' git blob ids, sorted: a file's
content decides it, not its path, so moving files (and their globs with them) leaves a stage fresh. Where a stage's
covers change, its last pass still counts if the files they select were the same at the pass's commit. `--at REV`
reads the files at a commit; without it, the files on disk that git tracks or would track (what the device tool
copies). A stage's result is `pass`, `fail`, `partial` (part of it ran; the note says what did not) or
`skipped: why` (a tool the machine lacks, a second GPU it does not have).
"""
import argparse
import datetime
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = ["date", "commit", "card", "stage", "result", "seconds", "covered", "note"]
RESULTS = ("pass", "fail", "partial")
TABLE_BEGIN = "<!-- gpu_runs table: made by `python3 dev/gpu_ledger.py table` from docs/gpu_runs.tsv; edit the ledger -->"
TABLE_END = "<!-- end of the gpu_runs table -->"
# Seconds the queue keeps for itself after the last stage (the logs' archive and the summary).
QUEUE_RESERVE_S = 15
# A bench stage whose trainer-to-peer ratio falls more than this below its last pass on the same card fails.
RATIO_TOLERANCE = 0.03


class LedgerError(Exception):
    pass


def paths(root):
    return {
        "ledger": os.path.join(root, "docs", "gpu_runs.tsv"),
        "stages": os.path.join(root, "dev", "gpu_stages.tsv"),
        "gpus_md": os.path.join(root, "docs", "gpus.md"),
        "dev_readme": os.path.join(root, "dev", "README.md"),
    }


def read_tsv(path, header, text=None):
    """Rows of a tab-separated file (or of `text`, named `path`) as dicts; `#` lines are comments; the first other
    line must be `header`."""
    rows, seen_header = [], False
    if text is None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise LedgerError(f"{path}: cannot read ({e.strerror})")
    for n, line in enumerate(text.split("\n"), 1):
        if not line or line.startswith("#"):
            continue
        fields = line.split("\t")
        if not seen_header:
            if fields != header:
                raise LedgerError(f"{path}:{n}: header {fields}; expected the columns {header}")
            seen_header = True
            continue
        if len(fields) != len(header):
            raise LedgerError(f"{path}:{n}: {len(fields)} columns; expected {len(header)} ({', '.join(header)})")
        row = dict(zip(header, fields))
        row["_where"] = f"{path}:{n}"
        rows.append(row)
    if not seen_header:
        raise LedgerError(f"{path}: no header line; expected the columns {header}")
    return rows


SET_NAME = re.compile(r"@[a-z0-9_]+")


def expand_covers(tokens, sets, where):
    """A covers field's tokens as (include globs, exclude globs): `@name` is a set's tokens, `!glob` excludes."""
    include, exclude = [], []
    for t in tokens:
        if t.startswith("@"):
            if t not in sets:
                raise LedgerError(f"{where}: covers {t}: no such set (a set is a row named @..., above its first use: "
                                  f"{', '.join(sets) or 'none yet'})")
            inc, exc = sets[t]
            include += inc
            exclude += exc
        elif t.startswith("!"):
            if len(t) == 1 or t[1] in "!@":
                raise LedgerError(f"{where}: covers {t!r}: expected ! and a glob")
            exclude.append(t[1:])
        else:
            include.append(t)
    return include, exclude


def read_stage_file(root, text=None):
    """(stages, sets): the stages, in the file's order, and {set: (its tokens, where)}; from `text` where given (the
    file at another commit). Rows named `@set` are named sets of covers (priority and expected_s `-`), usable in the
    covers of the rows below them; a stage's `include` and `exclude` hold its expanded globs, `_inc` and `_exc`
    their regexes."""
    path = paths(root)["stages"]
    stages, names, sets, set_rows = [], set(), {}, {}
    for order, row in enumerate(read_tsv(path, ["stage", "priority", "expected_s", "covers", "what"], text)):
        where = row["_where"]
        tokens = row["covers"].split() if row["covers"] != "-" else []
        if row["stage"].startswith("@"):
            if not SET_NAME.fullmatch(row["stage"]) or row["stage"] in sets:
                raise LedgerError(f"{where}: set {row['stage']!r}: expected a new name of @ and a-z, 0-9 and _")
            if row["priority"] != "-" or row["expected_s"] != "-":
                raise LedgerError(f"{where}: set {row['stage']}: priority and expected_s must be - (a set is not run)")
            if not tokens:
                raise LedgerError(f"{where}: set {row['stage']}: covers no file")
            sets[row["stage"]] = expand_covers(tokens, sets, where)
            set_rows[row["stage"]] = (tokens, where)
            continue
        if not re.fullmatch(r"[a-z0-9_]+", row["stage"]) or row["stage"] in names:
            raise LedgerError(f"{where}: stage {row['stage']!r}: expected a new name of a-z, 0-9 and _")
        names.add(row["stage"])
        queued = row["priority"] != "-"
        if queued and not row["priority"].isdigit():
            raise LedgerError(f"{where}: priority {row['priority']!r}: expected a whole number, or - (on demand)")
        if not row["expected_s"].isdigit() or int(row["expected_s"]) == 0:
            raise LedgerError(f"{where}: expected_s {row['expected_s']!r}: expected whole seconds above 0")
        include, exclude = expand_covers(tokens, sets, where)
        if queued and not include:
            raise LedgerError(f"{where}: a queued stage must cover files (covers is -)")
        stages.append({"stage": row["stage"], "priority": int(row["priority"]) if queued else None,
                       "order": order, "expected_s": int(row["expected_s"]), "include": include, "exclude": exclude,
                       "_inc": [glob_regex(g) for g in include], "_exc": [glob_regex(g) for g in exclude],
                       "sets": [t for t in tokens if t.startswith("@")], "what": row["what"], "queued": queued,
                       "_where": where})
    return stages, set_rows


def read_stages(root, text=None):
    return read_stage_file(root, text)[0]


def stage_files(stage, blobs):
    """The paths of `blobs` a stage covers: matched by one of its globs and by none of its exclusions."""
    return sorted(p for p in blobs if any(r.match(p) for r in stage["_inc"]) and
                  not any(r.match(p) for r in stage["_exc"]))


def check_row(row, known_stages):
    """Raises LedgerError naming the row and column of anything a ledger row may not hold."""
    where = row.get("_where", "row")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]):
        raise LedgerError(f"{where}: date {row['date']!r}: expected YYYY-MM-DD (UTC)")
    try:
        datetime.date.fromisoformat(row["date"])
    except ValueError:
        raise LedgerError(f"{where}: date {row['date']!r} is not a calendar date")
    if not re.fullmatch(r"[0-9a-f]{40}(-dirty)?", row["commit"]):
        raise LedgerError(f"{where}: commit {row['commit']!r}: expected the full 40-digit hash, with -dirty where "
                          "the tree had uncommitted changes")
    if not row["card"].strip():
        raise LedgerError(f"{where}: card is empty: expected nvidia-smi's name of the GPU")
    if row["stage"] not in known_stages:
        raise LedgerError(f"{where}: stage {row['stage']!r}: not in dev/gpu_stages.tsv "
                          f"({', '.join(sorted(known_stages))})")
    if not (row["result"] in RESULTS or re.fullmatch(r"skipped: \S.*", row["result"])):
        raise LedgerError(f"{where}: result {row['result']!r}: expected pass, fail, partial or 'skipped: why'")
    if not (row["seconds"] == "-" or row["seconds"].isdigit()):
        raise LedgerError(f"{where}: seconds {row['seconds']!r}: expected whole seconds, or - where not recorded")
    if not (row["covered"] == "-" or re.fullmatch(r"[0-9a-f]{16}", row["covered"])):
        raise LedgerError(f"{where}: covered {row['covered']!r}: expected 16 hex digits (gpu_ledger.py covered), or -")
    if "\n" in row["note"] or "\r" in row["note"]:
        raise LedgerError(f"{where}: note holds a line break")


def read_ledger(root, stages=None):
    stages = stages if stages is not None else read_stages(root)
    rows = read_tsv(paths(root)["ledger"], COLUMNS)
    names = {s["stage"] for s in stages}
    for row in rows:
        check_row(row, names)
    return rows


def glob_regex(glob):
    """A glob over repository paths: `**` spans folders, `*` and `?` stay within one."""
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def git(root, *args, binary=False):
    try:
        r = subprocess.run(["git", "-C", root, *args], capture_output=True, check=False)
    except FileNotFoundError:
        raise LedgerError("git is not installed: the covered hashes are computed in a git checkout")
    if r.returncode != 0:
        raise LedgerError(f"git {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout if binary else r.stdout.decode()


def blob_id(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_blobs(root, rev=None):
    """{path: git blob id} of the files at `rev`, or (None) of the files on disk that git tracks or would track."""
    if rev is not None:
        out = git(root, "ls-tree", "-r", "-z", "--full-tree", rev, binary=True).decode()
        blobs = {}
        for entry in out.split("\0"):
            if not entry:
                continue
            meta, path = entry.split("\t", 1)
            mode, kind, obj = meta.split()
            if kind == "blob":
                blobs[path] = obj
        return blobs
    listed = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard", binary=True).decode()
    blobs = {}
    for path in sorted(set(p for p in listed.split("\0") if p)):
        full = os.path.join(root, path)
        if os.path.isfile(full) and not os.path.islink(full):
            with open(full, "rb") as f:
                blobs[path] = blob_id(f.read())
    return blobs


def covered_hash(stage, blobs):
    ids = sorted(blobs[p] for p in stage_files(stage, blobs))
    if not ids:
        raise LedgerError(f"{stage['_where']}: stage {stage['stage']}: its covers match no file")
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def last_pass(rows, stage):
    passes = [r for r in rows if r["stage"] == stage and r["result"] == "pass"]
    return passes[-1] if passes else None


def expected_seconds(rows, stage):
    """The latest timed run of the stage (pass, fail or partial), else the stages file's estimate."""
    timed = [r for r in rows if r["stage"] == stage["stage"] and r["result"] in RESULTS and r["seconds"] != "-"]
    return int(timed[-1]["seconds"]) if timed else stage["expected_s"]


def queued_stages(stages):
    return sorted((s for s in stages if s["queued"]), key=lambda s: (s["priority"], s["order"]))


def changed_since(stage, lp, blobs, trees, root):
    """The covered files that differ between the tree of the last pass and `blobs` (added, removed or edited, under
    the stage's covers as they are now), or None where that tree cannot be read (a -dirty commit, one this clone
    lacks)."""
    commit = lp["commit"]
    if commit.endswith("-dirty"):
        return None
    if commit not in trees:
        try:
            trees[commit] = tree_blobs(root, commit)
        except LedgerError:
            trees[commit] = None
    then = trees[commit]
    if then is None:
        return None
    now_files = {p: blobs[p] for p in stage_files(stage, blobs)}
    then_files = {p: then[p] for p in stage_files(stage, then)}
    return sorted(p for p in set(now_files) | set(then_files) if now_files.get(p) != then_files.get(p))


def stage_states(root, rev=None):
    """Each queued stage's covered hash and whether it is stale. A stage is fresh where its covered files are as its
    last pass saw them: the pass's `covered` hash equals today's, or (its covers having changed since) the files its
    covers select today are, at the pass's commit, the files on disk now."""
    stages = read_stages(root)
    rows = read_ledger(root, stages)
    blobs = tree_blobs(root, rev)
    trees, states = {}, []
    for s in queued_stages(stages):
        covered = covered_hash(s, blobs)
        lp = last_pass(rows, s["stage"])
        changed = None
        if lp is None:
            stale = True
        elif lp["covered"] == covered:
            stale, changed = False, []
        else:
            changed = changed_since(s, lp, blobs, trees, root)
            stale = changed != []
        states.append({"stage": s["stage"], "priority": s["priority"], "covered": covered, "stale": stale,
                       "expected_s": expected_seconds(rows, s), "what": s["what"], "changed": changed,
                       "last_pass": None if lp is None else {k: lp[k] for k in ("date", "commit", "card", "covered")}})
    return states


def head_commit(root):
    commit = git(root, "rev-parse", "HEAD").strip()
    dirty = bool(git(root, "status", "--porcelain", "--untracked-files=no").strip())
    return commit + ("-dirty" if dirty else "")


def cmd_covered(a):
    for st in stage_states(a.root, a.at):
        print(f"{st['stage']}\t{st['covered']}")


def cmd_stale(a):
    try:
        states = stage_states(a.root, a.at)
        at = a.at or head_commit(a.root)
    except LedgerError as e:
        # The report informs; it never fails CI. A malformed ledger fails the ledger's own test instead.
        print(f"GPU stages: no report ({e})")
        return 0
    stale = [s for s in states if s["stale"]]
    print(f"GPU stages at {at[:12]}: {len(stale)} of {len(states)} stale (covered files changed since their last pass "
          "on a GPU; docs/gpu_runs.tsv, dev/gpu_stages.tsv)")
    for s in states:
        lp = s["last_pass"]
        since = "never passed" if lp is None else f"last pass {lp['date']} at {lp['commit'][:12]} on {lp['card']}"
        if s["stale"] and s["changed"]:
            n = len(s["changed"])
            since += (f"; {n} covered file{'s' if n > 1 else ''} changed since: {', '.join(s['changed'][:3])}"
                      f"{', ...' if n > 3 else ''}")
        print(f"  {s['stage']:<20} {'stale' if s['stale'] else 'fresh':<6} {since}")
    if not stale:
        print("  none stale: the GPU has run every queued stage on these files")
    return 0


def cmd_manifest(a):
    states = stage_states(a.root)
    manifest = {"commit": head_commit(a.root), "packed": datetime.datetime.now(datetime.timezone.utc)
                .strftime("%Y-%m-%d %H:%M UTC"), "stages": states}
    with open(a.output, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    stale = [s["stage"] for s in states if s["stale"]]
    print(f"manifest {a.output}: commit {manifest['commit']}; stale: {', '.join(stale) if stale else 'none'}")


def ratio_in(note):
    m = re.search(r"\bratio=([0-9]+(?:\.[0-9]+)?)", note)
    return float(m.group(1)) if m else None


def judge_ratio(rows, stage, card, result, note):
    """A bench stage's ratio against its last pass on the same kind of card: more than 3% lower fails."""
    ratio = ratio_in(note)
    if ratio is None or result != "pass":
        return result, note
    before = [r for r in rows if r["stage"] == stage and r["card"] == card and r["result"] == "pass"
              and ratio_in(r["note"]) is not None]
    if not before:
        return result, note + "; the first ratio on this card: its baseline"
    last = before[-1]
    was = ratio_in(last["note"])
    change = ratio / was - 1
    note += f"; last ratio {was:g} ({last['date']}, {last['commit'][:7]}): {100 * change:+.1f}%"
    if change < -RATIO_TOLERANCE:
        return "fail", note + f": a regression past {100 * RATIO_TOLERANCE:.0f}%"
    return result, note


def run_stage(cmd, stage, limit, result_file):
    """Runs `cmd stage` in its own process group under `limit` seconds; (result, note, seconds)."""
    if os.path.exists(result_file):
        os.remove(result_file)
    env = dict(os.environ, GPU_STAGE_RESULT=result_file)
    start = time.monotonic()
    proc = subprocess.Popen(cmd + [stage], env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
        seconds = round(time.monotonic() - start)
        return "fail", f"stopped at its limit of {limit} s", seconds
    seconds = round(time.monotonic() - start)
    reported = ""
    if os.path.exists(result_file):
        with open(result_file, encoding="utf-8") as f:
            reported = f.read().strip()
    if reported:
        result, _, note = reported.partition("\t")
    else:
        result, note = "fail", "the stage reported no result"
    if rc != 0:
        result, note = "fail", f"exit {rc}; {note}"
    return result, " ".join(note.split()), seconds


def plan_queue(states, budget, elapsed, only=None):
    """The next stage to run and the reasons the ones before it wait: (stage or None, [(stage, why)])."""
    waiting = []
    for s in states:
        if only is not None and s["stage"] not in only:
            continue
        left = int(budget - elapsed - QUEUE_RESERVE_S)
        if s["expected_s"] > budget - QUEUE_RESERVE_S:
            waiting.append((s, f"expected {s['expected_s']} s: more than a call of --budget-s {budget} holds"))
        elif s["expected_s"] > left:
            waiting.append((s, f"expected {s['expected_s']} s, {max(left, 0)} s left: for the next call"))
        else:
            return s, waiting
    return None, waiting


def cmd_queue(a):
    with open(a.manifest, encoding="utf-8") as f:
        manifest = json.load(f)
    states = manifest["stages"]
    by_name = {s["stage"]: s for s in states}
    stages_file = {s["stage"]: s for s in read_stages(a.root)}
    rows = read_ledger(a.root)
    if a.stages:
        names = a.stages.split(",")
        for n in names:
            if n not in stages_file:
                raise LedgerError(f"stage {n!r}: not in dev/gpu_stages.tsv ({', '.join(stages_file)})")
        # Named stages run in the order given, stale or not; on-demand ones take the stages file's estimate.
        todo = [dict(by_name.get(n) or {"stage": n, "covered": "-", "expected_s": stages_file[n]["expected_s"]})
                for n in names]
    else:
        todo = [s for s in states if s["stale"]]
        if not todo:
            print(f"queue: no stage is stale at {manifest['commit'][:12]}: every queued stage passed on these files")
            return 0
    os.makedirs(os.path.dirname(os.path.abspath(a.rows)), exist_ok=True)
    new_file = not os.path.exists(a.rows)
    start = time.monotonic()
    done, result_file = [], os.path.abspath(a.rows) + ".result"
    with open(a.rows, "a", encoding="utf-8") as out:
        if new_file:
            out.write("\t".join(COLUMNS) + "\n")
        while True:
            elapsed = time.monotonic() - start
            stage, waiting = plan_queue(todo, a.budget_s, elapsed)
            if stage is None:
                break
            left = int(a.budget_s - elapsed - QUEUE_RESERVE_S)
            limit = min(left, max(2 * stage["expected_s"], stage["expected_s"] + 120))
            print(f"queue: {stage['stage']} (expected {stage['expected_s']} s, limit {limit} s, {left} s left)",
                  flush=True)
            result, note, seconds = run_stage(a.cmd, stage["stage"], limit, result_file)
            result, note = judge_ratio(rows, stage["stage"], a.card, result, note)
            row = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                   "commit": manifest["commit"], "card": a.card, "stage": stage["stage"], "result": result,
                   "seconds": str(seconds), "covered": stage["covered"], "note": note.replace("\t", " ") or "-"}
            out.write("\t".join(row[c] for c in COLUMNS) + "\n")
            out.flush()
            done.append(row)
            todo = [s for s in todo if s["stage"] != stage["stage"]]
            print(f"queue: {stage['stage']}: {result}, {seconds} s", flush=True)
    if os.path.exists(result_file):
        os.remove(result_file)
    print(f"\nqueue: {len(done)} stage(s) ran in {round(time.monotonic() - start)} s of --budget-s {a.budget_s}")
    for r in done:
        print(f"  ran      {r['stage']:<20} {r['result']}, {r['seconds']} s: {r['note'][:160]}")
    for s, why in waiting:
        print(f"  left     {s['stage']:<20} {why}")
    if not waiting:
        print("  left     none")
    print(f"rows: {a.rows} (here: python3 dev/gpu_ledger.py append ROWS)")
    return 0


def render_table(rows):
    lines = [TABLE_BEGIN, "", "| date | commit | card | stage | result | s | note |", "|---|---|---|---|---|---|---|"]
    # Newest run first; within a run, the ledger's order.
    indexed = list(enumerate(rows))
    indexed.sort(key=lambda ir: (ir[1]["date"], -ir[0]), reverse=True)
    for _, r in indexed:
        note = r["note"].replace("|", "\\|")
        commit = r["commit"][:7] + ("-dirty" if r["commit"].endswith("-dirty") else "")
        lines.append(f"| {r['date']} | {commit} | {r['card']} | {r['stage']} | {r['result']} | {r['seconds']} | "
                     f"{note} |")
    lines += ["", TABLE_END]
    return "\n".join(lines)


def cmd_table(a):
    md = paths(a.root)["gpus_md"]
    with open(md, encoding="utf-8") as f:
        text = f.read()
    if text.count(TABLE_BEGIN) != 1 or text.count(TABLE_END) != 1:
        raise LedgerError(f"{md}: expected one line {TABLE_BEGIN!r} and one {TABLE_END!r} around the table")
    head, rest = text.split(TABLE_BEGIN)
    _, tail = rest.split(TABLE_END)
    rows = read_ledger(a.root)
    made = head + render_table(rows) + tail
    if a.check:
        if made != text:
            print(f"{md}: its table differs from docs/gpu_runs.tsv: run python3 dev/gpu_ledger.py table",
                  file=sys.stderr)
            return 1
        print(f"{md}: its table is the ledger's")
        return 0
    if made != text:
        with open(md, "w", encoding="utf-8") as f:
            f.write(made)
    print(f"{md}: table made from {len(rows)} ledger rows")
    return 0


def cmd_append(a):
    stages = read_stages(a.root)
    names = {s["stage"] for s in stages}
    existing = read_ledger(a.root, stages)
    seen = {tuple(r[c] for c in COLUMNS) for r in existing}
    new = []
    for path in a.rows:
        for row in read_tsv(path, COLUMNS):
            check_row(row, names)
            key = tuple(row[c] for c in COLUMNS)
            if key in seen:
                raise LedgerError(f"{row['_where']}: this row is in the ledger already")
            seen.add(key)
            new.append(row)
    with open(paths(a.root)["ledger"], "a", encoding="utf-8") as f:
        for row in new:
            f.write("\t".join(row[c] for c in COLUMNS) + "\n")
    print(f"appended {len(new)} row(s) to docs/gpu_runs.tsv")
    a.check = False
    return cmd_table(a)


def check_covers(stages, set_rows, blobs):
    """Raises LedgerError where a glob matches no file (a file moved without its glob), an exclusion removes
    nothing from its stage, or a set is used by no stage and no other set."""
    used = {t for s in stages for t in s["sets"]} | {t for tokens, _ in set_rows.values() for t in tokens
                                                     if t.startswith("@")}
    for name, (_, where) in set_rows.items():
        if name not in used:
            raise LedgerError(f"{where}: set {name}: no stage uses it")
    for s in stages:
        for g, r in zip(s["include"] + s["exclude"], s["_inc"] + s["_exc"]):
            if not any(r.match(p) for p in blobs):
                raise LedgerError(f"{s['_where']}: stage {s['stage']}: {g} matches no file (moved? its glob moves "
                                  "with it)")
        for g, r in zip(s["exclude"], s["_exc"]):
            if not any(r.match(p) and any(i.match(p) for i in s["_inc"]) for p in blobs):
                raise LedgerError(f"{s['_where']}: stage {s['stage']}: !{g} excludes nothing it covers")


def check_readme_stages(root, stages):
    """Raises LedgerError where dev/README.md's table of the stages ("| priority | stage | what |": each row a
    priority, or - for on demand, and the stages of that priority in backticks) names other stages or priorities
    than dev/gpu_stages.tsv. Returns the number of stages it lists; 0 where the repository has no dev/README.md."""
    path = paths(root)["dev_readme"]
    if not os.path.exists(path):
        return 0
    listed, where_of, in_table = {}, {}, False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.startswith("| priority | stage | what |"):
                in_table = True
                continue
            if not in_table or line.startswith("|---"):
                continue
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            for name in re.findall(r"`([a-z0-9_]+)`", cells[1] if len(cells) > 1 else ""):
                if name in listed:
                    raise LedgerError(f"dev/README.md:{n}: stage {name} is listed twice in the table of stages")
                listed[name], where_of[name] = cells[0], n
    if not in_table:
        raise LedgerError("dev/README.md: no table of the stages (a line \"| priority | stage | what |\")")
    for s in stages:
        priority = "-" if s["priority"] is None else str(s["priority"])
        if s["stage"] not in listed:
            raise LedgerError(f"dev/README.md: the table of stages lacks {s['stage']} (priority {priority} in "
                              "dev/gpu_stages.tsv)")
        if listed[s["stage"]] != priority:
            raise LedgerError(f"dev/README.md:{where_of[s['stage']]}: stage {s['stage']} has priority "
                              f"{listed[s['stage']]}, dev/gpu_stages.tsv {priority}")
    known = {s["stage"] for s in stages}
    for name in listed:
        if name not in known:
            raise LedgerError(f"dev/README.md:{where_of[name]}: stage {name} is not in dev/gpu_stages.tsv")
    return len(listed)


def cmd_check(a):
    stages, set_rows = read_stage_file(a.root)
    rows = read_ledger(a.root, stages)
    check_covers(stages, set_rows, tree_blobs(a.root))
    listed = check_readme_stages(a.root, stages)
    print(f"dev/gpu_stages.tsv: {len(stages)} stages ({len(queued_stages(stages))} queued), {len(set_rows)} sets, "
          f"every glob matching a file{', each in dev/README.md with its priority' if listed else ''}; "
          f"docs/gpu_runs.tsv: {len(rows)} rows, every one well formed")
    return 0


def cmd_files(a):
    stages = {s["stage"]: s for s in read_stages(a.root)}
    if a.stage not in stages:
        raise LedgerError(f"stage {a.stage!r}: not in dev/gpu_stages.tsv ({', '.join(stages)})")
    for p in stage_files(stages[a.stage], tree_blobs(a.root, a.at)):
        print(p)
    return 0


def cmd_churn(a):
    now = queued_stages(read_stages(a.root))
    then = {}
    if a.against:
        then = {s["stage"]: s for s in read_stages(a.root, git(a.root, "show", f"{a.against}:dev/gpu_stages.tsv"))}
    commits = git(a.root, "log", "--format=%H", "-n", str(a.n)).split()
    counts = {s["stage"]: [0, 0] for s in now}
    for c in commits:
        changed = dict.fromkeys(git(a.root, "diff-tree", "--no-commit-id", "--name-only", "-r", "--root", c).split(),
                                "")
        for s in now:
            counts[s["stage"]][0] += bool(stage_files(s, changed))
            if s["stage"] in then:
                counts[s["stage"]][1] += bool(stage_files(then[s["stage"]], changed))
    against = f", and under the stages file at {a.against}" if a.against else ""
    print(f"of the last {len(commits)} commits, those that changed each stage's covered files: under the stages file "
          f"as it is{against}")
    for s in now:
        n, before = counts[s["stage"]]
        was = f"  (was {before})" if s["stage"] in then else ""
        print(f"  {s['stage']:<20} {n:4d}{was}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=ROOT, help="the repository root (default: this file's)")
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("stale", "covered"):
        p = sub.add_parser(name)
        p.add_argument("--at", help="a commit (default: the files on disk)")
    p = sub.add_parser("manifest")
    p.add_argument("-o", "--output", required=True)
    p = sub.add_parser("queue")
    p.add_argument("--manifest", required=True)
    p.add_argument("--card", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--budget-s", type=int, default=480)
    p.add_argument("--stages", help="comma-separated stages to run in this order, stale or not")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("append")
    p.add_argument("rows", nargs="+")
    p = sub.add_parser("table")
    p.add_argument("--check", action="store_true")
    sub.add_parser("check")
    p = sub.add_parser("churn")
    p.add_argument("-n", type=int, default=120, help="how many commits back from HEAD (default 120)")
    p.add_argument("--against", help="a commit whose stages file to compare with")
    p = sub.add_parser("files")
    p.add_argument("stage")
    p.add_argument("--at", help="a commit (default: the files on disk)")
    a = ap.parse_args(argv)
    if a.command == "queue":
        if a.cmd[:1] == ["--"]:
            a.cmd = a.cmd[1:]
        if not a.cmd:
            ap.error("queue: the stage command after -- is missing")
        if a.budget_s <= QUEUE_RESERVE_S:
            ap.error(f"queue: --budget-s {a.budget_s}: expected more than the {QUEUE_RESERVE_S} s the queue keeps")
    try:
        return {"stale": cmd_stale, "covered": cmd_covered, "manifest": cmd_manifest, "queue": cmd_queue,
                "append": cmd_append, "table": cmd_table, "check": cmd_check, "files": cmd_files,
                "churn": cmd_churn}[a.command](a) or 0
    except LedgerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
