"""What a run shows while it trains: the progress bar and the step clock's `perf/` metrics; a new
phase timing or progress field changes here.
"""

from __future__ import annotations

import sys
import time

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as Bar


class StepClock:
    """Wall time of the phases of a step, as `perf/` metrics."""

    def __init__(self):
        self.start = time.perf_counter()
        self.mark = self.start
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self.mark
        self.mark = now

    def metrics(self, metrics: dict) -> dict:
        total = time.perf_counter() - self.start
        perf = {f"perf/{phase}_s": seconds for phase, seconds in self.phases.items()}
        perf["perf/step_s"] = total
        perf["perf/tokens_per_s"] = metrics.get("rollout/sampled_tokens", 0) / max(total, 1e-9)
        return dict(metrics, **perf)


class Progress:
    """A rich progress bar with step, reward and tokens/s; one line per step when not a terminal;
    nothing when off."""

    def __init__(self, cfg):
        self.bar = None
        self.enabled = cfg.run.progress
        self.done = 0
        if self.enabled and sys.stdout.isatty():
            self.bar = Bar(
                TextColumn(f"[bold]{cfg.run.id}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task("train", total=cfg.trainer.steps, info="")
            self.bar.start()

    def update(self, metrics: dict) -> None:
        self.done = int(metrics["train/version"])
        info = f"reward {metrics['reward/mean']:.3f}  {metrics['perf/tokens_per_s']:.0f} tok/s"
        if self.bar:
            self.bar.update(self.task, completed=self.done, info=info)
        elif self.enabled:
            print(f"step {self.done}: {info}", flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
