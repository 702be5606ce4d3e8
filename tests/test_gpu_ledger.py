#!/usr/bin/env python3
"""dev/gpu_ledger.py: covered hashes, staleness, the queue's budget, the ledger's rows and docs/gpus.md's table.

Each case builds a small repository of its own (git init, a stages file, a ledger, a gpus.md) in a temporary folder;
the queue runs a stage command written here in bash (sleeps and results), so its budget and limits are real time.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from contextlib import redirect_stderr, redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dev"))
import gpu_ledger as g  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
STAGES = """# comment
stage\tpriority\texpected_s\tcovers\twhat
fast\t1\t2\tsrc/**\ta quick one
slow\t2\t100\tsrc/a.cu\tone that never fits a small call
mid\t3\t3\tsrc/*.h lib/**\tanother
demand\t-\t5\t-\ton demand
"""
GPUS_MD = f"# GPUs\n\nbefore\n\n{g.TABLE_BEGIN}\n{g.TABLE_END}\n\nafter\n"
# A stage command: `stage.sh NAME`; sleeps and reports as STAGE_PLAN (name:seconds:result) says.
STAGE_SH = """#!/usr/bin/env bash
for spec in $STAGE_PLAN; do
    IFS=: read -r name secs result <<<"$spec"
    if [[ $name == "$1" ]]; then
        sleep "$secs"
        printf '%s\\tfigures of %s\\n' "$result" "$1" >"$GPU_STAGE_RESULT"
        exit 0
    fi
done
exit 3
"""


def git(root, *args):
    subprocess.run(["git", "-C", root, *args], check=True, capture_output=True)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def row(**kw):
    r = {"date": "2026-11-27", "commit": COMMIT, "card": "NVIDIA H100 80GB HBM3", "stage": "fast", "result": "pass",
         "seconds": "10", "covered": "-", "note": "n"}
    r.update(kw)
    return r


class Repo:
    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="gpu_ledger_")
        for d in ("dev", "docs", "src", "lib", "other"):
            os.makedirs(os.path.join(self.root, d))
        self.write("dev/gpu_stages.tsv", STAGES)
        self.write("docs/gpus.md", GPUS_MD)
        self.ledger([])
        self.write("src/a.cu", "kernel a\n")
        self.write("src/b.h", "header b\n")
        self.write("src/deep/c.cu", "kernel c\n")
        self.write("lib/x.cpp", "x\n")
        self.write("other/y.txt", "y\n")
        git(self.root, "init", "-q")
        git(self.root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
        git(self.root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")

    def write(self, path, text):
        full = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)

    def ledger(self, rows):
        self.write("docs/gpu_runs.tsv", "# the ledger\n" + "\t".join(g.COLUMNS) + "\n" +
                   "".join("\t".join(r[c] for c in g.COLUMNS) + "\n" for r in rows))

    def covered(self, rev=None):
        stages = {s["stage"]: s for s in g.read_stages(self.root)}
        blobs = g.tree_blobs(self.root, rev)
        return {n: g.covered_hash(s, blobs) for n, s in stages.items() if s["queued"]}

    def run(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            rc = g.main(["--root", self.root, *argv])
        return rc, out.getvalue(), err.getvalue()

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


class LedgerTest(unittest.TestCase):
    def setUp(self):
        self.repo = Repo()

    def tearDown(self):
        self.repo.close()

    def test_globs(self):
        r = g.glob_regex("kernels/**")
        self.assertTrue(r.match("kernels/cuda/a.cu"))
        self.assertFalse(r.match("kernelsx/a.cu"))
        r = g.glob_regex("kernels/*.h")
        self.assertTrue(r.match("kernels/a.h"))
        self.assertFalse(r.match("kernels/cuda/a.h"))
        self.assertFalse(r.match("kernels/a.hpp"))
        self.assertTrue(g.glob_regex("tests/gpu/gpu_kernels.*").match("tests/gpu/gpu_kernels.cu"))
        self.assertTrue(g.glob_regex("a/**/b.cu").match("a/b.cu"))
        self.assertTrue(g.glob_regex("a/**/b.cu").match("a/x/y/b.cu"))

    def test_covered_hash_follows_contents_not_paths(self):
        before = self.repo.covered()
        self.assertEqual(before, self.repo.covered("HEAD"), "a clean tree hashes as its commit")
        self.repo.write("other/y.txt", "changed outside every stage\n")
        self.assertEqual(self.repo.covered(), before)
        os.rename(os.path.join(self.repo.root, "src/deep/c.cu"), os.path.join(self.repo.root, "src/deep/moved.cu"))
        self.assertEqual(self.repo.covered(), before, "a move within the globs leaves the hash")
        self.repo.write("src/deep/moved.cu", "kernel c, changed\n")
        after = self.repo.covered()
        self.assertNotEqual(after["fast"], before["fast"])
        self.assertEqual(after["slow"], before["slow"], "slow covers src/a.cu alone")
        self.assertEqual(after["mid"], before["mid"], "mid covers src/*.h, not src/deep")
        self.repo.write("src/new.h", "a new header\n")  # untracked but not ignored: the device tool copies it
        self.assertNotEqual(self.repo.covered()["mid"], before["mid"])

    def test_a_stage_whose_globs_match_nothing_is_refused(self):
        self.repo.write("dev/gpu_stages.tsv", STAGES.replace("src/a.cu", "src/none.cu"))
        with self.assertRaisesRegex(g.LedgerError, "slow: its covers match no file"):
            self.repo.covered()

    def test_sets_and_exclusions(self):
        # @name stands for a set's covers (sets may use the sets above them); !glob removes files from a stage.
        self.repo.write("dev/gpu_stages.tsv", STAGES.replace(
            "fast\t1", "@kernels\t-\t-\tsrc/**\tthe kernels\n@all\t-\t-\t@kernels lib/**\teverything\nfast\t1")
            .replace("src/*.h lib/**", "@all !src/deep/** !lib/x.cpp"))
        stages = {s["stage"]: s for s in g.read_stages(self.repo.root)}
        blobs = g.tree_blobs(self.repo.root)
        self.assertEqual(g.stage_files(stages["mid"], blobs), ["src/a.cu", "src/b.h"])
        before = self.repo.covered()
        self.repo.write("src/deep/c.cu", "kernel c, changed\n")
        self.repo.write("lib/x.cpp", "x changed\n")
        self.assertEqual(self.repo.covered()["mid"], before["mid"], "what a stage excludes leaves it fresh")
        self.assertEqual(self.repo.run("check")[0], 0)
        rc, out, _ = self.repo.run("files", "mid")
        self.assertEqual((rc, out), (0, "src/a.cu\nsrc/b.h\n"))
        # A set is defined above its first use, never holds itself, and is never queued.
        for stages_text, what in [
                (STAGES.replace("src/*.h lib/**", "@later"), "@later: no such set"),
                (STAGES.replace("fast\t1", "@a\t-\t-\t@a\tself\nfast\t1"), "@a: no such set"),
                (STAGES.replace("fast\t1", "@a\t1\t5\tsrc/**\tqueued\nfast\t1"), "priority and expected_s must be -"),
                (STAGES.replace("fast\t1", "@A\t-\t-\tsrc/**\tbad name\nfast\t1"), "expected a new name"),
                (STAGES.replace("src/*.h lib/**", "src/** !"), "expected ! and a glob")]:
            with self.subTest(what=what):
                self.repo.write("dev/gpu_stages.tsv", stages_text)
                with self.assertRaisesRegex(g.LedgerError, what):
                    g.read_stages(self.repo.root)

    def test_a_pass_counts_after_its_stage_covers_change_where_their_files_did_not(self):
        head = subprocess.run(["git", "-C", self.repo.root, "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        h = self.repo.covered("HEAD")
        self.repo.ledger([row(stage="mid", commit=head, covered=h["mid"])])
        self.assertRegex(self.repo.run("stale")[1], r"mid +fresh")
        # Narrowed covers hash differently, but select files the pass's commit held as they are now.
        self.repo.write("dev/gpu_stages.tsv", STAGES.replace("src/*.h lib/**", "src/*.h lib/** !lib/x.cpp"))
        self.assertNotEqual(self.repo.covered()["mid"], h["mid"])
        self.assertRegex(self.repo.run("stale")[1], r"mid +fresh")
        self.repo.write("lib/x.cpp", "x changed, outside mid's covers now\n")
        self.assertRegex(self.repo.run("stale")[1], r"mid +fresh")
        self.repo.write("src/b.h", "header b, changed\n")
        self.assertRegex(self.repo.run("stale")[1],
                         r"mid +stale +last pass .*; 1 covered file changed since: src/b.h\n")
        # Where the pass's tree cannot be read (a dirty tree, a commit this clone lacks), the hash alone decides.
        self.repo.write("src/b.h", "header b\n")
        for commit in (head + "-dirty", COMMIT):
            with self.subTest(commit=commit):
                self.repo.ledger([row(stage="mid", commit=commit, covered=h["mid"])])
                out = self.repo.run("stale")[1]
                self.assertRegex(out, r"mid +stale +last pass [^;\n]*\n")

    def test_churn_counts_the_commits_that_changed_each_stage(self):
        def commit(path, text, message):
            self.repo.write(path, text)
            git(self.repo.root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", message)
        commit("other/y.txt", "y, changed\n", "outside every stage")
        commit("src/a.cu", "kernel a, changed\n", "fast and slow")
        commit("lib/x.cpp", "x, changed\n", "mid")
        rc, out, _ = self.repo.run("churn", "-n", "3")
        self.assertEqual(rc, 0)
        self.assertRegex(out, r"fast +1\n")
        self.assertRegex(out, r"slow +1\n")
        self.assertRegex(out, r"mid +1\n")
        # Covers widened to other/**: the same commits count against the stages file as it was before.
        commit("dev/gpu_stages.tsv", STAGES.replace("src/*.h lib/**", "src/*.h lib/** other/**"), "wider mid")
        rc, out, _ = self.repo.run("churn", "-n", "4", "--against", "HEAD~1")
        self.assertRegex(out, r"mid +2  \(was 1\)")
        self.assertRegex(out, r"fast +1  \(was 1\)")

    def test_check_names_a_glob_that_matches_nothing(self):
        # `check` (a CTest case on the repository's own files) catches a file moved without its glob, an exclusion
        # that removes nothing and a set no stage uses.
        for stages_text, what in [
                (STAGES.replace("src/*.h lib/**", "src/*.h lib/** gone/*.cpp"), "mid: gone/\\*.cpp matches no file"),
                (STAGES.replace("src/*.h lib/**", "src/*.h !other/**"), "mid: !other/\\*\\* excludes nothing"),
                (STAGES.replace("fast\t1", "@unused\t-\t-\tsrc/**\tnobody's\nfast\t1"), "@unused: no stage uses it")]:
            with self.subTest(what=what):
                self.repo.write("dev/gpu_stages.tsv", stages_text)
                rc, _, err = self.repo.run("check")
                self.assertEqual(rc, 2)
                self.assertRegex(err, what)

    def test_check_holds_the_readme_table_of_stages_to_the_stages_file(self):
        # dev/README.md's table lists each stage once with its priority (- on demand); `check` names a stage it
        # lacks, one it lists with another priority, one the stages file has not, and one listed twice.
        table = ("# dev\n\n| priority | stage | what |\n|---|---|---|\n| 1 | `fast` | quick |\n"
                 "| 2 | `slow` | slow |\n| 3 | `mid` | mid |\n| - | `demand` | on demand |\n\nafter `other`\n")
        self.repo.write("dev/README.md", table)
        rc, out, _ = self.repo.run("check")
        self.assertEqual(rc, 0)
        self.assertIn("each in dev/README.md with its priority", out)
        for text, what in [
                (table.replace("| 3 | `mid` | mid |\n", ""), "lacks mid \\(priority 3"),
                (table.replace("| 3 | `mid`", "| 4 | `mid`"), "README.md:7: stage mid has priority 4, "
                                                               "dev/gpu_stages.tsv 3"),
                (table.replace("`demand` |", "`demand`, `gone` |"), "README.md:8: stage gone is not in"),
                (table.replace("`slow` |", "`slow`, `fast` |"), "README.md:6: stage fast is listed twice"),
                (table.replace("| priority | stage | what |", "| stage | what |"), "no table of the stages")]:
            with self.subTest(what=what):
                self.repo.write("dev/README.md", text)
                rc, _, err = self.repo.run("check")
                self.assertEqual(rc, 2)
                self.assertRegex(err, what)

    def test_stale_report(self):
        h = self.repo.covered("HEAD")
        self.repo.ledger([row(stage="fast", covered=h["fast"]), row(stage="mid", covered="0" * 16),
                          row(stage="slow", covered=h["slow"], result="fail")])
        rc, out, _ = self.repo.run("stale")
        self.assertEqual(rc, 0)
        self.assertIn("2 of 3 stale", out)
        self.assertRegex(out, r"fast +fresh +last pass 2026-11-27 at 0123456789ab")
        self.assertRegex(out, r"mid +stale +last pass")
        self.assertRegex(out, r"slow +stale +never passed")  # a fail is no pass
        self.assertNotIn("demand", out)
        # A later pass on the files as they are makes the stage fresh; a change to them makes it stale again.
        self.repo.ledger([row(stage=s, covered=h[s]) for s in ("fast", "mid", "slow")])
        self.assertIn("none stale", self.repo.run("stale")[1])
        self.repo.write("lib/x.cpp", "x changed\n")
        rc, out, _ = self.repo.run("stale")
        self.assertIn("1 of 3 stale", out)
        self.assertRegex(out, r"mid +stale")

    def test_stale_report_never_fails(self):
        self.repo.write("docs/gpu_runs.tsv", "not a ledger\n")
        rc, out, _ = self.repo.run("stale")
        self.assertEqual(rc, 0)
        self.assertIn("no report", out)
        self.assertEqual(self.repo.run("check")[0], 2)

    def test_rows_are_checked_by_column(self):
        names = {"fast", "slow", "mid", "demand"}
        cases = [(dict(date="2026-13-01"), "date"), (dict(date="27-11-2026"), "date"),
                 (dict(commit="0123456"), "commit"), (dict(commit=COMMIT + "-modified"), "commit"),
                 (dict(card=" "), "card"), (dict(stage="nope"), "stage 'nope'"), (dict(result="ok"), "result"),
                 (dict(result="skipped:"), "result"), (dict(seconds="1.5"), "seconds"),
                 (dict(covered="abc"), "covered")]
        for change, what in cases:
            with self.subTest(change=change):
                with self.assertRaisesRegex(g.LedgerError, what):
                    g.check_row(row(**change), names)
        for ok in (dict(commit=COMMIT + "-dirty"), dict(result="skipped: one GPU"), dict(seconds="-"),
                   dict(covered="0123456789abcdef"), dict(result="partial")):
            g.check_row(row(**ok), names)

    def test_queue_runs_what_fits_and_leaves_the_rest(self):
        stage_sh = os.path.join(self.repo.root, "stage.sh")
        self.repo.write("stage.sh", STAGE_SH)
        manifest = os.path.join(self.repo.root, "manifest.json")
        self.assertEqual(self.repo.run("manifest", "-o", manifest)[0], 0)
        m = read_json(manifest)
        self.assertEqual(m["commit"][:40], subprocess.run(["git", "-C", self.repo.root, "rev-parse", "HEAD"],
                                                          capture_output=True, text=True).stdout.strip())
        self.assertFalse(m["commit"].endswith("-dirty"), "an untracked file leaves the commit clean")
        self.assertEqual([s["stage"] for s in m["stages"]], ["fast", "slow", "mid"])
        self.assertTrue(all(s["stale"] for s in m["stages"]))
        rows = os.path.join(self.repo.root, "out", "rows.tsv")
        os.environ["STAGE_PLAN"] = "fast:1:pass mid:1:partial"
        t0 = time.monotonic()
        rc, out, err = self.repo.run("queue", "--manifest", manifest, "--card", "NVIDIA H200", "--rows", rows,
                                     "--budget-s", "40", "--", "bash", stage_sh)
        self.assertEqual(rc, 0, err)
        self.assertLess(time.monotonic() - t0, 40)
        self.assertRegex(out, r"ran +fast +pass")
        self.assertRegex(out, r"ran +mid +partial")
        self.assertRegex(out, r"left +slow +expected 100 s: more than a call of --budget-s 40 holds")
        got = g.read_tsv(rows, g.COLUMNS)
        self.assertEqual([r["stage"] for r in got], ["fast", "mid"], "priority order; slow waits")
        covered = {s["stage"]: s["covered"] for s in m["stages"]}
        for r in got:
            self.assertEqual(r["commit"], m["commit"])
            self.assertEqual(r["card"], "NVIDIA H200")
            self.assertEqual(r["covered"], covered[r["stage"]])
            self.assertIn(r["seconds"], ("1", "2"))
            self.assertEqual(r["note"], f"figures of {r['stage']}")
        # The rows append to the ledger, which makes those stages' passes count (mid's partial does not).
        self.assertEqual(self.repo.run("append", rows)[0], 0)
        rc, out, _ = self.repo.run("stale")
        self.assertRegex(out, r"fast +fresh")
        self.assertRegex(out, r"mid +stale")
        # Appending the same rows again is refused, naming the row.
        rc, _, err = self.repo.run("append", rows)
        self.assertEqual(rc, 2)
        self.assertIn("in the ledger already", err)

    def test_manifest_names_a_dirty_tree(self):
        self.repo.write("src/a.cu", "kernel a, edited\n")
        manifest = os.path.join(self.repo.root, "manifest.json")
        self.repo.run("manifest", "-o", manifest)
        m = read_json(manifest)
        self.assertTrue(m["commit"].endswith("-dirty"))
        self.assertEqual({s["stage"]: s["covered"] for s in m["stages"]}, self.repo.covered())
        self.assertNotEqual(self.repo.covered()["slow"], self.repo.covered("HEAD")["slow"])

    def test_queue_stops_a_stage_at_the_budget(self):
        self.repo.write("stage.sh", STAGE_SH)
        self.repo.write("dev/gpu_stages.tsv", STAGES.replace("fast\t1\t2", "fast\t1\t1"))
        manifest = os.path.join(self.repo.root, "manifest.json")
        self.repo.run("manifest", "-o", manifest)
        rows = os.path.join(self.repo.root, "rows.tsv")
        os.environ["STAGE_PLAN"] = "fast:60:pass"
        t0 = time.monotonic()
        # 20 s, of which the queue keeps 15: fast (expected 1 s) gets 5 and hangs; nothing else fits after it.
        rc, out, err = self.repo.run("queue", "--manifest", manifest, "--card", "c", "--rows", rows,
                                     "--budget-s", "20", "--", "bash", os.path.join(self.repo.root, "stage.sh"))
        elapsed = time.monotonic() - t0
        self.assertEqual(rc, 0, err)
        self.assertLess(elapsed, 20)
        (r,) = g.read_tsv(rows, g.COLUMNS)
        self.assertEqual((r["stage"], r["result"]), ("fast", "fail"))
        self.assertRegex(r["note"], r"stopped at its limit of [45] s")  # 5 s less the time to start it
        self.assertRegex(out, r"left +mid +expected 3 s, [0-9]+ s left: for the next call")

    def test_queue_with_nothing_stale_says_so(self):
        h = self.repo.covered("HEAD")
        self.repo.ledger([row(stage=s, covered=h[s]) for s in ("fast", "mid", "slow")])
        git(self.repo.root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "ledger")
        manifest = os.path.join(self.repo.root, "manifest.json")
        self.repo.run("manifest", "-o", manifest)
        rc, out, _ = self.repo.run("queue", "--manifest", manifest, "--card", "c", "--rows",
                                   os.path.join(self.repo.root, "rows.tsv"), "--", "false")
        self.assertEqual(rc, 0)
        self.assertIn("no stage is stale", out)
        self.assertFalse(os.path.exists(os.path.join(self.repo.root, "rows.tsv")))

    def test_a_stage_without_a_result_or_with_a_bad_exit_fails(self):
        self.repo.write("stage.sh", STAGE_SH)
        manifest = os.path.join(self.repo.root, "manifest.json")
        self.repo.run("manifest", "-o", manifest)
        rows = os.path.join(self.repo.root, "rows.tsv")
        os.environ["STAGE_PLAN"] = ""  # stage.sh exits 3 for every stage, reporting nothing
        self.repo.run("queue", "--manifest", manifest, "--card", "c", "--rows", rows, "--budget-s", "60",
                      "--stages", "demand", "--", "bash", os.path.join(self.repo.root, "stage.sh"))
        (r,) = g.read_tsv(rows, g.COLUMNS)
        self.assertEqual((r["stage"], r["result"], r["covered"]), ("demand", "fail", "-"))
        self.assertIn("exit 3", r["note"])

    def test_bench_ratio_held_to_its_last_pass_on_the_same_card(self):
        rows = [dict(row(stage="fast", note="ratio=1.35 (trainer / torch.compile)"), _where="x")]
        self.assertEqual(g.judge_ratio(rows, "fast", "NVIDIA H100 80GB HBM3", "pass", "ratio=1.33")[0], "pass")
        result, note = g.judge_ratio(rows, "fast", "NVIDIA H100 80GB HBM3", "pass", "ratio=1.25")
        self.assertEqual(result, "fail")
        self.assertIn("-7.4%: a regression", note)
        self.assertIn("baseline", g.judge_ratio(rows, "fast", "NVIDIA H200", "pass", "ratio=1.0")[1])
        self.assertEqual(g.judge_ratio(rows, "fast", "NVIDIA H100 80GB HBM3", "pass", "no ratio")[1], "no ratio")

    def test_table_is_made_from_the_ledger(self):
        self.repo.ledger([row(date="2026-11-26", note="older | with a bar"), row(date="2026-11-27", stage="mid")])
        rc, _, err = self.repo.run("table", "--check")
        self.assertEqual(rc, 1)
        self.assertIn("differs", err)
        self.assertEqual(self.repo.run("table")[0], 0)
        self.assertEqual(self.repo.run("table", "--check")[0], 0)
        with open(os.path.join(self.repo.root, "docs/gpus.md")) as f:
            text = f.read()
        self.assertTrue(text.startswith("# GPUs\n\nbefore\n") and text.endswith("after\n"))
        lines = [l for l in text.split("\n") if l.startswith("| 2026")]
        self.assertEqual(len(lines), 2)
        self.assertTrue(lines[0].startswith("| 2026-11-27 | 0123456 |"), "newest first")
        self.assertIn("older \\| with a bar", lines[1])


if __name__ == "__main__":
    unittest.main()
