"""A chaos soak: a long asynchronous run with partial rollouts while actors are SIGKILLed at any
moment, from its first second on.

    python bench/chaos.py [--quick] [--steps 300] [--every 3] [--kills 12] [--seed 0]

The arith recipe (tiny model, 2 rollout workers, async_depth 1, partial rollouts, a checkpoint
every 10 steps) runs in this process while a thread SIGKILLs an actor process (a rollout worker,
the learner or the store) at each moment of its plan, taken in turn:

    first  the learner or the store of the run's own start, from its first second: before any
           checkpoint (then, in turn, write, start, any, write, ...)
    write  the learner or the store while a checkpoint is being written (the next write, or one
           after 1 or 2 more commit): the write is held halfway (a `checkpoints/hold` file,
           checkpoint.py) and the kill lands inside it
    start  an actor of a random role of the next start, within `--every` seconds of it being up:
           the actors a recovery starts while they load the checkpoint
    any    a random actor at a random time within `--every` seconds once the run has trained 2
           more steps: in a batch, a learner step, a weight push or a store write

A dead worker is restarted by Ray and its episodes become failure rows; a dead learner or store
restarts the run from its latest checkpoint, or from step 0 before the first (recovery.py). At
the end it checks the tables and prints the kills by moment and role, the recoveries, the failure
rows, rows duplicated in any table, token rows and steps lost, whether the learner's versions run
1..N without a gap, and whether every learner or store kill was followed by a recovery. Exits 1
on any broken promise. `--quick`: 60 steps, a checkpoint every 5, 4 kills, `--every 1` (about a
minute).
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

import duckdb
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.config import compose_config  # noqa: E402
from workbench.models.state import HOLD  # noqa: E402
from workbench.run import loop  # noqa: E402
from workbench.run.checkpoint import latest  # noqa: E402
from workbench.store import open_run  # noqa: E402

ROLES = ("rollout worker", "learner", "store")
TITLES = {"rollout worker": "ray::RolloutWorker", "learner": "ray::Learner", "store": "ray::Store"}
# the moments of a plan after the first: these in turn (a start kill after a write or an any kill
# lands in the recovery or the worker restart it caused)
PLAN = ("write", "start", "any")
TABLE_KEYS = {
    "segments": "rollout_id, segment_idx",
    "tokens": "rollout_id, segment_idx, position",
    "metrics": "step, key",
    "failed_episodes": "step, rollout_id",
}


def actors(roles: tuple[str, ...] = ROLES) -> list[tuple[str, psutil.Process]]:
    """(role, process) of each live actor process of this driver's Ray with one of `roles`."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        found += [(role, process) for role in roles if title.startswith(TITLES[role])]
    return found


def at_start(
    run_dir: Path, every: float, rng: random.Random, done: threading.Event, roles: tuple = ROLES
) -> list:
    """The actor of a random one of `roles` of the next start (a process not alive when asked),
    a random time within `every` seconds after it is up: while it starts or loads a checkpoint."""
    role = rng.choice(roles)
    before = {process.pid for _, process in actors()}
    fresh = []
    while not fresh and not done.wait(0.05):
        fresh = [(role, process) for _, process in actors((role,)) if process.pid not in before]
    done.wait(rng.uniform(0, every))
    return fresh


def in_a_write(run_dir: Path, every: float, rng: random.Random, done: threading.Event) -> list:
    """The learner or the store, once a checkpoint write is held halfway (its sharded state
    written, its policy and trainer.pt not): the next write, or one after 1 or 2 more commit, so
    that the write cut short has a checkpoint before it or none."""
    for _ in range(rng.randint(0, 2)):
        committed = latest(run_dir)
        while latest(run_dir) == committed and not done.wait(0.05):
            pass
    # the run makes its folder itself
    while not (run_dir / "run.json").exists() and not done.wait(0.05):
        pass
    hold = run_dir / "checkpoints" / HOLD
    hold.parent.mkdir(exist_ok=True)
    since = time.time()
    hold.touch()
    while not held(run_dir, since) and not done.wait(0.05):
        pass
    return actors((rng.choice(("learner", "store")),))


