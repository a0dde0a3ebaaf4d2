"""LoRA against full fine-tuning on the same policy and batch (#16), each in a fresh process.

    python bench/lora.py [--quick] [--model small] [--rank 16] [--segments 32] [--steps 4]

Each mode builds the real `Learner`, trains the same batch of random segments for a few steps and
reports: the bytes of trainable parameters, of gradients and of AdamW state it holds, the peak
resident memory of its process, the mean step time, and the bytes one weight push carries
(`perf/weight_sync_bytes`: the full weights, or the adapter alone).
"""

import argparse
import multiprocessing
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(model: str, rank: int, count: int, steps: int, out) -> None:
    import numpy as np
    import torch
    from omegaconf import OmegaConf

    from workbench.config import compose_config
    from workbench.learner.learner import Learner
    from workbench.run.model_paths import policy_path
    from workbench.segment import Segment

    torch.set_num_threads(1)
    cfg = compose_config([f"model={model}", f"model.lora.rank={rank}"])
    OmegaConf.update(cfg, "run.id", "bench")
    learner = Learner(cfg, policy_path(cfg))
    rng = np.random.default_rng(0)
    batch = []
    for index in range(count):
        ids = rng.integers(5, learner.model.config.vocab_size, size=64).astype(np.int32)
        mask = (np.arange(64) >= 32).astype(np.uint8)
        behavior = np.where(mask == 1, -5.0, 0.0).astype(np.float32)
        version = np.where(mask == 1, 0, -1).astype(np.int32)
        reward = float(index % 2)
        batch.append(Segment("bench", index, 0, index // 4, ids, mask, behavior, version, reward))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        metrics, _, _ = learner.step(batch)
        times.append(time.perf_counter() - start)
    trainable = [p for p in learner.model.parameters() if p.requires_grad]
    moments = [t for state in learner.optimizer.state.values() for t in state.values()]
    out.put(
        {
            "trainable": sum(p.numel() * p.element_size() for p in trainable),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in trainable),
            "optimizer": sum(t.numel() * t.element_size() for t in moments if t.dim()),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": float(np.mean(times[1:] or times)),
            "push": metrics["perf/weight_sync_bytes"],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 segments, 2 steps")
    parser.add_argument("--model", default="small")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--segments", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.model = "tiny"
        args.segments = 8
        args.steps = 2
    context = multiprocessing.get_context("spawn")
    rows = {}
    for name, rank in (("full", 0), (f"LoRA r={args.rank}", args.rank)):
        out = context.Queue()
        process = context.Process(
            target=measure, args=(args.model, rank, args.segments, args.steps, out)
        )
        process.start()
        rows[name] = out.get()
        process.join()
    print(f"model={args.model}, {args.segments} segments x 64 tokens, {args.steps} steps")
    print("mode | trainable MB | gradients MB | AdamW MB | peak RSS MB | step s | push MB")
    for name, r in rows.items():
        print(
            f"{name} | {r['trainable'] / 2**20:.2f} | {r['gradients'] / 2**20:.2f} | "
            f"{r['optimizer'] / 2**20:.2f} | {r['peak_rss'] / 2**20:.0f} | {r['step_s']:.3f} | "
            f"{r['push'] / 2**20:.3f}"
        )
    full = rows["full"]
    lora = rows[f"LoRA r={args.rank}"]
    ratios = {key: lora[key] / full[key] for key in ("push", "optimizer", "step_s")}
    print(
        f"LoRA ÷ full: push {ratios['push']:.3f}, optimizer state {ratios['optimizer']:.3f}, "
        f"step time {ratios['step_s']:.2f}"
    )


if __name__ == "__main__":
    main()
