"""Recovery without a human: a run whose learner or store process dies starts again from its latest
checkpoint, as `molt-wb resume` would, up to `trainer.max_restarts` times.

The restart is a resume in the same process: the run folder is cut back to the checkpoint's
shards, new actors load its learner state, and the engines its weights and version. Each recovery
is a line on stderr and an entry of the run row's `recoveries` (the `recoveries` view of
`open_run`): what died, the steps done by then, and the checkpoint the run went on from.
"""

import sys
import time
from pathlib import Path

from omegaconf import open_dict

from workbench.checkpoint import latest
from workbench.faults import ActorDied
from workbench.store.query import run_row
from workbench.store.writer import write_json_atomic


def supervise(cfg, run_once):
    """`run_once(cfg)`, started again from the latest checkpoint each time its learner or store
    dies, until it returns (the run id) or `trainer.max_restarts` recoveries are spent."""
    import ray

    restarts = 0
    while True:
        try:
            return run_once(cfg)
        # an actor dead in the loop (ActorDied), or while the actors start and load the checkpoint
        except (ActorDied, ray.exceptions.RayActorError) as error:
            run_dir = Path(cfg.run.root) / cfg.run.id
            checkpoint = latest(run_dir)
            if checkpoint is None or restarts == cfg.trainer.max_restarts:
                raise
            restarts += 1
            role = getattr(error, "role", "starting actor")
            _record(run_dir, role, checkpoint, restarts, cfg.trainer.max_restarts)
            with open_dict(cfg):
                cfg.run.resume = True


def _record(run_dir: Path, role: str, checkpoint: Path, restart: int, most: int):
    """The recovery's line on stderr and its entry in run.json (a resume keeps the row's
    entries)."""
    row = run_row(run_dir)
    recovery = {
        "died": role,
        "steps_done": row.get("steps_done", 0),
        "checkpoint": checkpoint.name,
        "time": time.time(),
    }
    row["recoveries"] = row.get("recoveries", []) + [recovery]
    write_json_atomic(run_dir / "run.json", row)
    print(
        f"The {role} process died after step {recovery['steps_done']}; recovering from "
        f"{checkpoint.name} (recovery {restart} of trainer.max_restarts={most}).",
        file=sys.stderr,
        flush=True,
    )
