"""The off-policy gap's cost: a learner step on a batch of stale tokens with the gap's drawn rows
(`audit.gap_rows`, default 4) against the same step with none (0), on the tiny policy, alternating
the two learners step by step; CPU seconds of this process (one torch thread), which other jobs on
the machine do not move, and wall seconds beside them.

    python bench/gap_overhead.py [--quick] [--rows 64] [--gap-rows 4] [--model tiny]
"""

import argparse
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment


def generated(engine: TorchEngine, count: int, max_tokens: int) -> list[Segment]:
    """`count` segments the engine sampled (16 prompt tokens each), in groups of 8."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 400, size=16).astype(np.int32) for _ in range(count)]
    generations = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=1))
    out = []
    for i, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(generation.token_ids))].astype(np.uint8)
        out.append(
            Segment(
                "bench",
                i,
                0,
                i // 8,
                np.r_[prompt, generation.token_ids].astype(np.int32),
                mask,
                np.r_[np.zeros(len(prompt)), generation.logprobs].astype(np.float32),
                np.where(mask == 1, 0, -1).astype(np.int32),
                reward=float(i % 2),
            )
        )
    return out


def stale(segments: list[Segment], version: int) -> list[Segment]:
    """The segments as sampled by `version` (the learner's previous one)."""
    for segment in segments:
        segment.behavior_version = np.where(segment.loss_mask == 1, version, -1).astype(np.int32)
    return segments


def timed_step(learner: Learner, segments: list[Segment]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one learner step on `segments`, one version behind."""
    batch = stale(segments, learner.version - 1)
    cpu = time.process_time()
    wall = time.perf_counter()
    learner.train(batch)
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=64, help="rows of a batch (8 x 8 by default)")
    parser.add_argument("--gap-rows", type=int, default=4, help="audit.gap_rows measured")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per row")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each learner")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    if args.quick:
        args.rows = 16
        args.tokens = 16
        args.steps = 3
    torch.set_num_threads(1)
    path = str(tiny_model_path(args.model))
    segments = generated(TorchEngine(path), args.rows, args.tokens)
    learners = {}
    for gap_rows in (0, args.gap_rows):
        overrides = [f"model={args.model}", "trainer.async_depth=1", "gate.level=token"]
        cfg = compose_config([*overrides, f"audit.gap_rows={gap_rows}"])
        OmegaConf.update(cfg, "run.id", "bench")
        learners[gap_rows] = Learner(cfg, path)
        # the first step keeps version 0: the next is one version behind, as async_depth=1 is
        learners[gap_rows].train(stale(segments, 0))
    seconds = {gap_rows: [] for gap_rows in learners}
    for _ in range(args.steps):
        for gap_rows, learner in learners.items():
            seconds[gap_rows].append(timed_step(learner, segments))
    base_cpu, base_wall = np.median(seconds[0], axis=0)
    gap_cpu, gap_wall = np.median(seconds[args.gap_rows], axis=0)
    print(
        f"model {args.model}, {args.rows} rows of 16 + {args.tokens} tokens, every sampled token "
        f"one version behind, median of {args.steps} steps each"
    )
    for gap_rows, (cpu, wall) in ((0, (base_cpu, base_wall)), (args.gap_rows, (gap_cpu, gap_wall))):
        print(f"audit.gap_rows={gap_rows}:  {cpu * 1e3:8.1f} ms CPU  {wall * 1e3:8.1f} ms wall")
    print(
        f"overhead: {gap_cpu / base_cpu - 1:+.1%} CPU, {gap_wall / base_wall - 1:+.1%} wall "
        f"(target: at most +5%)"
    )


if __name__ == "__main__":
    main()
