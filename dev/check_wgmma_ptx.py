#!/usr/bin/env python3
"""Checks compiled PTX for the register rule of Hopper's asynchronous warpgroup MMA (kernels/cuda/wgmma.cuh).

wgmma.mma_async reads its A fragments and reads and writes its accumulators asynchronously, from the instruction to
the wgmma.wait_group that retires its group. The PTX ISA asks for a wgmma.fence between any other instruction's write
of those registers and the wgmma, and for no access of them while the wgmma is in flight. The compiler cannot see
this (an inline asm statement's data flow ends at the statement), so wgmma.cuh fences the operands; this script
checks what nvcc made of it, reading each function's statements in order:
  - a wgmma's operand registers were not written by another instruction since the last wgmma.fence;
  - no instruction but a wgmma touches a register of a wgmma issued and not yet retired (wgmma.wait_group N retires
    all committed groups but the N newest).
The statements are read in the order of the text: our kernels retire every group before any branch leaves the code
that issued it. With --ptxas PATH, each file is also assembled for sm_90a, and ptxas's note that it serialized the
wgmma of a function (C7514: it waits after each one, where another instruction touches their registers while they
are in flight) is an error too: the overlap the kernels are written for would be gone.

Usage: check_wgmma_ptx.py [--ptxas PATH] FILE.ptx [FILE.ptx ...]   (';'-separated lists too, as CMake passes them)
Exit status 0 when every group keeps the rule (and at least one group was found), 1 otherwise.
"""
import re
import subprocess
import sys

REGISTER = re.compile(r"%[a-z]+[0-9]+")


def wgmma_operands(stmt):
    """The accumulator and A-fragment registers of a wgmma.mma_async: its braced register lists."""
    return set(REGISTER.findall(" ".join(re.findall(r"\{([^}]*)\}", stmt))))


def destinations(stmt):
    """The registers an instruction writes: its first operand (a register or a braced list of them)."""
    body = stmt.split(None, 1)
    if len(body) < 2 or body[0].startswith(("st.", "bar", "cp.", "fence", "wgmma", "ret", "bra", "red.", "prefetch")):
        return set()
    first = body[1]
    if first.startswith("{"):
        return set(REGISTER.findall(first[: first.index("}") + 1]))
    return set(REGISTER.findall(first.split(",")[0]))


def check(path, text, errors):
    """The rule over one PTX file; appends a line per violation to errors and returns the groups it saw committed."""
    groups = 0
    # Braced wgmma statements span several lines: join the file (comments dropped) and split it at each ';'.
    joined = " ".join(line.split("//")[0].strip() for line in text.split("\n"))
    function = None
    written = set()  # registers written since the last wgmma.fence
    open_group, committed = set(), []  # operands of the wgmma issued since the last commit; committed groups, oldest first
    for stmt in re.split(r";", joined):
        stmt = stmt.strip()
        m = re.search(r"\.entry\s+([^\s(]+)", stmt)
        if m:
            function, written, open_group, committed = m.group(1), set(), set(), []
        # The statement itself, after any label, brace of a scope or guard predicate.
        stmt = re.sub(r"^(?:[{}]\s*|\$?[A-Za-z_0-9$]+:\s*|@!?%[a-z]+[0-9]+\s+)+", "", stmt)
        if not stmt or stmt.startswith("."):
            continue
        if stmt.startswith("wgmma.fence"):
            written = set()
        elif stmt.startswith("wgmma.mma_async"):
            operands = wgmma_operands(stmt)
            late = sorted(operands & written)
            if late:
                errors.append(f"{path}: {function}: {', '.join(late)} written after the last wgmma.fence, then read by "
                              f"{stmt[:60]}...")
                written -= operands  # each write reported once
            open_group |= operands
        elif stmt.startswith("wgmma.commit_group"):
            if open_group:
                committed.append(open_group)
                groups += 1
            open_group = set()
        elif stmt.startswith("wgmma.wait_group"):
            keep = int(stmt.split()[-1])
            committed = committed[len(committed) - keep:] if keep > 0 else []
        else:
            touched = set(REGISTER.findall(stmt)) & open_group.union(*committed)
            if touched:
                errors.append(f"{path}: {function}: {', '.join(sorted(touched))} accessed while a wgmma is in flight: "
                              f"{stmt}")
            written |= destinations(stmt)
    return groups


