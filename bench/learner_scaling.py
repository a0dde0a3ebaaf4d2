"""How the sharded learner's memory and step time scale with its ranks (#15).

    python bench/learner_scaling.py [--quick] [--ranks 1,2] [--model small] [--segments 32]

Each rank count runs the real `Learner` in that many processes joined in a gloo process group (the
policy FSDP2-sharded when there are several), trains the same batch of random segments for a few
steps, and reports per rank the bytes of the parameters, gradients and AdamW state it holds (its
shards), and the mean step time. The memory is measured, the expectation is ~1/N of one rank's;
on a 2-core CPU machine the time does not fall with more ranks (they share the cores), it is
printed to show the cost of the collectives, not a speed-up.
"""

import argparse
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from workbench.config import compose_config  # noqa: E402
from workbench.learner.learner import Learner  # noqa: E402
from workbench.segment import Segment  # noqa: E402


def local_bytes(tensors) -> int:
    """Bytes a rank holds of these tensors: a DTensor's local shard, a tensor whole."""
    total = 0
    for tensor in tensors:
        if tensor is None or not torch.is_tensor(tensor):
            continue
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        total += tensor.numel() * tensor.element_size()
    return total


def segments(count: int, length: int, vocab: int) -> list[Segment]:
    rng = np.random.default_rng(0)
    out = []
    for index in range(count):
        ids = rng.integers(5, vocab, size=length).astype(np.int32)
        mask = (np.arange(length) >= length // 2).astype(np.uint8)
        behavior = np.where(mask == 1, -5.0, 0.0).astype(np.float32)
        version = np.where(mask == 1, 0, -1).astype(np.int32)
        reward = float(index % 2)
        out.append(Segment("bench", index, 0, index // 4, ids, mask, behavior, version, reward))
    return out


def rank_main(rank, ranks, port, model, count, steps, out):
    torch.set_num_threads(1)
    cfg = compose_config([f"model={model}", f"ray.learner_workers={ranks}"])
    OmegaConf.update(cfg, "run.id", "bench")
    from workbench.run.model_paths import policy_path

    learner = Learner(cfg, policy_path(cfg), rank, ("127.0.0.1", port))
    batch = segments(count, 64, learner.model.config.vocab_size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        learner.train(batch)
        times.append(time.perf_counter() - start)
    optimizer_state = [t for state in learner.optimizer.state.values() for t in state.values()]
    figures = {
        "parameters": local_bytes(learner.model.parameters()),
        "gradients": local_bytes(p.grad for p in learner.model.parameters()),
        "optimizer": local_bytes(optimizer_state),
        "step_s": float(np.mean(times[1:] or times)),
    }
    torch.save(figures, f"{out}.{rank}")


def measure(ranks: int, model: str, count: int, steps: int) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder, "figures"))
        mp.spawn(rank_main, args=(ranks, port, model, count, steps, out), nprocs=ranks)
        return [torch.load(f"{out}.{rank}") for rank in range(ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 segments, 2 steps")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--model", default="small")
    parser.add_argument("--segments", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.model = "tiny"
        args.segments = 8
        args.steps = 2
    print(f"model={args.model}, {args.segments} segments x 64 tokens, {args.steps} steps")
    print("ranks | rank | parameters MB | gradients MB | AdamW state MB | total ÷ 1 rank | step s")
    baseline = None
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for rank, figures in enumerate(measure(ranks, args.model, args.segments, args.steps)):
            total = figures["parameters"] + figures["gradients"] + figures["optimizer"]
            baseline = baseline or total
            print(
                f"{ranks} | {rank} | {figures['parameters'] / 2**20:.2f} | "
                f"{figures['gradients'] / 2**20:.2f} | {figures['optimizer'] / 2**20:.2f} | "
                f"{total / baseline:.2f} | {figures['step_s']:.3f}"
            )


if __name__ == "__main__":
    main()
