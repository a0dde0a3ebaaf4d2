"""A run's memory, two ways, at each learner micro-batch budget: the run summary's peak PSS (each
process at its own peak within a step, summed: an upper bound) and the process tree's total PSS
sampled every 0.2 s from outside (what the run held at once, short of any peak between two
samples), that total's share by process at its largest sample, and the run's training seconds.

    python bench/run_memory.py [--quick] [--budgets 0,256] [override ...]

Default: `+recipe=smol_gcd seed=1` (SmolLM2-135M-Instruct, LoRA; the model cache as it is, so a
first run also converts the model), once per `trainer.max_tokens_per_microbatch` in `--budgets`,
one after the other. `--quick`: the arith recipe's tiny model for 2 steps at budgets 0 and 64.
Linux only (/proc).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.run.memory import descendants  # noqa: E402

# command-line markers of the processes named in the table; the driver is the child itself, and
# every other process is Ray's own (GCS, raylet, agents, monitors, idle workers)
ROLES = {"learner": "ray::Learner", "rollout worker": "ray::RolloutWorker", "store": "ray::Store"}


def pss_kib(pid: int) -> tuple[int, str] | None:
    """Process `pid`'s PSS in KiB and its command line; None when it ended."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    for line in rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]), command
    return None


def role(pid: int, command: str, driver: int) -> str:
    """The table's name of a process of the run."""
    if pid == driver:
        return "driver"
    return next((name for name, marker in ROLES.items() if command.startswith(marker)), "Ray")


def sampled_run(command: list[str], every: float = 0.2) -> dict:
    """Run `command`, sampling its process tree's PSS every `every` seconds: the largest total,
    its KiB by role at that sample, and the wall time."""
    start = time.perf_counter()
    child = subprocess.Popen(command)
    total = 0
    shares = {}
    while child.poll() is None:
        sample = {pid: found for pid in descendants(child.pid) if (found := pss_kib(pid))}
        if sum(kib for kib, _ in sample.values()) > total:
            total = sum(kib for kib, _ in sample.values())
            shares = {}
            for pid, (kib, line) in sample.items():
                name = role(pid, line, child.pid)
                shares[name] = shares.get(name, 0) + kib
        time.sleep(every)
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed with exit status {child.returncode}.")
    return {"total_kib": total, "shares": shares, "wall_s": time.perf_counter() - start}


def one_budget(budget: int, overrides: list[str], root: str) -> dict:
    """A run at micro-batch budget `budget`: its sampled figures, the summary's bound and its
    training seconds."""
    from workbench.run.summary import figures

    run_id = f"memory-budget{budget}"
    molt_wb = str(Path(sys.executable).with_name("molt-wb"))
    command = [molt_wb, "train", *overrides, f"trainer.max_tokens_per_microbatch={budget}"]
    command += [f"run.id={run_id}", f"run.root={root}", "run.progress=false"]
    result = sampled_run(command)
    run = figures(run_id, root)
    result["bound_bytes"] = run["maxima"]["memory/pss_peak_bytes"]
    result["train_s"] = run["sums"]["perf/train_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the tiny arith model, 2 steps")
    parser.add_argument("--budgets", default="0,256", help="trainer.max_tokens_per_microbatch")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: the recipe's)")
    args = parser.parse_args()
    overrides = args.overrides or ["+recipe=smol_gcd", "seed=1"]
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.quick:
        overrides = ["+recipe=arith", "trainer.steps=2", "tracking=none", *args.overrides]
        budgets = [0, 64]
    root = tempfile.mkdtemp(prefix="molt-wb-memory-")
    names = ["learner", "rollout worker", "driver", "store", "Ray"]
    rows = [
        "| micro-batch budget | summary's peak PSS (bound) | sampled total PSS | "
        + " | ".join(names)
        + " | training s | wall s |",
        "| --- " * (len(names) + 5) + "|",
    ]
    for budget in budgets:
        r = one_budget(budget, overrides, root)
        shares = " | ".join(f"{r['shares'].get(name, 0) * 1024 / 1e9:.2f}" for name in names)
        rows.append(
            f"| {budget or 'none'} | {r['bound_bytes'] / 1e9:.2f} GB "
            f"| {r['total_kib'] * 1024 / 1e9:.2f} GB | {shares} "
            f"| {r['train_s']:.1f} | {r['wall_s']:.1f} |"
        )
        print(rows[-1], flush=True)
    # the table again, whole, after the runs' own output
    print(f"molt-wb train {' '.join(overrides)}; {os.cpu_count()} CPU cores", *rows, sep="\n")


if __name__ == "__main__":
    main()
