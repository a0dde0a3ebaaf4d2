"""Recovery without a human: a run whose learner or store process dies, or any actor's while the
actors start or load a checkpoint, starts again from its latest checkpoint, as `molt-wb resume`
would, up to `trainer.max_restarts` times; before its first checkpoint, from step 0.

The restart is a resume in the same process: the run folder is cut back to the checkpoint's
shards (to none before the first checkpoint, as a fresh start with the same seed), a checkpoint
write the death cut short is discarded, new actors load the checkpoint's learner state, and the
engines its weights and version. Each recovery is a line on stderr and an entry of the run row's
`recoveries` (the `recoveries` view of `open_run`): what died, the steps done by then, and the
checkpoint the run went on from (null: step 0). A run that stops for good ends with a way on that
works for its folder as it stands (`way_on`).
"""

import contextlib
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, open_dict

from workbench.run.checkpoint import latest
from workbench.run.faults import ActorDied, RunFailed, death
from workbench.store.query import root_option, run_row
from workbench.store.writer import write_json_atomic

# the role of an actor class, as a dead actor's error names it (`class_name: Learner`)
ROLES = {"StoreActor": "store", "Learner": "learner", "RolloutWorker": "rollout worker"}


def supervise(cfg: DictConfig, run_once: Callable[[DictConfig], str]) -> str:
    """`run_once(cfg)`, started again from the latest checkpoint (or from step 0 before the
    first) each time its learner or store dies, until it returns (the run id) or
    `trainer.max_restarts` recoveries are spent."""
    import ray

    restarts = 0
    while True:
        try:
            return run_once(cfg)
        # an actor dead in the loop (ActorDied), or while the actors start and load a checkpoint
        except (ActorDied, ray.exceptions.RayActorError) as error:
            # an exception in an actor's __init__ is no death: every start would raise it again
            if getattr(error, "actor_init_failed", False):
                raise
            dead = error
            if not isinstance(error, ActorDied):
                dead = death(_role(error), cfg.run.id, " while the actors started")
            if restarts == cfg.trainer.max_restarts:
                raise dead.advised(way_on(cfg)) from error
            restarts += 1
            run_dir = Path(cfg.run.root) / cfg.run.id
            _record(run_dir, dead.role, latest(run_dir), restarts, cfg.trainer.max_restarts)
            _free_placement(cfg.run.id)
            with open_dict(cfg):
                cfg.run.resume = True
        except RunFailed as error:
            # a failure with no way on (every rollout batch lost) says what to fix instead
            if not error.cause:
                raise
            raise error.advised(way_on(cfg)) from error


def resume_command(cfg: DictConfig) -> str:
    """The command that continues run `cfg.run.id` where it stands: `molt-wb resume RUN`, with
    `--root` when its folder is not under the default runs/."""
    return f"molt-wb resume {cfg.run.id}{root_option(cfg.run.root)}"


def way_on(cfg: DictConfig) -> str:
    """How a stopped run goes on as its folder now stands: from its latest checkpoint, or from
    step 0 when it has none yet (`molt-wb resume` starts it again in the same folder)."""
    checkpoint = latest(Path(cfg.run.root) / cfg.run.id)
    if checkpoint is None:
        return f"start it again from step 0 (it has no checkpoint yet) with: {resume_command(cfg)}"
    return f"continue it from its latest checkpoint ({checkpoint.name}) with: {resume_command(cfg)}"


def _role(error: Exception) -> str:
    """The role of the actor a RayActorError is about (its class, as the error names it)."""
    found = re.search(r"class_name: (\w+)", str(error))
    if found is None:
        return "actor"
    return ROLES.get(found.group(1), "actor")


def _free_placement(run_id: str) -> None:
    """Remove the run's placement group, if a start that failed midway left it: the restart
    creates it again under the same name (cluster.placement)."""
    import ray

    with contextlib.suppress(ValueError):
        ray.util.remove_placement_group(ray.util.get_placement_group(f"molt-wb-{run_id}"))


def _record(run_dir: Path, role: str, checkpoint: Path | None, restart: int, most: int) -> None:
    """The recovery's line on stderr and its entry in run.json (a resume keeps the row's
    entries)."""
    row = run_row(run_dir)
    name = checkpoint.name if checkpoint else None
    recovery = {
        "died": role,
        "steps_done": row.get("steps_done", 0),
        "checkpoint": name,
        "time": time.time(),
    }
    row["recoveries"] = row.get("recoveries", []) + [recovery]
    write_json_atomic(run_dir / "run.json", row)
    start = f"from {name}" if name else "from step 0 as it has no checkpoint yet"
    print(
        f"The {role} process died after step {recovery['steps_done']}; recovering {start} "
        f"(recovery {restart} of trainer.max_restarts={most}).",
        file=sys.stderr,
        flush=True,
    )
