"""Invariant: rollout and trainer compute the same model — the experts the rollout chose for each
token are the experts the training forward uses.

Rollout routing replay (R3, arXiv 2510.11370), with no change to the model code: a forward hook
on every MoE router (transformers' `*TopKRouter`: `forward(hidden) -> (logits, weights, indices)`)
either *captures* the top-k expert ids of each token, or *replays* recorded ones — the recorded
ids replace the live top-k, their weights are re-gathered from the live softmax (so router logits
and their gradient stay live) and re-normalised over the forced experts; a token whose record is
-1 keeps its live choice. Replay on or off, the hook *measures* where the live top-k differs from
the record, per layer and token. `decode_vllm_routed_experts` reads vLLM's formats into the same
int16 [T, layers, top_k] array.
"""

from __future__ import annotations

import base64
import contextlib
import io
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE router modules of a transformers model, in layer order (empty for a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")
    ]


@contextlib.contextmanager
def _hooked(
    routers: list[torch.nn.Module], make_hook: Callable[[int], Callable[..., object]]
) -> Iterator[None]:
    """`make_hook(layer)` installed as a forward hook on each router for the duration of the
    block."""
    handles = [router.register_forward_hook(make_hook(i)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module) -> Iterator[list[np.ndarray]]:
    """Yield a list that collects, per forward, one int16 [tokens, layers, top_k] array of live
    expert ids."""
    routers = find_routers(model)
    per_forward = []
    # this forward's [tokens, top_k] expert ids so far, one per MoE layer (they run in layer order)
    layers = []

    def record(
        module: torch.nn.Module,
        inputs: tuple[torch.Tensor, ...],
        output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> None:
        layers.append(output[2].detach().to(torch.int16))
        # the last MoE layer of this forward
        if len(layers) == len(routers):
            per_forward.append(torch.stack(layers, dim=1).numpy())
            layers.clear()

    with _hooked(routers, lambda layer: record):
        yield per_forward


@contextlib.contextmanager
def replay_routes(
    model: torch.nn.Module, routed_experts: torch.Tensor, enabled: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """Force (or, with enabled=False, only compare with) recorded routes for the next forwards.

    routed_experts: int [batch, seq, layers, top_k] for the batch about to be run (-1 = unknown).
    Yields a dict filled with `mismatch`: bool [batch, seq, layers] (live top-k set ≠ recorded set,
    where recorded), `known`: bool [batch, seq, layers] and `live`: int16
    [batch, seq, layers, top_k], the experts the live router chose.
    """
    routers = find_routers(model)
    batch, seq = routed_experts.shape[:2]
    stats = {}

    def table(name: str, fill: int, dtype: torch.dtype, *tail: int) -> torch.Tensor:
        """stats[name], made at the first forward: [batch, seq, layers, *tail] of `fill`."""
        return stats.setdefault(
            name, torch.full((batch, seq, len(routers), *tail), fill, dtype=dtype)
        )

    def hook(layer: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        def force(
            module: torch.nn.Module,
            inputs: tuple[torch.Tensor, ...],
            output: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # [tokens, experts], [tokens, k], [tokens, k]
            logits, live_weights, live = output
            recorded = (
                routed_experts[:, :, layer].reshape(-1, live.shape[-1]).to(live.device).long()
            )
            known = (recorded >= 0).all(-1)  # [tokens]
            same = (live.sort(-1).values == recorded.sort(-1).values).all(-1)
            table("mismatch", False, torch.bool)[:, :, layer] = (known & ~same).view(batch, seq)
            table("known", False, torch.bool)[:, :, layer] = known.view(batch, seq)
            table("live", -1, torch.int16, live.shape[-1])[:, :, layer] = live.view(batch, seq, -1)
            if not enabled:
                return output
            chosen = torch.where(known[:, None], recorded, live)  # [tokens, k]
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            # Mixtral always re-normalises; Qwen3-MoE / OLMoE by config
            if getattr(module, "norm_topk_prob", True):
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(live_weights.dtype), chosen

        return force

    with _hooked(routers, hook):
        yield stats


def decode_vllm_routed_experts(
    data: str | list[list[list[int]]] | np.ndarray, num_tokens: int
) -> np.ndarray:
    """vLLM's `routed_experts` (nested lists, or a base64 `.npy` string), one row per token that
    was fed (one fewer than the tokens: the last sampled token never is), as int16
    [num_tokens, layers, k] with -1 for rows vLLM did not report."""
    if isinstance(data, str):
        array = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    else:
        array = np.asarray(data)
    if array.ndim != 3:
        raise ValueError(
            f"routed_experts must be [tokens, layers, top_k]; got shape {array.shape}."
        )
    if not num_tokens - 1 <= len(array) <= num_tokens:
        raise ValueError(
            f"routed_experts has {len(array)} rows for {num_tokens} tokens (expected "
            f"{num_tokens - 1} or {num_tokens})."
        )
    out = np.full((num_tokens, *array.shape[1:]), -1, dtype=np.int16)
    out[: len(array)] = array.astype(np.int16)
    return out
