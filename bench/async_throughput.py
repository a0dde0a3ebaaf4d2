"""Steps/s and tokens/s of trainer.async_depth 0 vs 1 vs 2 on the same recipe, as ratios to depth 0.

    python bench/async_throughput.py [--quick] [--steps N] [override ...]

Every run is a real `loop.train` (Ray actors, store, gate) in this process, one after another on
one Ray instance; rates use the runs' own per-step wall times (start-up excluded). Async runs use
the token-level gate with partial rollout.
"""

import argparse
import tempfile

from workbench.config import compose_config
from workbench.run import loop
from workbench.store import open_run


def measure(root: str, depth: int, steps: int, extra: list[str]) -> dict:
    overrides = [
        "+recipe=arith",
        f"trainer.steps={steps}",
        "tracking=none",
        "run.progress=false",
        f"run.root={root}",
        f"run.id=depth{depth}",
        f"trainer.async_depth={depth}",
        *extra,
    ]
    if depth:
        overrides += ["gate.level=token", "rollout.partial=true"]
    run_id = loop.train(compose_config(overrides))
    db = open_run(run_id, root)
    # step 0 warms up
    wall, tokens, kept = db.execute(
        "select sum(value) filter (where key = 'perf/step_s'), "
        "sum(value) filter (where key = 'rollout/sampled_tokens'), "
        "avg(value) filter (where key = 'gate/kept_frac') from metrics where step > 0"
    ).fetchone()
    return {
        "steps_per_s": (steps - 1) / wall,
        "tokens_per_s": tokens / wall,
        "kept": kept,
        "staleness": db.execute("select avg(staleness) from gate_decisions").fetchone()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 steps per run, for a CI smoke run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as root:
        results = {depth: measure(root, depth, steps, args.overrides) for depth in (0, 1, 2)}
    base = results[0]
    print(
        f"{'async_depth':>11} {'steps/s':>8} {'tokens/s':>9} {'x steps':>8} {'x tokens':>9} "
        f"{'kept':>5} {'staleness':>9}"
    )
    for depth, r in results.items():
        print(
            f"{depth:>11} {r['steps_per_s']:8.2f} {r['tokens_per_s']:9.0f} "
            f"{r['steps_per_s'] / base['steps_per_s']:8.2f} "
            f"{r['tokens_per_s'] / base['tokens_per_s']:9.2f} "
            f"{r['kept']:5.2f} {r['staleness']:9.2f}"
        )


if __name__ == "__main__":
    main()
