"""The window of rollout batches in flight: how many batches run ahead of the learner, when the next
one is drawn and which weights it starts on change here.

With `trainer.async_depth=d` the window holds up to d+1 batches. Step s trains on the oldest; its
new weights travel with the batch drawn next (for step s+d+1), which Ray starts once they exist, so
every batch is sampled exactly d versions behind the learner and the driver never waits on a push.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.learner.transport import join_weight_group
from workbench.run import faults
from workbench.run.progress import StepClock

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from workbench.config import Config
    from workbench.run.cluster import LearnerRanks
    from workbench.run.data import Prompts


def batches(cfg: Config) -> int:
    """The loop's steps: one rollout batch each, trained in `trainer.minibatches` optimizer
    steps."""
    return cfg.trainer.steps // cfg.trainer.minibatches


class Window:
    """The rollout batches in flight (`faults.InFlight`), oldest first."""

    def __init__(self, cfg: Config, workers: list[ActorHandle], prompts: Prompts, start: int):
        """Draw the first batches of a run that starts (or resumes) at loop step `start`, on the
        engines' own weights."""
        self.cfg = cfg
        self.workers = workers
        self.prompts = prompts
        self.start = start
        self.end = batches(cfg)
        first = min(cfg.trainer.async_depth + 1, self.end - start)
        self.in_flight: deque[faults.InFlight] = deque()
        for _ in range(first):
            self._submit()
        # the loop step whose batch is drawn next
        self.next_batch = start + len(self.in_flight)

    def steps(self) -> range:
        """The loop steps still to run, one per rollout batch."""
        return range(self.start, self.end)

    def oldest(self) -> faults.InFlight:
        """The oldest batch in flight, taken out of the window: the one this step trains on."""
        return self.in_flight.popleft()

    def sync(self, weights: ObjectRef, learner: ActorHandle | LearnerRanks) -> ObjectRef:
        """A step's new `weights` (a Ray reference) reach the rollouts: with partial rollouts the
        batches in flight take them now; the next batch, while the run has one left, starts on
        them. The weights they got: `weights`, or the same version through the object store."""
        import ray

        # the collective transport: every worker receives what the learner broadcasts after its
        # step (transport.py); `weights` then stands for them
        if self.cfg.ray.weight_transport == "collective":
            receiving = [worker.receive_weights.remote() for worker in self.workers]
            try:
                ray.get(receiving, timeout=self.cfg.trainer.timeout_s)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
                # a worker died or restarted beside the step: these weights go through the object
                # store, and every member joins a new group before the next push
                weights = learner.weights.remote()
                # (a restarted worker joins once Ray has it running)
                for worker in self.workers:
                    faults.when_back(worker.__ray_ready__)
                join_weight_group(self.cfg, learner, self.workers)
        if self.cfg.rollout.partial:
            for worker in self.workers:
                # a worker that died is restarted by Ray; its batch's episodes fail in
                # faults.collect, and its next batch brings the weights
                with contextlib.suppress(ray.exceptions.RayActorError):
                    ray.get(worker.load_weights.remote(weights))
        if self.next_batch < self.end:
            self._submit(weights)
            self.next_batch += 1
        return weights

    def _submit(self, weights: ObjectRef | None = None) -> None:
        """Draw the next batch, on `weights` when given; each worker runs it after its part of the
        newest batch in flight, as it was sent."""
        newest = self.in_flight[-1] if self.in_flight else None
        self.in_flight.append(faults.submit(self.workers, self.prompts, weights, newest))

    def data_state(self) -> dict:
        """The data position a checkpoint saves: from before the oldest batch in flight was drawn
        (no step has trained on it yet), else the current one."""
        if self.in_flight:
            return self.in_flight[0].data_state
        return self.prompts.state()


@dataclass
class PendingStep:
    """A step the learner was handed, not yet logged: what `Trailing` logs once its metrics are
    in. The learner's outputs are Ray references."""

    step: int
    metrics: ObjectRef  # -> dict[str, float]
    # the per-token rows (tokens, gate decisions, advantages) the store writes
    rows: ObjectRef
    # the batch's segments, one reference per worker that delivered (list[Segment] each)
    segment_refs: list[ObjectRef]
    # the step's new weights, as window.sync returned them
    weights: ObjectRef
    # the driver's waits while the batch was drawn, then on the learner (perf/<phase>_s)
    phases: dict[str, float] = field(default_factory=dict)


class Trailing:
    """The step the learner was handed last, not yet logged: its metrics are fetched (and the step
    logged) once the next step's batch went to the learner, which so never waits on the driver, or
    while that batch is not there yet; at once when it checkpoints or evaluates."""

    def __init__(self, cfg: Config, log: Callable[[int, dict[str, float], PendingStep], None]):
        """`log(step, metrics, sent)`: what the loop does with step `step` once its `metrics` are
        in; `sent` is what else it sent the learner and got back."""
        self.cfg = cfg
        self.log = log
        self.clock = StepClock()
        # the driver's waits of the step being drawn, then of the trailing one
        self.phases: dict[str, float] = {}
        self.pending: PendingStep | None = None

    def timed(self, phase: str) -> contextlib.AbstractContextManager:
        """The seconds its block takes, a wait of the step being drawn (`perf/<phase>_s`)."""
        return self.clock.timed(self.phases, phase)

    def before(self, in_flight: faults.InFlight) -> faults.InFlight:
        """The next step's batch `in_flight`, once every worker answered or the trailing step's
        metrics are in: whichever comes first, the other waits (the batch goes to the learner
        first, behind the trailing step; the trailing step is logged while the learner waits on
        the batch)."""
        import ray

        pending = self.pending
        left = list(in_flight.failure_refs) if pending else []
        start = time.perf_counter()
        while left:
            ready, _ = ray.wait([pending.metrics, *left], timeout=self.cfg.trainer.timeout_s)
            if not ready or pending.metrics in ready:
                # a wait on the learner
                pending.phases["train"] = time.perf_counter() - start
                self.flush()
                return in_flight
            left.remove(*ready)
        # a wait on the rollout
        self.phases["rollout"] = time.perf_counter() - start
        return in_flight

    def after(
        self,
        step: int,
        metrics: ObjectRef,
        rows: ObjectRef,
        segment_refs: list[ObjectRef],
        weights: ObjectRef,
    ) -> None:
        """Step `step` went to the learner (its `metrics`, `rows` and `weights` are the learner's
        outputs, `segment_refs` its input): the one before it is logged, and this one at once when
        due."""
        self.flush()
        self.pending = PendingStep(
            step=step,
            metrics=metrics,
            rows=rows,
            segment_refs=segment_refs,
            weights=weights,
            phases=self.phases,
        )
        self.phases = {}
        if any(
            n and (step + 1) % n == 0
            for n in (self.cfg.trainer.checkpoint_every, self.cfg.eval.every)
        ):
            self.flush()

    def flush(self) -> None:
        """Log the trailing step, if any, once its metrics are in."""
        import ray

        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            with self.clock.timed(pending.phases, "train"):  # the learner
                metrics = ray.get(pending.metrics, timeout=self.cfg.trainer.timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            raise faults.learner_timeout(pending.step, self.cfg) from error
        self.log(pending.step, self.clock.metrics(metrics, pending.phases), pending)
