"""CPU milliseconds per step of each process of a running loop: where the two cores go.

    python bench/process_cpu.py [--quick] [--steps N] [override ...]

Runs the arith recipe (`+recipe=arith`, plus any overrides, e.g. `trainer.async_depth=1
gate.level=token`) through `loop.train` and reads every process's CPU times (`psutil`: this driver,
Ray's actors and its own processes) after step 10 (2 with `--quick`) and after the last step.
Prints each process's CPU milliseconds per step, the step's wall milliseconds, and how many of the
cores the loop kept busy. On two cores a step can take no less than the sum over the processes
divided by two: this is the figure to cut.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.config import compose_config  # noqa: E402
from workbench.run import (
    loop,
    progress,  # noqa: E402
)

FIRST = 10  # steps left out: start-up and warm-up


def snapshot() -> dict[int, tuple[str, float]]:
    """{pid: (name, user + system CPU seconds)} of this process and all its descendants."""
    import psutil

    me = psutil.Process()
    out = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            name = "driver"
            if process.pid != me.pid:
                name = (process.cmdline() or [process.name()])[0]
            out[process.pid] = (name.split("/")[-1][:40], times.user + times.system)
        except psutil.Error:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="4 steps, 2 measured: a smoke run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    steps = args.steps
    first = FIRST
    if args.quick:
        steps = 4
        first = 2
    marks: dict[int, tuple[float, dict]] = {}
    update = progress.Progress.update

    # after each step's metrics: the moments to read the processes' CPU times
    def marked(self, metrics):
        update(self, metrics)
        if self.done in (first, steps):
            marks[self.done] = (time.perf_counter(), snapshot())

    progress.Progress.update = marked
    with tempfile.TemporaryDirectory() as root:
        cfg = compose_config(
            [
                "+recipe=arith",
                f"trainer.steps={steps}",
                "tracking=none",
                "run.progress=false",
                "trainer.checkpoint_every=0",
                f"run.root={root}",
                *args.overrides,
            ]
        )
        loop.train(cfg)
    start, before = marks[first]
    end, after = marks[steps]
    n = steps - first
    wall = (end - start) / n * 1000
    rows = sorted(
        ((cpu - before.get(pid, (name, 0.0))[1]) / n * 1000, name)
        for pid, (name, cpu) in after.items()
    )
    total = sum(ms for ms, _ in rows)
    print(f"{' '.join(args.overrides) or 'arith recipe'}: {n} steps after the first {first}")
    print(f"{'CPU ms / step':>14}  process")
    for ms, name in reversed(rows):
        if ms >= 0.3:
            print(f"{ms:14.1f}  {name}")
    print(f"{total:14.1f}  all, over {wall:.1f} ms of wall per step: {total / wall:.2f} cores busy")


if __name__ == "__main__":
    main()
