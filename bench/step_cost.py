"""Where a molt-wb step's wall time goes, and how step time and memory grow with the work.

    python bench/step_cost.py [--quick] [--steps N] [override ...]

Every run is a real `loop.train` (Ray actors, store, gate) in this process on one Ray instance.
Model compute is timed where it happens: `perf/generate_s` (the engine's generate calls; the
slowest worker's when several run side by side) and `perf/learner_compute_s` (the learner's
forwards, backward and optimizer step). Framework overhead is the rest of `perf/step_s`: Ray
calls and transfers, episode and Segment building, the token-identity audit, collation, gate and
advantages, metrics, the weight push. The store's writes run in its own actor, off the step; its
share is its CPU seconds per step (`perf/store_cpu_s`) over the step's wall time.

Runs: the arith recipe as it is (warm-started: 2-token replies, so compute is smallest), then the
scaling points from a base without the warm start (replies run to `engine.max_tokens`): base
(group 8, 32 new tokens, 1 rollout worker), group size x2, new tokens x2, rollout workers x2, and
the `small` policy (4.2M parameters, ~10x tiny's compute per token: how the overhead's share falls
as model compute grows).
Peak memory is the RSS of this process and its children (Ray's processes), sampled every 0.1 s.
Means exclude each run's first (warm-up) step.
"""

import argparse
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workbench.config import compose_config  # noqa: E402
from workbench.run import (
    cluster,
    loop,  # noqa: E402
)
from workbench.store import open_run  # noqa: E402

KEYS = (
    "step_s",
    "rollout_s",
    "train_s",
    "generate_s",
    "learner_compute_s",
    "tokens_per_s",
    "store_cpu_s",
)


class PeakRSS:
    """Peak RSS of this process tree while the block runs."""

    def __enter__(self):
        import psutil

        self.peak = 0
        self.done = threading.Event()
        me = psutil.Process()

        def sample():
            while not self.done.wait(0.1):
                try:
                    tree = [me, *me.children(recursive=True)]
                    self.peak = max(self.peak, sum(p.memory_info().rss for p in tree))
                except psutil.Error:
                    pass

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def measure(root: str, name: str, steps: int, overrides: list[str]) -> dict:
    cfg = compose_config(
        [
            "+recipe=arith",
            f"trainer.steps={steps}",
            "tracking=none",
            "run.progress=false",
            "trainer.checkpoint_every=0",
            f"run.root={root}",
            f"run.id={name}",
            *overrides,
        ]
    )
    with PeakRSS() as memory:
        run_id = loop.train(cfg)
    averages = ", ".join(f"avg(value) filter (where key = 'perf/{k}')" for k in KEYS)
    db = open_run(run_id, root)
    row = db.execute(f"select {averages} from metrics where step > 0").fetchone()
    means = dict(zip(KEYS, row, strict=True))
    means["peak_mb"] = memory.peak / 2**20
    # model compute on the step's critical path: generation then training when synchronous; when
    # rollout runs ahead (async_depth > 0) the two overlap, and the step waits on the slower of them
    both = (means["generate_s"], means["learner_compute_s"])
    if cfg.trainer.async_depth:
        means["overhead_s"] = means["step_s"] - max(both)
    else:
        means["overhead_s"] = means["step_s"] - sum(both)
    means["overhead"] = means["overhead_s"] / means["step_s"]
    return means


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick", action="store_true", help="arith and base only, 2 steps each unless --steps"
    )
    parser.add_argument("--steps", type=int, help="steps per run (default 12)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    steps = args.steps or (2 if args.quick else 12)
    base = [
        "model.warm_start_steps=0",
        "engine.max_tokens=32",
        "trainer.group_size=8",
        "ray.rollout_workers=1",
    ]
    runs = {
        "arith recipe": [],
        "base": base,
        "group x2": [*base, "trainer.group_size=16"],
        "tokens x2": [*base, "engine.max_tokens=64"],
        "workers x2": [*base, "ray.rollout_workers=2"],
        "model x10": [*base, "model=small"],
    }
    if args.quick:
        runs = dict(list(runs.items())[:2])
    # one Ray for every run, with a slot per actor of the largest
    cluster.init_ray(compose_config(["ray.rollout_workers=2"]))
    with tempfile.TemporaryDirectory() as root:
        results = {
            name: measure(root, f"run{i}", steps, [*overrides, *args.overrides])
            for i, (name, overrides) in enumerate(runs.items())
        }
    print(
        f"{'run':>12} {'step_s':>7} {'rollout':>7} {'train':>6} {'generate':>8} {'learn':>6} "
        f"{'overhead':>8} {'ms':>5} {'store':>6} {'tokens/s':>8} {'peak_MB':>7} {'x step':>6} "
        f"{'x mem':>5}"
    )
    for name, r in results.items():
        # the scaling points are read against base; the arith recipe against itself
        scale = r
        if name != "arith recipe":
            scale = results["base"]
        print(
            f"{name:>12} {r['step_s']:7.3f} {r['rollout_s']:7.3f} {r['train_s']:6.3f} "
            f"{r['generate_s']:8.3f} {r['learner_compute_s']:6.3f} {r['overhead']:8.1%} "
            f"{r['overhead_s'] * 1000:5.0f} {r['store_cpu_s'] / r['step_s']:6.1%} "
            f"{r['tokens_per_s']:8.0f} {r['peak_mb']:7.0f} {r['step_s'] / scale['step_s']:6.2f} "
            f"{r['peak_mb'] / scale['peak_mb']:5.2f}"
        )
    print(
        "overhead = 1 - model compute on the critical path / step: generate + learn when "
        "synchronous, the larger of the two when async_depth > 0 overlaps them; ms: the same, in "
        "milliseconds per step; store: the store actor's CPU seconds per step / step (its work "
        "runs off the step's path, on the same cores); x step, x mem: against base"
    )


if __name__ == "__main__":
    main()