def held(run_dir: Path, since: float) -> bool:
    """Whether a checkpoint write begun after `since` has its sharded state written."""
    for path in run_dir.glob("checkpoints/step-*.tmp/state/.metadata"):
        # a recovery may delete it meanwhile
        with contextlib.suppress(OSError):
            if path.stat().st_mtime >= since:
                return True
    return False


def first_start(run_dir: Path, every: float, rng: random.Random, done: threading.Event) -> list:
    """The learner or the store of the run's own start, from its first second: before any
    checkpoint, so the run starts again from step 0."""
    return at_start(run_dir, every, rng, done, ("learner", "store"))


def any_time(run_dir: Path, every: float, rng: random.Random, done: threading.Event) -> list:
    """Every actor, at a random time within `every` seconds once the run trains again (2 steps
    past where it stood): in a batch, a learner step, a weight push or a write to the store."""
    stood = steps_done(run_dir)
    while steps_done(run_dir) < stood + 2 and not done.wait(0.05):
        pass
    done.wait(rng.uniform(0, every))
    return actors()


def steps_done(run_dir: Path) -> int:
    """The steps the run has logged, as its row says (0 before it has one)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((run_dir / "run.json").read_text()).get("steps_done", 0)
    return 0


MOMENTS = {"first": first_start, "write": in_a_write, "start": at_start, "any": any_time}


def killer(
    run_dir: Path,
    plan: list[str],
    every: float,
    rng: random.Random,
    kills: list[dict],
    done: threading.Event,
) -> None:
    """SIGKILL an actor at each moment of `plan` in turn, recording each kill; the hold of a
    write is lifted once its kill has landed."""
    for moment in plan:
        chosen = MOMENTS[moment](run_dir, every, rng, done)
        alive = [(role, process) for role, process in chosen if process.is_running()]
        if done.is_set() or not alive:
            (run_dir / "checkpoints" / HOLD).unlink(missing_ok=True)
            print(f"  no kill at the {moment} moment: no actor up, or the run ended", flush=True)
            continue
        role, process = rng.choice(alive)
        try:
            process.kill()
        except psutil.Error:
            continue
        finally:
            # a SIGKILLed process runs no more code: only a new learner writes on
            (run_dir / "checkpoints" / HOLD).unlink(missing_ok=True)
        done_by_then = steps_done(run_dir)
        kills.append(
            {"moment": moment, "role": role, "steps_done": done_by_then, "time": time.time()}
        )
        print(f"  killed the {role} ({moment}) after step {done_by_then}", flush=True)


def check(
    db: duckdb.DuckDBPyConnection, run_dir: Path, steps: int, kills: list[dict], planned: int
) -> tuple[list[str], dict]:
    """The broken promises of a finished chaos run, and its counts."""
    problems = []
    status, closed = db.execute("select status, updated from runs").fetchone()
    if status != "finished":
        problems.append(f"status {status}")
    duplicated = {}
    for table, key in TABLE_KEYS.items():
        query = f"select count(*) - count(distinct ({key})) from {table}"
        duplicated[table] = db.execute(query).fetchone()[0]
        if duplicated[table]:
            problems.append(f"{duplicated[table]} duplicated rows in {table}")
    lost_tokens = db.execute(
        "select (select sum(num_tokens) from segments) - (select count(*) from tokens)"
    ).fetchone()[0]
    if lost_tokens:
        problems.append(f"{lost_tokens} token rows lost")
    missing = set()
    for table in ("metrics", "segments"):
        stepped = {row[0] for row in db.execute(f"select distinct step from {table}").fetchall()}
        lost = sorted(set(range(steps)) - stepped)
        missing |= set(lost)
        if lost:
            problems.append(f"steps missing from {table}: {lost[:10]}")
    versions = db.execute(
        "select list(value order by step) from metrics where key = 'train/version'"
    ).fetchone()[0]
    in_order = versions == list(range(1, steps + 1))
    if not in_order:
        problems.append("the learner's versions are not 1..N step by step")
    left = [p.name for p in run_dir.glob("checkpoints/*") if p.name == HOLD or p.suffix == ".tmp"]
    if left:
        problems.append(f"left in checkpoints/: {left}")
    recoveries = db.execute("select died, checkpoint, time from recoveries").fetchall()
    for kill in kills:
        # a dead learner or store always ends the start it was in: a recovery follows, unless the
        # run had closed finished by then
        followed = any(when >= kill["time"] for _, _, when in recoveries)
        if kill["role"] != "rollout worker" and not (followed or kill["time"] >= closed):
            problems.append(
                f"the {kill['role']} killed after step {kill['steps_done']} left no trace"
            )
    counts = {
        "steps": steps,
        "status": status,
        "kills (planned)": f"{len(kills)} ({planned})",
        "recoveries": len(recoveries),
        "recoveries from step 0": sum(checkpoint is None for _, checkpoint, _ in recoveries),
        "failure rows": db.execute("select count(*) from failed_episodes").fetchone()[0],
        "segments": db.execute("select count(*) from segments").fetchone()[0],
        "duplicated rows": sum(duplicated.values()),
        "token rows lost": lost_tokens,
        "steps missing": len(missing),
        "versions 1..N in order": "yes" if in_order else "no",
    }
    return problems, counts


def table(kills: list[dict], recoveries: list[tuple]) -> str:
    """The kills by moment (rows) and role (columns), and the recoveries by the role that died,
    as a Markdown table."""
    lines = ["| moment | " + " | ".join(ROLES) + " | all |", "|---" * (len(ROLES) + 2) + "|"]
    by = Counter((kill["moment"], kill["role"]) for kill in kills)
    for moment in MOMENTS:
        cells = [str(by[moment, role]) for role in ROLES]
        lines.append(f"| kills: {moment} | " + " | ".join(cells) + f" | {sum(map(int, cells))} |")
    died = Counter(role for role, _, _ in recoveries)
    cells = [str(died[role]) for role in ROLES]
    lines.append("| recoveries | " + " | ".join(cells) + f" | {len(recoveries)} |")
    return "\n".join(lines)


def main() -> int:
    """Run the soak, print its table and counts; 1 on any broken promise."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="60 steps, 4 kills, --every 1: a smoke run"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = 60 if args.quick else args.steps
    every = 1.0 if args.quick else args.every
    most = 4 if args.quick else args.kills
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
            # the row's steps_done, which the any moment waits on, at most a second old
            "run.flush_seconds=1",
            f"run.root={root}",
            "run.id=chaos",
        ]
    )
    plan = ["first"] + [PLAN[i % len(PLAN)] for i in range(most - 1)]
    kills = []
    done = threading.Event()
    rng = random.Random(args.seed)
    run_dir = root / "chaos"
    thread = threading.Thread(target=killer, args=(run_dir, plan, every, rng, kills, done))
    started = time.perf_counter()
    thread.start()
    try:
        loop.train(cfg)
    finally:
        done.set()
        thread.join()
    seconds = time.perf_counter() - started
    db = open_run("chaos", str(root))
    problems, counts = check(db, run_dir, steps, kills, len(plan))
    recoveries = db.execute("select died, checkpoint, time from recoveries").fetchall()
    print(f"chaos soak: {steps} steps in {seconds:.0f} s, run folder {run_dir}")
    print(table(kills, recoveries))
    for name, value in counts.items():
        print(f"  {name}: {value}")
    print(f"broken promises: {len(problems)}")
    for problem in problems:
        print("  " + problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
