"""Run-store ingest: token rows per second through step_tables -> RunWriter -> Parquet shard.

    python bench/store_ingest.py [--quick]

Prints tokens/s for building the Arrow rows, for the whole append + flush path, and for reading
the count back through DuckDB, with every per-token column the store keeps.
"""

import argparse
import tempfile
import time

import numpy as np

from workbench.segment import Segment
from workbench.store import open_run
from workbench.store.schema import step_tables
from workbench.store.writer import RunWriter


def batch(segments: int, length: int, step: int):
    rng = np.random.default_rng(step)
    mask = np.r_[np.zeros(length // 4), np.ones(length - length // 4)].astype(np.uint8)
    rows = [
        Segment(
            "bench",
            step * segments + i,
            0,
            i // 8,
            rng.integers(0, 50_000, length).astype(np.int32),
            mask,
            rng.normal(-1, 0.5, length).astype(np.float32) * mask,
            (mask.astype(np.int32) * (step + 1)) - 1,
            reward=float(i % 2),
        )
        for i in range(segments)
    ]
    learner = {
        "train_logprob": [s.behavior_logprob for s in rows],
        "advantage": [0.5] * segments,
        "is_weight": [np.ones(length, np.float32)] * segments,
        "gate": {
            "staleness": [0] * segments,
            "seq_log_ratio": [0.0] * segments,
            "geo_ratio": [1.0] * segments,
            "kept": [True] * segments,
            "reason": ["ok"] * segments,
            "tokens_masked": [0] * segments,
        },
    }
    return rows, learner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few steps, for a CI smoke run")
    args = parser.parse_args()
    steps = 20
    segments = 256  # per step
    length = 1024  # tokens per segment
    if args.quick:
        steps = 3
        segments = 64
        length = 256
    batches = [batch(segments, length, step) for step in range(steps)]
    tokens = steps * segments * length
    with tempfile.TemporaryDirectory() as root:
        writer = RunWriter(
            f"{root}/bench", {"run_id": "bench", "created": time.time(), "status": "running"}
        )
        start = time.perf_counter()
        tables = [
            step_tables("bench", step, step, rows, learner)
            for step, (rows, learner) in enumerate(batches)
        ]
        build = time.perf_counter() - start
        for table in tables:
            writer.append("segments", table["segments"])
            writer.append("tokens", table["tokens"])
            writer.append("gate_decisions", table["gate_decisions"])
            writer.flush()
        total = time.perf_counter() - start
        start = time.perf_counter()
        count = open_run("bench", root).execute("select count(*) from tokens").fetchone()[0]
        read = time.perf_counter() - start
    assert count == tokens
    print(f"tokens                 {tokens:,}")
    print(f"build rows   tokens/s  {tokens / build:,.0f}")
    print(
        f"ingest total tokens/s  {tokens / total:,.0f}   (rows + append + one zstd shard per step)"
    )
    print(f"duckdb count tokens/s  {tokens / read:,.0f}")


if __name__ == "__main__":
    main()
