"""The same training run at two git revisions: CPU seconds per sampled token, interleaved.

    pip install -e '.[bench]'
    python bench/revisions.py [--quick] [--steps 40] [--seeds 0,1] BEFORE [AFTER]

Speed parity across a refactor, measured so that other jobs on the machine do not decide it: each
revision (AFTER defaults to the working tree) is checked out into a temporary git worktree and
trains the arith recipe's warm-started tiny Qwen3 from the same checkpoint, synchronous and
asynchronous (`bench/vs_trl.py --side molt`, run from that worktree with its own code on the
path), one after the other, alternating revisions, per seed. A run's cost is the CPU time (user +
system) of its whole process tree (the driver, Ray's processes and actors, polled), divided by the
completion tokens it sampled: wall-clock tokens/s moves with whatever else the cores run, CPU per
token moves only with the work each revision does. The same seed samples the same tokens at both
revisions, so the reward columns say whether they trained alike.

`--quick` (a smoke run) compares the working tree with itself over 2 synchronous steps.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import vs_trl  # noqa: E402


def tree_cpu_seconds(child: subprocess.Popen) -> float:
    """Poll the CPU time of `child`'s process tree until it exits; the sum of each process's last
    reading (a process that exits between two polls loses at most one poll interval)."""
    seen: dict[int, float] = {}
    parent = psutil.Process(child.pid)
    while child.poll() is None:
        try:
            processes = [parent, *parent.children(recursive=True)]
        except psutil.Error:
            processes = []
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            seen[process.pid] = times.user + times.system
        time.sleep(0.2)
    return sum(seen.values())


def run_side(tree: Path, model: str, steps: int, extra: list[str]) -> dict:
    """One molt-wb run of the code in `tree`: its CPU seconds, sampled tokens and last reward."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        script = tree / "bench" / "vs_trl.py"
        command = [sys.executable, str(script), "--side", "molt", "--json", out.name]
        # the warm start's path: --model-path since the real-model flags, --model before them
        flag = "--model-path" if "--model-path" in script.read_text() else "--model"
        command += [flag, model, "--steps", str(steps), *extra]
        env = {**os.environ, **vs_trl.OFFLINE, "PYTHONPATH": str(tree)}
        child = subprocess.Popen(
            command, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        cpu = tree_cpu_seconds(child)
        if child.returncode:
            error = child.stderr.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"The run at {tree} failed (exit {child.returncode}):\n{error}")
        result = json.loads(Path(out.name).read_text())
    tokens = sum(result["tokens"])
    return {"cpu_s": cpu, "tokens": tokens, "reward": result["reward"][-1]}


def worktree(revision: str, folder: Path) -> Path:
    """A detached checkout of `revision` under `folder`."""
    path = folder / revision.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), revision],
        check=True,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the working tree against itself")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1", help="comma-separated, e.g. 0,1")
    parser.add_argument("before", nargs="?", help="a git revision, e.g. a commit or a tag")
    parser.add_argument("after", nargs="?", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    if not args.quick and not args.before:
        parser.error("give the revision to compare with, e.g. `python bench/revisions.py HEAD~5`")
    steps = 2 if args.quick else args.steps
    modes = {"sync": []} if args.quick else {"sync": [], "async": vs_trl.ASYNC}
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    from workbench.run import model_paths

    with tempfile.TemporaryDirectory() as folder:
        trees = {"after": REPO}
        if args.quick:
            trees = {"before": REPO, "after": REPO}
        else:
            trees = {"before": worktree(args.before, Path(folder)), **trees}
            if args.after:
                trees["after"] = worktree(args.after, Path(folder))
        costs: dict[tuple[str, str], list[float]] = {}
        print(
            f"{'seed':>4} {'mode':>5} {'revision':>8} {'cpu s':>7} {'tokens':>7} "
            f"{'cpu ms/token':>12} {'reward last':>11}"
        )
        try:
            for seed in seeds:
                extra = [f"seed={seed}"]
                model = model_paths.policy_path(vs_trl.config(steps, extra))
                for mode, more in modes.items():
                    for name, tree in trees.items():
                        r = run_side(tree, model, steps, [*extra, *more])
                        per_token = 1000 * r["cpu_s"] / r["tokens"]
                        costs.setdefault((mode, name), []).append(per_token)
                        print(
                            f"{seed:>4} {mode:>5} {name:>8} {r['cpu_s']:7.1f} "
                            f"{r['tokens']:7.0f} {per_token:12.3f} {r['reward']:11.3f}",
                            flush=True,
                        )
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(
                        ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                        check=False,
                    )
    for mode in modes:
        before = sum(costs[(mode, "before")]) / len(seeds)
        after = sum(costs[(mode, "after")]) / len(seeds)
        print(
            f"{mode}: {before:.3f} -> {after:.3f} cpu ms/token, after / before {after / before:.3f}"
        )


if __name__ == "__main__":
    main()