def self_test():
    """The checker on small functions: ones that keep the rule, and ones that break each part of it."""
    def wgmma(acc, a):
        return (f"wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{acc}}}, {{{a}}}, %rd1, p, 1, 1, 1;\n")

    first, second = wgmma("%f1, %f2", "%r1, %r2, %r3, %r4"), wgmma("%f11, %f12", "%r5, %r6, %r7, %r8")
    fence, commit = "wgmma.fence.sync.aligned;\n", "wgmma.commit_group.sync.aligned;\n"

    def function(body):
        return ".visible .entry k(\n{\nmov.f32 %f1, 0f00000000;\n" + body + "add.f32 %f3, %f1, %f2;\n}\n"

    def one(before, inflight):
        return function(fence + before + first + commit + inflight + "wgmma.wait_group.sync.aligned 0;\n")

    def two(between, wait, after):
        return function(fence + first + commit + between + fence + second + commit +
                        f"wgmma.wait_group.sync.aligned {wait};\n" + after)

    cases = [("clean", one("add.s32 %r9, %r8, 16;\n", "add.s32 %r9, %r9, 1;\n"), 1, 0),
             ("write after the fence", one("mov.f32 %f2, 0f00000000;\n", ""), 1, 1),
             ("A fragment packed after the fence", one("@%p1 cvt.rn.bf16x2.f32 %r3, %f7, %f8;\n", ""), 1, 1),
             ("read in flight", one("", "mul.f32 %f5, %f1, %f4;\n"), 1, 1),
             ("two groups, the second's A packed between them", two("cvt.rn.bf16x2.f32 %r5, %f7, %f8;\n", 0, ""), 2, 0),
             ("two groups, the first's accumulator read between them", two("mul.f32 %f5, %f2, %f4;\n", 0, ""), 2, 1),
             ("wait_group 1 retires the older group only",
              two("", 1, "mul.f32 %f5, %f1, %f4;\nmul.f32 %f6, %f11, %f4;\nwgmma.wait_group.sync.aligned 0;\n"), 2, 1)]
    ok = True
    for name, text, want_groups, want_errors in cases:
        errors = []
        found = check(name, text, errors)
        if found != want_groups or len(errors) != want_errors:
            print(f"self-test: {name}: {found} groups, {len(errors)} violations (expected {want_groups}, "
                  f"{want_errors}): {errors}")
            ok = False
    return ok


def serialized(ptxas, path):
    """ptxas's notes that it serialized a function's wgmma, assembling the file for sm_90a."""
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", "/dev/null"], capture_output=True, text=True)
    if r.returncode != 0:
        return [f"{path}: ptxas failed: {r.stderr.strip()}"]
    return [f"{path}: {line.strip()}" for line in r.stderr.splitlines() if "serialized" in line and "wgmma" in line]


def main(argv):
    if not self_test():
        return 1
    ptxas = None
    if len(argv) >= 2 and argv[0] == "--ptxas":
        ptxas, argv = argv[1], argv[2:]
    paths = [p for arg in argv for p in arg.split(";") if p]
    if not paths:
        print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
        return 2
    errors, groups = [], 0
    for path in paths:
        with open(path) as f:
            groups += check(path, f.read(), errors)
        if ptxas:
            errors += serialized(ptxas, path)
    for e in errors:
        print("error:", e)
    if groups == 0:
        print("error: no committed group of wgmma in", ", ".join(paths))
        return 1
    print(f"{groups} groups of wgmma in {len(paths)} files, {len(errors)} violations of the register rule")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
