"""Routing replay on the tiny MoE: learner forward+backward time with replay / without, and what
replay buys when the rollout's routes differ (router noise on the rollout engine).

    python bench/replay_overhead.py [--quick] [--model tiny-moe|tiny-mixtral]
"""

import argparse
import dataclasses
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.routing_replay import find_routers
from workbench.learner.batch import collate
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment


def segments_from(engine, count, max_tokens):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 400, size=16).astype(np.int32) for _ in range(count)]
    generations = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=1))
    out = []
    for i, (p, g) in enumerate(zip(prompts, generations, strict=True)):
        mask = np.r_[np.zeros(len(p)), np.ones(len(g.token_ids))].astype(np.uint8)
        out.append(
            Segment(
                "b",
                i,
                0,
                i // 4,
                np.r_[p, g.token_ids].astype(np.int32),
                mask,
                np.r_[np.zeros(len(p)), g.logprobs].astype(np.float32),
                np.where(mask == 1, 0, -1).astype(np.int32),
                reward=float(i % 2),
                routed_experts=g.extras["routed_experts"],
            )
        )
    return out


def forward_backward_seconds(learner, batch, replay, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logprob = learner.logprobs(batch, replay=replay)
        (logprob * batch.loss_mask).sum().backward()
        learner.model.zero_grad()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny-moe")
    args = parser.parse_args()
    # sequences, new tokens per sequence, timed rounds
    count = 32
    tokens = 48
    repeats = 15
    if args.quick:
        count = 8
        tokens = 16
        repeats = 3
    torch.set_num_threads(2)
    path = str(tiny_model_path(args.model))
    cfg = compose_config([f"model={args.model}", "algo.routing_replay=true"])
    OmegaConf.update(cfg, "run.id", "bench")
    learner = Learner(cfg, path)
    batch = collate(segments_from(TorchEngine(path), count, tokens))
    unrouted = dataclasses.replace(batch, routed_experts=None)
    # no hooks; routes measured only; replayed
    cases = [
        (unrouted, False),
        (batch, False),
        (batch, True),
    ]
    for case in cases:
        forward_backward_seconds(learner, *case, 2)  # warm-up
    # interleaved rounds: drift hits every case alike
    rounds = []
    for _ in range(repeats):
        rounds.append([forward_backward_seconds(learner, *case, 1) for case in cases])
    bare, plain, replayed = np.median(np.array(rounds), axis=0)
    print(
        f"{args.model}: {count} sequences x {batch.token_ids.shape[1]} tokens, "
        f"{len(find_routers(learner.model))} MoE layers"
    )
    print(
        f"forward+backward  no hooks {bare * 1e3:7.1f} ms   measured only {plain * 1e3:7.1f} ms   "
        f"with replay {replayed * 1e3:7.1f} ms   replay / no hooks {replayed / bare:.3f}"
    )
    noisy = TorchEngine(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in find_routers(noisy.model):
            router.weight.add_(0.5 * router.weight.abs().mean() * torch.randn_like(router.weight))
    batch = collate(segments_from(noisy, count, tokens))
    routing = {}
    with torch.no_grad():
        old = learner.logprobs(batch, routing=routing)
    metrics = learner.routing_metrics(batch, routing, old)
    print(
        "router noise on the rollout: mismatched tokens "
        f"{metrics['routing/mismatch_token_frac']:.3f}, "
        f"(token, layer) pairs {metrics['routing/mismatch_layer_frac']:.3f}"
    )
    kl_no_replay = metrics["mismatch/kl_no_replay"]
    kl_replay = metrics["mismatch/kl_replay"]
    print(
        f"KL(rollout || learner)  without replay {kl_no_replay:.2e}   with replay "
        f"{kl_replay:.2e}   reduction {kl_no_replay / max(kl_replay, 1e-12):.1f}x"
    )


if __name__ == "__main__":
    main()
