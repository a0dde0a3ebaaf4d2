"""The learner's step (forward, backward, optimizer) with a group's prompt run once, against the
full forward.

    python bench/shared_prefix.py [--quick] [--threads 1]

8 groups x 8 samples of the built-in tiny Qwen3 (random prompts of 22 tokens, replies of 3, 16 and
32 tokens), in this process, one after the other: seconds per step of the full forward, of the
packed one (a group's prefix and replies in one row) and of the cached one (prefixes, then replies
on their KV cache), the way chosen by default (packed while a group's row is at most twice the
hidden size) and full / default. The log-probs and gradients of every way are equal to float
rounding (tests/algo/test_shared_prefix.py).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from workbench.algo.losses import token_logprobs  # noqa: E402
from workbench.models.multimodal import load_policy  # noqa: E402
from workbench.models.prefix import plan, shared_prefix_logprobs  # noqa: E402
from workbench.models.tiny import tiny_model_path  # noqa: E402


def seconds_per_step(model, optimizer, ids, groups, shared: str, steps: int) -> float:
    mask = torch.ones_like(ids)
    times = []
    for _ in range(steps + 3):  # 3 warm-up steps
        start = time.perf_counter()
        if shared:
            logprob = shared_prefix_logprobs(
                model, ids, mask, plan(ids, mask.sum(-1), groups), packed=shared == "packed"
            )
        else:
            logprob = token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids)
        optimizer.zero_grad()
        logprob.mean().backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sum(times[3:]) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="1 step per point: a smoke run")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (molt-wb gives a tiny policy one)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_policy(str(tiny_model_path("tiny"))).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps = 1 if args.quick else 30
    groups = torch.arange(8).repeat_interleave(8)
    print(
        f"{'reply tokens':>12} {'full s':>8} {'packed s':>8} {'cached s':>8} {'default':>8} "
        f"{'full / default':>14}"
    )
    for reply in (3, 16, 32):
        ids = torch.cat(
            [
                torch.randint(10, 500, (8, 22)).repeat_interleave(8, 0),
                torch.randint(10, 500, (64, reply)),
            ],
            1,
        )
        full, packed, cached = (
            seconds_per_step(model, optimizer, ids, groups, way, steps)
            for way in ("", "packed", "cached")
        )
        default = "packed" if 22 + 8 * reply <= 2 * model.config.hidden_size else "cached"
        default_seconds = {"packed": packed, "cached": cached}[default]
        print(
            f"{reply:>12} {full:8.4f} {packed:8.4f} {cached:8.4f} {default:>8} "
            f"{full / default_seconds:14.2f}"
        )


if __name__ == "__main__":
    main()
