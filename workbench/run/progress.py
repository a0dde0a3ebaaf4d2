"""What a run shows while it works: progress of its long pieces of work (model build, warm start,
RL steps) and the step clock's `perf/` and `memory/` metrics; a new phase timing or progress field
changes here.

Each logged step's metrics also go to the callables in `WATCHERS`, in the driver's process, before
the next step is logged: `molt-wb tune`'s pruner judges a trial there (tune.py).
"""

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as Bar

from workbench.run.memory import MemoryPeak
from workbench.store.alarms import Announcer
from workbench.store.query import root_option

# called with each logged step's metrics; one that raises KeyboardInterrupt stops the run as Ctrl-C
WATCHERS: list[Callable[[dict], None]] = []


@contextlib.contextmanager
def timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    """The seconds its block takes, added to `phases[phase]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] = phases.get(phase, 0.0) + time.perf_counter() - start


class StartClock:
    """Wall time of a run's start before its first step: `model_build` (the tiny model, built
    once), `warm_start` (its supervised steps, once), `actor_start` (Ray and its actors, each
    loading the policy). The first logged step carries them as `perf/<phase>_s` metrics, which the
    summary names; a phase cached by an earlier run takes about 0 s."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    def timed(self, phase: str) -> contextlib.AbstractContextManager:
        """The seconds its block takes, added to the phase."""
        return timed(self.phases, phase)

    def into(self, metrics: dict) -> dict:
        """`metrics` with the phases no step carried yet, as `perf/<phase>_s`."""
        perf = {f"perf/{phase}_s": seconds for phase, seconds in self.phases.items()}
        self.phases = {}
        return metrics | perf


class StepClock:
    """Wall time of the driver's waits in each step, as `perf/` metrics. Steps overlap (the loop
    hands the learner its next batch before it fetches a step's metrics), so `perf/step_s` runs
    from the previous step's metrics to this one's: the steps add up to the run's wall time."""

    def __init__(self):
        self.end = time.perf_counter()
        # the run's peak memory, sampled as each step's metrics arrive (memory.py)
        self.memory = MemoryPeak()

    def timed(self, phases: dict, phase: str) -> contextlib.AbstractContextManager:
        """The seconds its block takes, added to `phases[phase]`."""
        return timed(phases, phase)

    def metrics(self, metrics, phases: dict):
        now = time.perf_counter()
        total = now - self.end
        self.end = now
        perf = {f"perf/{phase}_s": seconds for phase, seconds in phases.items()}
        perf["perf/step_s"] = total
        perf["perf/tokens_per_s"] = metrics.get("rollout/sampled_tokens", 0) / max(total, 1e-9)
        return dict(metrics, **perf, **self.memory.sample())


class Task(contextlib.AbstractContextManager):
    """Progress of one long piece of work (a model build, a warm start, the RL steps): a rich bar
    with time left on a terminal, one line per `interval_s` when piped, nothing when off."""

    def __init__(self, label, total, enabled=True, interval_s=10.0):
        self.label = label
        self.total = total
        self.enabled = enabled
        self.interval_s = interval_s
        self.done = 0
        self.start = time.monotonic()
        # the first update prints at once
        self.printed = -math.inf
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = Bar(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task(label, total=total, info="")
            self.bar.start()

    def update(self, done, info=""):
        self.done = done
        now = time.monotonic()
        if self.bar:
            self.bar.update(self.task, completed=done, info=info)
        elif self.enabled and (now - self.printed >= self.interval_s or done == self.total):
            self.printed = now
            left = (now - self.start) / max(done, 1) * (self.total - done)
            print(f"{self.label} {done}/{self.total}: {info}  ({left:.0f} s left)", flush=True)

    def close(self):
        if self.bar:
            self.bar.stop()

    def __exit__(self, *exc):
        self.close()


class Progress(Task):
    """The RL steps' progress: step, reward and tokens/s; and each run-health alarm, one line as
    the store writes it (whether or not progress shows)."""

    def __init__(self, cfg):
        super().__init__(cfg.run.id, cfg.trainer.steps, cfg.run.progress)
        runs_command = f"molt-wb runs {cfg.run.id}{root_option(cfg.run.root)}"
        self.alarms = Announcer(Path(cfg.run.root, cfg.run.id), runs_command)

    def update(self, metrics):
        info = f"reward {metrics['reward/mean']:.3f}  {metrics['perf/tokens_per_s']:.0f} tok/s"
        super().update(int(metrics["train/version"]), info)
        for line in self.alarms.lines():
            if self.bar:
                self.bar.console.print(line, markup=False, highlight=False)
            else:
                print(line, flush=True)
        for watcher in WATCHERS:
            watcher(metrics)


@contextlib.contextmanager
def stage(label):
    """A piece of work with no steps to count (a model build): a spinner on a terminal, a line
    when it starts and one when it ends otherwise; transformers' own bars stay quiet inside."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    start = time.monotonic()
    try:
        if sys.stdout.isatty():
            with Console().status(label):
                yield
        else:
            print(f"{label} ...", flush=True)
            yield
        print(f"{label}: done in {time.monotonic() - start:.1f} s", flush=True)
    finally:
        logging.enable_progress_bar()
