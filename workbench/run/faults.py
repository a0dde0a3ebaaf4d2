"""Rollout faults: every dispatched episode reaches the training batch or the `failed_episodes`
table, once; a fault the run cannot ride out ends it with one `RunFailed` sentence from here.

A plugin exception fails one episode (the worker reports it, rollout/worker.py). A worker whose
process dies is restarted by Ray (`rollout.max_restarts`); one that does not answer within
`rollout.timeout_s` (a hung engine or agent) is killed and restarted. Either way every episode it
held becomes a failure row, the restarted worker gets the learner's current weights and version
(and with the collective transport every member joins a new weight group), and the run goes on;
a batch that lost every episode is drawn again, at most three times in a row.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from workbench.rollout.worker import Job, failure_row
from workbench.store import nonfinite

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle, ActorMethod
    from ray.exceptions import RayActorError

    from workbench.config import Config
    from workbench.run.cluster import LearnerRanks
    from workbench.run.data import Prompts


class RunFailed(RuntimeError):
    """A fault the run cannot ride out (its learner or store died, every rollout batch lost): one
    sentence naming it and the way on; the run is marked failed and keeps what it wrote."""

    # what failed, and what to change before the run goes on ("" for a failure with no way on)
    cause = ""
    fix = ""

    def advised(self, way_on: str) -> RunFailed:
        """This failure ending in `way_on`: the command that continues the run as its folder
        stands once it stopped (recovery.py), in place of the default advice."""
        return RunFailed(_sentence(self.cause, self.fix, way_on))


def _sentence(cause: str, fix: str, way_on: str) -> str:
    """A stopped run's one sentence: what failed, what became of the run, how it goes on."""
    return f"{cause}: the run is marked failed and keeps every step it wrote; {fix}{way_on}"


def run_failed(cause: str, run_id: str, fix: str = "") -> RunFailed:
    """`cause`, then what became of the run and how it goes on (`fix` first, when given); the run's
    supervisor replaces the default way on with one for its folder as it stands (`advised`)."""
    failed = RunFailed(
        _sentence(
            cause, fix, f"continue it from its latest checkpoint with: molt-wb resume {run_id}"
        )
    )
    failed.cause = cause
    failed.fix = fix
    return failed


class ActorDied(RunFailed):
    """The learner's or the store's process died (or any actor's while the actors start): the run
    starts again from its latest checkpoint, or from step 0 before it has one (recovery.py),
    before this stops it."""

    def __init__(self, failed: RunFailed, role: str):
        super().__init__(str(failed))
        self.cause = failed.cause
        self.fix = failed.fix
        self.role = role


def died(
    error: RayActorError, run_id: str, store: ActorHandle, learner: ActorHandle | LearnerRanks
) -> ActorDied:
    """The `RunFailed` of an actor's death (`error`) the loop cannot ride out."""
    roles = {store._actor_id.hex(): "store"}
    for actor in getattr(learner, "actors", [learner]):
        roles[actor._actor_id.hex()] = "learner"
    return death(roles.get(error.actor_id, "rollout worker"), run_id)


def death(role: str, run_id: str, when: str = "") -> ActorDied:
    """The `ActorDied` of the `role` process, which died `when` (e.g. " while the actors
    started")."""
    cause = (
        f"The {role} process died{when} (killed, out of memory or crashed; Ray's worker logs say "
        f"which)"
    )
    return ActorDied(run_failed(cause, run_id), role)


def nonfinite_loss(cfg: Config, step: int, metrics: dict[str, float]) -> None:
    """Under `trainer.nonfinite=stop`, end the run with one sentence when step `step`'s loss or
    gradient norm is not finite (its rows are already on their way to the store)."""
    bad = [key for key in nonfinite.STOP_KEYS if key in metrics and not math.isfinite(metrics[key])]
    if bad and cfg.trainer.nonfinite == "stop":
        raise run_failed(
            f"Step {step}'s {' and '.join(bad)} is not finite (NaN or inf), so neither are the "
            "weights it trained (trainer.nonfinite=stop)",
            cfg.run.id,
            "lower trainer.lr or trainer.max_grad_norm, or set trainer.nonfinite=warn, then ",
        )


def learner_timeout(step: int, cfg: Config) -> RunFailed:
    """The `RunFailed` of a learner step that gave no result within `trainer.timeout_s`."""
    return run_failed(
        f"Step {step}: the learner gave no result within trainer.timeout_s="
        f"{cfg.trainer.timeout_s:g} s (hung, or steps longer than that)",
        cfg.run.id,
        "raise trainer.timeout_s if steps take longer, then ",
    )


