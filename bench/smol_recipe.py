"""A real-model recipe's table: per seed, its training wall time from an empty model cache, its
held-out accuracy before and after (sampled at the training temperature and greedy), its peak PSS.

    python bench/smol_recipe.py [--quick] [--recipe smol_gcd] [--seeds 0-2] [--samples 4] [override]

Each seed: the model cache emptied (a fresh `MOLT_WB_CACHE` under a temporary folder, so the
conversion from the registry's GGUF is timed with the run, as a first user meets it), then
`molt-wb train +recipe=RECIPE seed=S` timed as a child process (its wall time is the table's),
then `molt-wb eval` of the starting policy and of the final checkpoint on the run's held-out
split, greedy (eval.temperature=0) and sampled at engine.temperature with `--samples` samples
per question. The load average (`os.getloadavg`, 1 minute) is printed beside each run: on a
shared machine the wall time grows with it. Prints one Markdown row per seed.

`--quick` (a smoke run) trains seed 0 for one step of 2 questions x 2 samples in the model cache
as it is (a converted model already there is reused) and scores 4 held-out questions.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def seed_list(text: str) -> list[int]:
    """'2' -> [2]; '0-2' -> [0, 1, 2]; '0,2' -> [0, 2]."""
    first, _, last = text.partition("-")
    if last:
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",")]


def accuracy(run_id: str, root: str, checkpoint: str | None, overrides: list[str]) -> float:
    """`molt-wb eval RUN [CHECKPOINT] overrides`: the held-out accuracy."""
    from workbench.run.evaluate import from_checkpoint

    return from_checkpoint(run_id, checkpoint, root, overrides)["accuracy"]


def one_seed(
    recipe: str, seed: int, samples: int, overrides: list[str], root: str, empty_cache: bool = True
) -> dict:
    """Train one seed (from an empty model cache unless told otherwise); its wall time,
    accuracies and peak PSS."""
    from workbench.run.checkpoint import saved_config
    from workbench.run.model_paths import policy_path
    from workbench.run.summary import figures

    run_id = f"{recipe}-seed{seed}"
    cache = tempfile.mkdtemp(prefix="molt-wb-cache-")
    if not empty_cache:
        from workbench.models.tiny import cache_root

        cache = str(cache_root())
    env = {**os.environ, "MOLT_WB_CACHE": cache}
    # the molt-wb beside this interpreter: the venv's, activated or not
    molt_wb = str(Path(sys.executable).with_name("molt-wb"))
    command = [molt_wb, "train", f"+recipe={recipe}", f"seed={seed}", f"run.id={run_id}"]
    command += [f"run.root={root}", "run.progress=false", *overrides]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    os.environ["MOLT_WB_CACHE"] = cache
    run_dir = Path(root) / run_id
    temperature = saved_config(run_dir, []).engine.temperature
    start_policy = policy_path(saved_config(run_dir, []))
    sampled = [f"eval.temperature={temperature}", f"eval.samples={samples}"]
    greedy = ["eval.temperature=0"]
    memory = figures(run_id, root)["maxima"]["memory/pss_peak_bytes"]
    return {
        "seed": seed,
        "wall_s": wall,
        "load": (load_before, load_after),
        "before": (
            accuracy(run_id, root, start_policy, sampled),
            accuracy(run_id, root, start_policy, greedy),
        ),
        "after": (accuracy(run_id, root, None, sampled), accuracy(run_id, root, None, greedy)),
        "pss_gb": memory / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one step of seed 0: a smoke run")
    parser.add_argument("--recipe", default="smol_gcd")
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--samples", type=int, default=4, help="sampled answers per question")
    parser.add_argument("--root", default=None, help="run folder (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for the training runs")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="molt-wb-runs-")
    print(
        "| seed | wall time | load (1 min) | sampled before → after | greedy before → after "
        "| peak PSS |\n| --- | --- | --- | --- | --- | --- |",
        flush=True,
    )
    seeds = seed_list(args.seeds)
    overrides = args.overrides
    if args.quick:
        seeds = [0]
        quick = ["trainer.steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2"]
        overrides = [*quick, "trainer.checkpoint_every=1", "eval.size=4", *overrides]
    for seed in seeds:
        row = one_seed(args.recipe, seed, args.samples, overrides, root, empty_cache=not args.quick)
        minutes, seconds = divmod(round(row["wall_s"]), 60)
        print(
            f"| {seed} | {minutes} min {seconds:02d} s "
            f"| {row['load'][0]:.1f} → {row['load'][1]:.1f} "
            f"| {row['before'][0]:.0%} → {row['after'][0]:.0%} "
            f"| {row['before'][1]:.0%} → {row['after'][1]:.0%} | {row['pss_gb']:.2f} GB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
