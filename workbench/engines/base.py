"""The engine protocol: token ids in, sampled token ids and their log-probs out, versioned.

An engine never sees text. It samples continuations of exact prompt ids and reports, per sampled
token, the log-prob under the distribution it sampled from (temperature applied), together with
the weight version that produced it. The torch engine implements it on CPU, the vLLM engine on
vLLM.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

# torch loads inside the wire functions: the loopback server and the rollout import this module
# without needing torch.
if TYPE_CHECKING:
    import torch

# `listener(i, ids)`: prompt i's ids sampled at one step, as they are sampled
Listener = Callable[[int, list[int]], None]


class WireState(TypedDict):
    """A state dict as `to_wire` packs it."""

    # uint8 [bytes] every tensor's raw bytes, each at a 64-byte aligned offset
    raw: np.ndarray
    # per tensor: name, dtype, shape, byte offset in `raw`, byte count
    layout: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]


def derived_seed(*values: int) -> int:
    """One sampling seed drawn from a tuple of integers (negative ones allowed): the same tuple
    always gives the same seed, and neighbouring tuples unrelated ones."""
    return int(np.random.SeedSequence([value % 2**64 for value in values]).generate_state(1)[0])


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most new tokens per sequence."""
    temperature: float = 1.0
    """Softmax temperature; the reported log-probs are those of the tempered distribution."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sequence ends after it samples one of these (it is kept, and trainable)."""
    top_p: float = 1.0
    """Nucleus sampling; below 1 the log-probs are those of the truncated, renormalised
    distribution."""
    seed: int | None = None
    """Seed of this call's sampler; None draws from the engine's own generator."""
    row_seeds: tuple[int, ...] = ()
    """One seed per prompt, instead of `seed`: a row's draws then depend on its own seed alone,
    not on the prompts it shares the call with (the loopback server batches sessions' requests)."""


@dataclass
class Generation:
    # int32 [n] sampled ids, stop token included
    token_ids: np.ndarray
    # float32 [n] log-prob of each sampled id under the sampling distribution
    logprobs: np.ndarray
    # int32 [n] weight version that sampled each token (partial rollouts span several)
    versions: np.ndarray
    # "stop" | "length"
    finish_reason: str
    # "routed_experts": int16 [prompt + n, layers, k], a MoE policy's routes; "raw_logprobs":
    # float32 [n], each sampled id's log-prob before top_p's truncation (the torch engine's; vLLM
    # returns one logprobs_mode per engine, so none: the learner recomputes the gap's sampler part)
    extras: dict = field(default_factory=dict)


class Engine(Protocol):
    version: int

    def generate(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None = None,
        listener: Listener | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt (prompt: int32 [t]); `listener(i, ids)`, where given,
        gets prompt i's ids as they are sampled (the loopback server streams them)."""

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights and adopt `version` for every later token: at once when idle; while a
        `generate` is running, at its next token step if the engine swaps mid-generation (partial
        rollout), else before the next call."""


def to_wire(state_dict: dict[str, torch.Tensor]) -> WireState:
    """A state dict as Ray moves it fastest: every tensor's raw bytes in one numpy array (one
    buffer, put without pickling: the tiny policy's 1.7 MB in 1.1-1.5 ms, against 2.2-3.4 as 25
    arrays and ~3x that as pickled tensors), each tensor at a 64-byte aligned offset, with its name,
    dtype and shape."""
    import torch

    layout = []
    # torch.cat refuses an empty list
    pieces = [torch.zeros(0, dtype=torch.uint8)]
    offset = 0
    for name, tensor in state_dict.items():
        flat = tensor.detach().cpu().reshape(-1).view(torch.uint8)
        pad = -flat.numel() % 64
        pieces += [flat, torch.zeros(pad, dtype=torch.uint8)]
        layout.append((name, tensor.dtype, tuple(tensor.shape), offset, flat.numel()))
        offset += flat.numel() + pad
    return {"raw": torch.cat(pieces).numpy(), "layout": layout}


def from_wire(wire: WireState) -> dict[str, torch.Tensor]:
    """The state dict `to_wire` packed (tensors on the array's memory)."""
    import torch

    state_dict = {}
    # Ray hands out read-only arrays; the engines only read (copy) them
    with warnings.catch_warnings(action="ignore", category=UserWarning):
        for name, dtype, shape, offset, size in wire["layout"]:
            # each tensor on its own storage over its bytes: pickling one (vLLM's RPC) then sends
            # its bytes, not the whole buffer (frombuffer refuses an empty one)
            if size:
                count = size // dtype.itemsize
                tensor = torch.frombuffer(wire["raw"], dtype=dtype, count=count, offset=offset)
            else:
                tensor = torch.empty(0, dtype=dtype)
            state_dict[name] = tensor.reshape(shape)
    return state_dict