@dataclass
class InFlight:
    """One batch of episodes in flight on the rollout workers: per worker its jobs and the Ray
    references of its (segments, failures)."""

    jobs: list[list[Job]]
    # per worker: its list[Segment]
    segment_refs: list[ObjectRef]
    # per worker: its failure rows (list[dict]); ready once the worker answered
    failure_refs: list[ObjectRef]
    # the data position before this batch was drawn: what a checkpoint saves
    data_state: dict
    # the learner's weights (a Ray reference) the batch starts on; None: the engines' own
    weights: ObjectRef | None = None


def submit(
    workers: list[ActorHandle],
    prompts: Prompts,
    weights: ObjectRef | None = None,
    before: InFlight | None = None,
) -> InFlight:
    """Start the next batch of episodes, shared among the workers, on `weights` when given; each
    worker runs its part after its part of `before` (the batch sent before it, maybe in flight)."""
    data_state = prompts.state()
    jobs = prompts.next_jobs(len(workers))
    # a worker's ticket: its result of the batch before (rollout/worker.py waits for it)
    tickets = [[ref] for ref in before.failure_refs] if before else [None] * len(workers)
    futures = [
        w.rollout_with_failures.options(num_returns=2).remote(j, None, weights, ticket)
        for w, j, ticket in zip(workers, jobs, tickets, strict=True)
    ]
    return InFlight(jobs, [f[0] for f in futures], [f[1] for f in futures], data_state, weights)


def collect(
    in_flight: InFlight,
    step: int,
    cfg: Config,
    store: ActorHandle,
    learner: ActorHandle | LearnerRanks,
    workers: list[ActorHandle],
    prompts: Prompts,
) -> list[ObjectRef]:
    """The segment references (list[Segment] each) of the workers that delivered; each episode
    that did not is recorded as failed."""
    import ray

    for _ in range(3):
        ready, _ = ray.wait(
            in_flight.failure_refs,
            num_returns=len(in_flight.failure_refs),
            timeout=cfg.rollout.timeout_s,
        )
        delivered = []
        rows = []
        per_worker = zip(
            workers, in_flight.jobs, in_flight.segment_refs, in_flight.failure_refs, strict=True
        )
        for index, (worker, jobs, segment_ref, failure_ref) in enumerate(per_worker):
            try:
                if failure_ref not in ready:
                    # Ray starts it again (rollout.max_restarts)
                    ray.kill(worker, no_restart=False)
                    raise TimeoutError(
                        f"rollout worker {index} gave no result within rollout.timeout_s="
                        f"{cfg.rollout.timeout_s:g} s (a hung engine or agent); it was restarted"
                    )
                rows += ray.get(failure_ref)
                delivered.append(segment_ref)
            except (ray.exceptions.RayError, TimeoutError) as error:
                rows += _failure_rows(error, index, jobs)
                # the restart loaded the first weights
                when_back(worker.load_weights, learner.weights.remote())
        if len(delivered) < len(workers) and cfg.ray.weight_transport == "collective":
            from workbench.learner.transport import join_weight_group

            # a restarted worker is in no group: every member joins a new one
            join_weight_group(cfg, learner, workers)
        if rows:
            store.write_failures.remote(step, rows)
            kinds = sorted({row["kind"] for row in rows})
            print(
                f"step {step}: {len(rows)} episode(s) failed ({', '.join(kinds)}); "
                f"see the failed_episodes table",
                file=sys.stderr,
                flush=True,
            )
        if len(rows) < sum(len(jobs) for jobs in in_flight.jobs):
            return delivered
        in_flight = submit(workers, prompts, in_flight.weights)
    raise RunFailed(
        f"Step {step}: three rollout batches in a row lost every episode; the failed_episodes "
        f"table holds each error: fix the agent, its data or the engine."
    )


def _failure_rows(error: Exception, worker: int, jobs: list[Job]) -> list[dict]:
    """One `failed_episodes` row per job of `worker`, which failed with `error`."""
    import ray

    kind = "worker_error"
    if isinstance(error, TimeoutError):
        kind = "timeout"
    elif isinstance(error, ray.exceptions.RayActorError):
        kind = "worker_died"
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else type(error).__name__
    return [failure_row(job, worker, kind, message, str(error)) for job in jobs]


def when_back(method: ActorMethod, *args: Any) -> Any:
    """`method.remote(*args)`'s result (a rollout worker's method) once Ray has the worker running
    again (within 5 minutes); a worker dead for good (rollout.max_restarts spent) raises at once."""
    import ray

    deadline = time.monotonic() + 300
    while True:
        try:
            return ray.get(method.remote(*args))
        # restarting, or killed again while it restarted: Ray starts it again
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
