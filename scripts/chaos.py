#!/usr/bin/env python3
"""Goodput under failure (run by scripts/chaos.sh): a multi-rank CPU run under `trainer launch --max-restarts`, with
failures injected on purpose, against an uninterrupted run of the same steps.

Failures, in turn, each when the run's newest logged step passes a random step:
  kill       SIGKILL of a random rank (the launcher restarts every rank from the newest complete checkpoint)
  save-kill  SIGKILL of a random rank while a checkpoint is being written (its temporary folder exists)
  sigterm    SIGTERM to the launcher: every rank saves its step and the job ends (143), as a preempted job; the
             script starts it again with try_load_latest_save, as a scheduler's requeue would
  slow       one rank stopped half of every 20 ms for 2 s (SIGSTOP/SIGCONT): not a failure, a straggler
  link       with --nodes N (N > 1, root): the ranks run on N nodes of a network lab (scripts/netlab.sh), each node
             its own network stack, and node 1's link is down for 3 s (a cable pulled and put back)
Prints the failures, the restarts, the steps lost to each failure (steps trained again), goodput (the share of the
wall time spent in steps that count: each step's last run), and whether every checkpoint left in the folder loads
and the final parameters equal the uninterrupted run's bit for bit. Exit status 1 if they do not, or if a failure
lost more than save_interval steps plus the steps a checkpoint written in the background (save_async) was in flight
before it was published.
"""
import argparse
import glob
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time


def metrics(path):
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written
    return out


def newest_step(path):
    records = [r for r in metrics(path) if "step" in r and "loss" in r]
    return records[-1]["step"] if records else 0


def rank_pids(logs):
    """The pids of the current round's ranks, from the launchers' "[launch] rank R (...): pid P," lines."""
    pids = {}
    for log in logs:
        if not os.path.exists(log):
            continue
        for line in open(log, errors="replace"):
            if line.startswith("[launch] rank ") and ": pid " in line:
                rank = int(line.split()[2])
                pids[rank] = int(line.split(": pid ")[1].split(",")[0])
    return pids


class Job:
    """One launcher a node (`trainer launch` of the node's ranks), as a scheduler starts and signals them."""

    def __init__(self, procs):
        self.procs = procs

    def poll(self):
        """None while any node's launcher runs, else the first non-zero exit status (or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def send_signal(self, sig):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self):
        codes = [p.wait() for p in self.procs]
        return next((c for c in codes if c != 0), 0)


def restart_count(log):
    """The restarts a launcher's log records."""
    return open(log, errors="replace").read().count("[launch] restart ") if os.path.exists(log) else 0


def kill(pid, sig):
    """Sends `sig`; False when the process is already gone (it ended between the choice and the signal)."""
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, TypeError):
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--failures", type=int, default=6)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default="data/bench_tokens.bin")
    p.add_argument("--nodes", type=int, default=1)
    a = p.parse_args()
    if a.ranks < 2 or a.steps < 20 or a.failures < 1 or a.save_interval < 1:
        sys.exit("error: chaos: --ranks >= 2, --steps >= 20, --failures >= 1 and --save-interval >= 1 expected")
    if a.nodes < 1 or a.ranks % a.nodes != 0:
        sys.exit(f"error: chaos: --nodes {a.nodes}: expected a divisor of --ranks {a.ranks}")
    if a.nodes > 1 and os.geteuid() != 0:
        sys.exit("error: chaos: --nodes > 1 runs the nodes in a network lab (scripts/netlab.sh), which needs root")
    rng = random.Random(a.seed)
    tmp = tempfile.mkdtemp(prefix="chaos_")
    netlab = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netlab.sh")
    lab = f"tnl{os.getpid()}"
    if a.nodes > 1:
        # The nodes' launchers are one job: they share a rendezvous secret (made here unless the caller set one).
        if not os.environ.get("TRAINER_STORE_SECRET") and not os.environ.get("TRAINER_STORE_SECRET_FILE"):
            os.environ["TRAINER_STORE_SECRET"] = secrets.token_hex(32)
        subprocess.run(["bash", netlab, "up", lab, str(a.nodes)], check=True)
    try:
        run_chaos(a, rng, tmp, netlab, lab)
    finally:
        if a.nodes > 1:
            subprocess.run(["bash", netlab, "down", lab])


