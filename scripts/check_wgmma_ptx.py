#!/usr/bin/env python3
"""Checks compiled PTX for the register rule of Hopper's asynchronous warpgroup MMA (kernels/cuda/wgmma.cuh).

wgmma.mma_async reads its A fragments and reads and writes its accumulators asynchronously, from the instruction to
the wgmma.wait_group that retires it. The PTX ISA asks wgmma.fence between any other instruction's access of those
registers and the wgmma, and no access of them while the wgmma is in flight. The compiler cannot see this (an inline
asm statement's data flow ends at the statement), so wgmma_batch fences the operands; this script checks what nvcc
made of it, in each batch (wgmma.fence .. wgmma.commit_group .. wgmma.wait_group):
  - between the fence and the commit, no instruction but a wgmma writes a register of the batch's wgmma operands;
  - between the commit and the wait, no instruction touches one.

Usage: check_wgmma_ptx.py FILE.ptx [FILE.ptx ...]   (arguments may also be ';'-separated lists, as CMake passes them)
Exit status 0 when every batch keeps the rule (and at least one batch was found), 1 otherwise.
"""
import re
import sys

REGISTER = re.compile(r"%[a-z]+[0-9]+")


def wgmma_operands(stmt):
    """The accumulator and A-fragment registers of a wgmma.mma_async: its braced register lists."""
    return set(REGISTER.findall(" ".join(re.findall(r"\{([^}]*)\}", stmt))))


def destinations(stmt):
    """The registers an instruction writes: its first operand (a register or a braced list of them)."""
    body = stmt.split(None, 1)
    if len(body) < 2 or body[0].startswith(("st.", "bar", "cp.", "fence", "wgmma", "ret", "bra", "@")):
        return set()
    first = body[1]
    if first.startswith("{"):
        return set(REGISTER.findall(first[: first.index("}") + 1]))
    return set(REGISTER.findall(first.split(",")[0]))


def check(path, text, errors):
    batches = 0
    # Braced wgmma statements span several lines: join the file into one string of statements per ';', keeping braces
    # of register lists inside a wgmma together.
    joined = " ".join(line.split("//")[0].strip() for line in text.split("\n"))
    phase, operands, written = None, set(), []
    function = None
    for stmt in re.split(r";", joined):
        stmt = stmt.strip()
        m = re.search(r"\.entry\s+([^\s(]+)", stmt)
        if m:
            function = m.group(1)
        # The statement itself, after any label or opening brace of a scope.
        stmt = re.sub(r"^(?:[{}]\s*|\$?[A-Za-z_0-9$]+:\s*)+", "", stmt)
        if not stmt or stmt.startswith((".", "//")):
            continue
        if stmt.startswith("wgmma.fence"):
            phase, operands, written = "issue", set(), []
            continue
        if phase is None:
            continue
        if stmt.startswith("wgmma.mma_async"):
            operands |= wgmma_operands(stmt)
            continue
        if stmt.startswith("wgmma.commit_group"):
            bad = [(s, sorted(d & operands)) for s, d in written if d & operands]
            for s, regs in bad:
                errors.append(f"{path}: {function}: {', '.join(regs)} written between wgmma.fence and the batch: {s}")
            phase = "inflight"
            continue
        if stmt.startswith("wgmma.wait_group"):
            batches += 1
            phase = None
            continue
        if phase == "issue":
            written.append((stmt, destinations(stmt)))
        elif phase == "inflight":
            touched = set(REGISTER.findall(stmt)) & operands
            if touched:
                errors.append(f"{path}: {function}: {', '.join(sorted(touched))} accessed while the wgmma is in flight: "
                              f"{stmt}")
    return batches


def self_test():
    """The checker against three small batches: one that keeps the rule, and one that breaks each half of it."""
    wgmma = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1, %f2}, {%r1, %r2, %r3, %r4}, %rd1, p, 1, 1, "
             "1;")

    def batch(before, inflight):
        return (".visible .entry k(\n{\n" + "mov.f32 %f1, 0f00000000;\nwgmma.fence.sync.aligned;\n" + before + wgmma +
                "\nwgmma.commit_group.sync.aligned;\n" + inflight + "wgmma.wait_group.sync.aligned 0;\n"
                "add.f32 %f3, %f1, %f2;\n}\n")

    cases = [("clean", batch("add.s32 %r9, %r8, 16;\n", "add.s32 %r9, %r9, 1;\n"), 0),
             ("write after the fence", batch("mov.f32 %f2, 0f00000000;\n", ""), 1),
             ("A fragment packed after the fence", batch("cvt.rn.bf16x2.f32 %r3, %f7, %f8;\n", ""), 1),
             ("read in flight", batch("", "mul.f32 %f5, %f1, %f4;\n"), 1)]
    ok = True
    for name, text, expected in cases:
        errors = []
        found = check(name, text, errors)
        if found != 1 or len(errors) != expected:
            print(f"self-test: {name}: {found} batches, {len(errors)} violations (expected 1, {expected})")
            ok = False
    return ok


def main(argv):
    if not self_test():
        return 1
    paths = [p for arg in argv for p in arg.split(";") if p]
    if not paths:
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    errors, batches = [], 0
    for path in paths:
        with open(path) as f:
            batches += check(path, f.read(), errors)
    for e in errors:
        print("error:", e)
    if batches == 0:
        print("error: no wgmma batch (wgmma.fence .. wgmma.wait_group) in", ", ".join(paths))
        return 1
    print(f"{batches} wgmma batches in {len(paths)} files, {len(errors)} violations of the register rule")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
