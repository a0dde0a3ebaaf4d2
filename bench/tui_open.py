"""Time to first paint of `molt-wb inspect` on a run of 10^6 tokens.

    python bench/tui_open.py [--quick] [--segments 5000] [--length 200] [--steps 50]

A synthetic run is written directly as Parquet shards with the store's schemas (one shard per step
and table, as the writer does), then the app is driven headless (Textual's Pilot, 100x30) and each
figure is the time from a key press to the screen having painted its data: wall clock, and the
process's CPU time (all threads), which is what the wall time would be on an idle machine.
"""

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workbench.store.schema import GAP_COLUMNS, TABLES


def write_run(root: Path, segments: int, length: int, steps: int, layers: int = 3) -> str:
    run_id = "20260101-000000-be9c"
    rng = np.random.default_rng(0)
    folder = root / run_id
    for name in TABLES:
        (folder / name).mkdir(parents=True)
    n = segments // steps  # segments per step
    prompt = length // 4
    for step in range(steps):
        rollout = np.arange(step * n, (step + 1) * n)
        reward = rng.integers(0, 2, n).astype(float)
        sampled = np.tile(np.arange(length) >= prompt, n)
        # one step's shard of each table
        columns = {
            "segments": dict(
                step=[step] * n,
                rollout_id=rollout,
                segment_idx=[0] * n,
                group_id=rollout // 8,
                reward=reward,
                advantage=rng.normal(size=n).astype(np.float32),
                num_tokens=[length] * n,
                num_sampled=[length - prompt] * n,
                min_version=[max(step - 1, 0)] * n,
                max_version=[step] * n,
                learner_version=[step] * n,
                finish_reason=["stop"] * n,
                seal_reason=["end"] * n,
                turn_spans=[[[prompt, length]]] * n,
                turn_rewards=reward[:, None].tolist(),
                prompt_text=[f"What is {i % 9} + {i % 7}?" for i in rollout],
                response_text=["42"] * n,
                images=[[]] * n,
                info=["{}"] * n,
            ),
            "tokens": dict(
                step=np.full(n * length, step, np.int32),
                rollout_id=np.repeat(rollout, length),
                segment_idx=np.zeros(n * length, np.int32),
                position=np.tile(np.arange(length, dtype=np.int32), n),
                token_id=rng.integers(0, 500, n * length).astype(np.int32),
                loss_mask=sampled.astype(np.uint8),
                behavior_logprob=-rng.exponential(1.0, n * length).astype(np.float32),
                train_logprob=-rng.exponential(1.0, n * length).astype(np.float32),
                behavior_version=np.full(n * length, step, np.int32),
                is_weight=rng.uniform(0.5, 1.5, n * length).astype(np.float32),
                advantage=np.zeros(n * length, np.float32),
                entropy=rng.exponential(1.0, n * length).astype(np.float32),
                # one sampled turn, the episode's first
                turn=pa.array(np.zeros(n * length, np.int32), mask=~sampled),
                # the off-policy gap's parts: measured on a sample of rows only, null elsewhere
                **{column: pa.nulls(n * length, pa.float32()) for column in GAP_COLUMNS},
            ),
            "gate_decisions": dict(
                step=[step] * n,
                rollout_id=rollout,
                segment_idx=[0] * n,
                learner_version=[step] * n,
                min_version=[step] * n,
                max_version=[step] * n,
                staleness=[0] * n,
                seq_log_ratio=[0.0] * n,
                geo_ratio=[1.0] * n,
                decision=rng.choice(["kept", "dropped"], n).tolist(),
                reason=["ok"] * n,
                tokens_masked=[0] * n,
            ),
            "routing": dict(
                step=[step] * n * layers,
                rollout_id=np.repeat(rollout, layers),
                segment_idx=[0] * n * layers,
                layer=np.tile(np.arange(layers), n),
                tokens=[length] * n * layers,
                mismatched=[1] * n * layers,
                positions=[[prompt + 1]] * n * layers,
                rollout_experts=[[[0, 1]]] * n * layers,
                learner_experts=[[[0, 2]]] * n * layers,
            ),
            "metrics": dict(
                step=[step] * 5,
                key=[
                    "reward/mean",
                    "loss/policy",
                    "gate/kept_frac",
                    "mismatch/kl",
                    "routing/mismatch_token_frac",
                ],
                value=rng.uniform(size=5),
                time=[0.0] * 5,
            ),
        }
        for name, table in columns.items():
            rows = len(next(iter(table.values())))
            pq.write_table(
                pa.table({"run_id": [run_id] * rows, **table}, schema=TABLES[name]),
                folder / name / f"part-{step:06d}.parquet",
            )
    (folder / "run.json").write_text(
        json.dumps(
            {
                "run_id": run_id,
                "recipe": "synthetic",
                "status": "finished",
                "created": time.time(),
                "steps_done": steps,
                "steps": steps,
                "config": {"model": {"name": "tiny", "path": None}},
            }
        )
    )
    return run_id


def clock() -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds over all threads)."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds from `start` to now."""
    now = clock()
    return now[0] - start[0], now[1] - start[1]


async def drive(root: str, run_id: str) -> dict:
    from textual.widgets import DataTable

    from workbench.tui.app import InspectApp

    app = InspectApp(root, run_id, poll=3600)
    figures = {}
    start = clock()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        figures["open run (overview + all tabs loaded)"] = since(start)
        # raises if the segments tab did not build its table
        app.screen.query_one("#segments-table", DataTable)
        for label, keys in (
            ("segments table", ["2"]),
            ("token view (first open: tokenizer load)", ["enter"]),
            ("token view (next open)", ["escape", "down", "enter"]),
            ("move cursor one token", ["right"]),
        ):
            start = clock()
            await pilot.press(*keys)
            await pilot.pause()
            figures[label] = since(start)
        await pilot.press("escape")
        start = clock()
        app.screen.query_one("#filter").value = "dropped What is 3"
        await pilot.pause()
        figures["filter (dropped + text search)"] = since(start)
        figures["segments matching the filter"] = int(
            str(app.screen.query_one("#segments-status").render()).split()[3]
        )
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=5000)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="10^4 tokens: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.segments = 200
        args.length = 50
        args.steps = 5
    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        run_id = write_run(Path(root), args.segments, args.length, args.steps)
        size = sum(p.stat().st_size for p in Path(root).rglob("*.parquet"))
        print(
            f"synthetic run: {args.segments * args.length:,} tokens, {args.segments:,} segments, "
            f"{args.steps} shards per table, {size / 2**20:.1f} MiB, "
            f"written in {time.perf_counter() - start:.1f} s"
        )
        print(f"  {'':<42} {'wall':>8} {'cpu':>8}")
        for label, value in asyncio.run(drive(root, run_id)).items():
            if isinstance(value, tuple):
                print(f"  {label:<42} {value[0] * 1000:6.0f} ms {value[1] * 1000:5.0f} ms")
            else:
                print(f"  {label:<42} {value:8d}")


if __name__ == "__main__":
    main()
