"""A chaos soak: a long asynchronous run with partial rollouts while a random actor is SIGKILLed.

    python bench/chaos.py [--quick] [--steps 300] [--every 3] [--kills 10] [--seed 0]

The arith recipe (tiny model, 2 rollout workers, async_depth 1, partial rollouts, a checkpoint
every 10 steps) runs in this process; from its first checkpoint on, a thread SIGKILLs a random
actor process (a rollout worker, the learner or the store) every `--every` seconds, `--kills` times
at most. A dead worker is restarted by Ray and its episodes become failure rows; a dead learner or
store restarts the run from its latest checkpoint (recovery.py). At the end it checks the tables
and prints the status, the kills by role, the recoveries, the failure rows, rows duplicated in any
table, steps missing, whether the learner's versions run 1..N without a gap, and whether every
kill left a trace (a recovery after it, or a dead worker's failure rows). Exits 1 on any broken
promise. `--quick`: 60 steps, a checkpoint every 5, a kill every half second, 3 kills.
"""

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench import loop  # noqa: E402
from workbench.checkpoint import latest  # noqa: E402
from workbench.config import compose_config  # noqa: E402
from workbench.store import open_run  # noqa: E402

TITLES = {"rollout worker": "ray::RolloutWorker", "learner": "ray::Learner", "store": "ray::Store"}
TABLE_KEYS = {
    "segments": "rollout_id, segment_idx",
    "tokens": "rollout_id, segment_idx, position",
    "metrics": "step, key",
    "failed_episodes": "step, rollout_id",
}


def title(process) -> str:
    """A process's command line ("ray::Learner" for an actor), or "" once it is gone."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def started(process) -> float:
    try:
        return process.create_time()
    except psutil.Error:
        return 0.0


def killer(run_dir: Path, every: float, most: int, rng: random.Random, kills: list, done):
    """SIGKILL a random actor every `every` seconds, `most` times at most, recording each; from
    the first checkpoint on (before it, a dead learner or store fails the run, by design)."""
    run_json = run_dir / "run.json"
    while not latest(run_dir) and not done.wait(0.5):
        pass
    while len(kills) < most and not done.wait(every * rng.uniform(0.5, 1.5)):
        role = rng.choice(sorted(TITLES))
        row = json.loads(run_json.read_text())
        # the actors of the run's current start, once it has trained two steps: those of a start
        # a recovery ended are going, and Ray restarts a worker killed before its first task unseen
        last = (row.get("recoveries") or [{"time": 0, "checkpoint": "step-000000"}])[-1]
        restarted = row.get("resumes", 0) == len(row.get("recoveries", []))
        settled = restarted and row.get("steps_done", 0) >= int(last["checkpoint"][5:]) + 2
        processes = [
            process
            for process in psutil.Process().children(recursive=True)
            if title(process).startswith(TITLES[role]) and started(process) > last["time"]
        ]
        if not (settled and processes):
            continue
        steps_done = row.get("steps_done", 0)
        with contextlib.suppress(psutil.Error):
            rng.choice(processes).kill()
        kills.append({"role": role, "steps_done": steps_done, "time": time.time()})
        print(f"  killed the {role} after step {steps_done}", flush=True)


def check(db, steps: int, kills: list) -> tuple[list[str], dict]:
    """The broken promises of a finished chaos run, and its counts."""
    problems = []
    status = db.execute("select status from runs").fetchone()[0]
    if status != "finished":
        problems.append(f"status {status}")
    for table, key in TABLE_KEYS.items():
        extra = db.execute(f"select count(*) - count(distinct ({key})) from {table}").fetchone()[0]
        if extra:
            problems.append(f"{extra} duplicated rows in {table}")
    stepped = {row[0] for row in db.execute("select distinct step from metrics").fetchall()}
    missing = sorted(set(range(steps)) - stepped)
    if missing:
        problems.append(f"steps missing from metrics: {missing[:10]}")
    versions = db.execute(
        "select list(value order by step) from metrics where key = 'train/version'"
    ).fetchone()[0]
    if versions != list(range(1, steps + 1)):
        problems.append("the learner's versions are not 1..N step by step")
    recoveries = db.execute("select died, time from recoveries").fetchall()
    worker_deaths = db.execute(
        "select time from failed_episodes where kind in ('worker_died', 'timeout')"
    ).fetchall()
    for kill in kills:
        # a recovery after it restarted every actor; a dead worker's episodes are failure rows
        recovered = any(when >= kill["time"] for _, when in recoveries)
        recorded = kill["role"] == "rollout worker" and any(
            kill["time"] <= when <= kill["time"] + 120 for (when,) in worker_deaths
        )
        if not (recovered or recorded):
            problems.append(
                f"the {kill['role']} killed after step {kill['steps_done']} left no trace"
            )
    counts = {
        "status": status,
        "kills": dict(Counter(kill["role"] for kill in kills)),
        "recoveries": len(recoveries),
        "recovered from": dict(Counter(role for role, _ in recoveries)),
        "episodes failed by a dead or hung worker": len(worker_deaths),
        "failure rows": db.execute("select count(*) from failed_episodes").fetchone()[0],
        "segments": db.execute("select count(*) from segments").fetchone()[0],
    }
    return problems, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps, 3 kills: a smoke run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps, every, most = args.steps, args.every, args.kills
    if args.quick:
        steps, every, most = 60, 0.5, 3
    root = Path(tempfile.mkdtemp(prefix="molt-wb-chaos-"))
    cfg = compose_config(
        [
            "+recipe=arith",
            f"trainer.steps={steps}",
            "trainer.async_depth=1",
            "rollout.partial=true",
            "gate.level=token",
            f"trainer.checkpoint_every={5 if args.quick else 10}",
            f"trainer.max_restarts={most + 1}",
            f"rollout.max_restarts={most + 1}",
            "ray.rollout_workers=2",
            "tracking=none",
            "run.progress=false",
            f"run.root={root}",
            "run.id=chaos",
        ]
    )
    kills = []
    done = threading.Event()
    rng = random.Random(args.seed)
    thread = threading.Thread(target=killer, args=(root / "chaos", every, most, rng, kills, done))
    started = time.perf_counter()
    thread.start()
    try:
        loop.train(cfg)
    finally:
        done.set()
        thread.join()
    seconds = time.perf_counter() - started
    problems, counts = check(open_run("chaos", str(root)), steps, kills)
    print(f"chaos soak: {steps} steps in {seconds:.0f} s, run folder {root / 'chaos'}")
    for name, value in counts.items():
        print(f"  {name}: {value}")
    print(f"broken promises: {len(problems)}")
    for problem in problems:
        print("  " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