def run_chaos(a, rng, tmp, netlab, lab):
    train = ["--config", "configs/tiny.json", "--data", a.data, "--max-duration", str(a.steps), "--threads", "1",
             "--strategy", "fsdp", "--set", f"save_interval={a.save_interval}", "--set", "console_log_interval=100000",
             "--set", "device_train_microbatch_size=4", "--set", f"global_train_batch_size={8 * a.ranks}",
             "--set", "distributed_timeout_seconds=20"]

    def logs(log):
        return [log] if a.nodes == 1 else [f"{log}.node{i}" for i in range(a.nodes)]

    def launch(folder, metrics_file, log, extra=(), restarts=0):
        """Every node's launcher (each in its namespace of the lab with --nodes); its output in logs(log)."""
        port = str(20000 + rng.randrange(20000))
        train_args = train + ["--save-folder", folder, "--metrics-file", metrics_file] + list(extra)
        procs = []
        for node, node_log in enumerate(logs(log)):
            argv = [a.trainer, "launch", "--nproc-per-node", str(a.ranks // a.nodes), "--master-port", port,
                    "--max-restarts", str(restarts)]
            if a.nodes > 1:
                master = subprocess.run(["bash", netlab, "addr", "0"], capture_output=True, text=True,
                                        check=True).stdout.strip()
                argv = ["bash", netlab, "exec", lab, str(node)] + argv + [
                    "--nnodes", str(a.nodes), "--node-rank", str(node), "--master-addr", master]
            procs.append(subprocess.Popen(argv + ["--"] + train_args, stdout=open(node_log, "a"),
                                          stderr=subprocess.STDOUT))
        return Job(procs)

    # The uninterrupted run.
    ref_folder = f"{tmp}/ref"
    t0 = time.time()
    if launch(ref_folder, f"{tmp}/ref.jsonl", f"{tmp}/ref.log", restarts=1).wait() != 0:
        sys.exit(f"error: chaos: the uninterrupted run failed; its log: {tmp}/ref.log")
    ref_wall = time.time() - t0

    # The run under failures.
    folder, mfile, log = f"{tmp}/run", f"{tmp}/run.jsonl", f"{tmp}/run.log"
    kinds = ["kill", "save-kill", "link" if a.nodes > 1 else "kill", "sigterm", "slow", "kill"]
    plan = sorted(rng.sample(range(a.save_interval, a.steps - 5), a.failures))
    restarts_allowed = a.failures + 2
    t0 = time.time()
    proc = launch(folder, mfile, log, restarts=restarts_allowed)
    events, requeues = [], 0
    for i, at in enumerate(plan):
        kind = kinds[i % len(kinds)]
        while newest_step(mfile) < at and proc.poll() is None:
            time.sleep(0.002)
        if proc.poll() is not None:
            break
        pids = rank_pids(logs(log))
        victim_rank = rng.randrange(a.ranks)
        victim = pids.get(victim_rank)
        if kind == "save-kill":
            # Until a save's temporary folder appears (the next multiple of save_interval), then the kill.
            deadline = time.time() + 30
            while not glob.glob(f"{folder}/.step*.tmp-*") and time.time() < deadline and proc.poll() is None:
                time.sleep(0.0002)
            pids = rank_pids(logs(log))
            victim = pids.get(victim_rank)
            kill(victim, signal.SIGKILL)
            landed = bool(glob.glob(f"{folder}/.step*.tmp-*"))
            events.append((kind, newest_step(mfile), f"rank {victim_rank}" + ("" if landed else " (the save ended first)")))
        elif kind == "kill":
            gone = not kill(victim, signal.SIGKILL)
            events.append((kind, newest_step(mfile), f"rank {victim_rank}" + (" (already gone)" if gone else "")))
        elif kind == "link":
            # Node 1's cable pulled for 3 s, well inside distributed_timeout_seconds: TCP holds the connections
            # and the collectives go on once it is back; a restart would show in the launchers' logs.
            restarts_before = restart_count(logs(log)[0])
            subprocess.run(["bash", netlab, "link", lab, "1", "down"], check=True)
            time.sleep(3.0)
            subprocess.run(["bash", netlab, "link", lab, "1", "up"], check=True)
            step = newest_step(mfile)
            deadline = time.time() + 30
            while newest_step(mfile) <= step + 2 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.01)
            restarted = restart_count(logs(log)[0]) > restarts_before
            events.append((kind, step, "node 1's link down for 3 s; " +
                           ("the ranks were restarted" if restarted else "training went on, no restart")))
        elif kind == "sigterm":
            proc.send_signal(signal.SIGTERM)
            code = proc.wait()
            events.append((kind, newest_step(mfile), f"launcher exit {code}; requeued"))
            requeues += 1
            proc = launch(folder, mfile, log, ["--set", "try_load_latest_save=true"], restarts=restarts_allowed)
        elif kind == "slow":
            stop = time.time() + 2.0
            while time.time() < stop and kill(victim, signal.SIGSTOP):
                time.sleep(0.01)
                kill(victim, signal.SIGCONT)
                time.sleep(0.01)
            events.append((kind, newest_step(mfile), f"rank {victim_rank} at half speed for 2 s"))
        # The next failure waits for the restarted round's first step, so that each is its own.
        if kind in ("kill", "save-kill"):
            round_pids = pids
            deadline = time.time() + 60
            while rank_pids(logs(log)) == round_pids and time.time() < deadline and proc.poll() is None:
                time.sleep(0.01)
    code = proc.wait()
    wall = time.time() - t0
    restarts = restart_count(logs(log)[0])

    # Steps lost: each time the logged step goes back, the steps from the resumed one to the last before it.
    records = [r for r in metrics(mfile) if "step" in r and "loss" in r]
    lost, prev = [], 0
    last_time = {}
    # Checkpoints written in the background (save_async) are published some steps after their own: a failure in
    # between resumes from the one before, so it may lose that many steps more than save_interval.
    in_flight = max([r["step"] - r["checkpoint_published"] for r in records if "checkpoint_published" in r], default=0)
    for r in records:
        if r["step"] <= prev:
            lost.append(prev - r["step"] + 1)
        prev = r["step"]
        last_time[r["step"]] = r["step_time_ms"] / 1e3
    goodput = sum(last_time.values()) / wall if wall > 0 else 0.0

    # Every checkpoint left loads (checksums verified), and the final parameters against the uninterrupted run's.
    unreadable = []
    for ck in sorted(glob.glob(f"{folder}/step*")):
        out = f"{tmp}/check.safetensors"
        if subprocess.run([a.trainer, "export", "--checkpoint", ck, "-o", out], capture_output=True).returncode != 0:
            unreadable.append(os.path.basename(ck))
    final = f"step{a.steps}"
    same = False
    if os.path.isdir(f"{folder}/{final}"):
        subprocess.run([a.trainer, "export", "--checkpoint", f"{ref_folder}/{final}", "-o", f"{tmp}/ref.safetensors"], check=True,
                       capture_output=True)
        subprocess.run([a.trainer, "export", "--checkpoint", f"{folder}/{final}", "-o", f"{tmp}/run.safetensors"], check=True,
                       capture_output=True)
        same = open(f"{tmp}/ref.safetensors", "rb").read() == open(f"{tmp}/run.safetensors", "rb").read()

    where = f" on {a.nodes} nodes of a network lab" if a.nodes > 1 else ""
    print(f"chaos: {a.ranks} ranks{where}, {a.steps} steps, checkpoint every {a.save_interval}, seed {a.seed}")
    print("| failure | at step | what |")
    print("|---|---|---|")
    for kind, step, what in events:
        print(f"| {kind} | {step} | {what} |")
    print(f"\nrun ended with exit status {code}; {restarts} restarts by the launcher, {requeues} requeue(s) after a "
          f"stop signal")
    print(f"steps lost to each failure: {lost} (at most save_interval {a.save_interval} + the {in_flight} steps a "
          f"checkpoint was written in the background at most)")
    print(f"wall time {wall:.1f} s against {ref_wall:.1f} s uninterrupted; goodput {100 * goodput:.1f}% "
          f"(time in the steps that count over the wall time)")
    print(f"checkpoints left: {len(glob.glob(folder + '/step*'))}, unreadable: {unreadable or 'none'}")
    print(f"final parameters: {'identical to the uninterrupted run' if same else 'DIFFERENT from the uninterrupted run'}")
    ok = code == 0 and same and not unreadable and all(n <= a.save_interval + in_flight for n in lost)
    if not ok:
        print(f"error: chaos: the run did not survive as it should; logs in {tmp}", file=sys.stderr)
        sys.exit(1)
    subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
