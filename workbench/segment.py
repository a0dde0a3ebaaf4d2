"""The Segment record: one token-exact piece of an episode, from rollout to learner to store.

`token_ids` *is* the trajectory: the learner builds its input from these ids and nothing else.
A segment holds no text the trainer could read; `display` is for people (the TUI, logs) only.
"""

import hashlib
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclass
class Segment:
    run_id: str
    rollout_id: int
    segment_idx: int
    group_id: int
    # int32 [T] the exact sequence the trainer sees
    token_ids: np.ndarray
    # uint8 [T] 1 where the policy sampled the token
    loss_mask: np.ndarray
    # float32 [T] log-prob under the sampling policy, 0 where mask is 0
    behavior_logprob: np.ndarray
    # int32 [T] weight version that sampled the token, -1 where mask is 0
    behavior_version: np.ndarray
    reward: float = 0.0
    # [start, end) of each sampled turn
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    # the episode's reward of each sampled turn, in order (turn_spans[j] is turn first_turn + j)
    turn_rewards: list[float] = field(default_factory=list)
    # the episode's index of this segment's first sampled turn
    first_turn: int = 0
    # the last turn's: stop | length
    finish_reason: str = ""
    # why the segment closed: end (episode over) | compaction | ...
    seal_reason: str = "end"
    # int16 [T, layers, top_k], -1 where unknown
    routed_experts: np.ndarray | None = None
    # float32 [T] the sampled ids' log-probs before the engine's top_p truncation (the torch
    # engine's; the off-policy gap's sampler part is this less behavior_logprob), NaN where unknown
    raw_logprob: np.ndarray | None = None
    # encoded images, in the order of their placeholder runs in token_ids
    images: list[bytes] = field(default_factory=list)
    # for people only: prompt text, env info
    display: dict = field(default_factory=dict)
    # token-identity audit: identity (bool), retokenize_drift (bool)
    audit: dict = field(default_factory=dict)
    # loopback requests of the episode (on its first segment)
    requests: list[dict] = field(default_factory=list)
    # seconds the worker's engine spent generating the call this segment came from (on the call's
    # first segment, else 0): the learner's perf/generate_s, a timing, not part of the audit
    generate_s: float = 0.0

    def __post_init__(self) -> None:
        for name, dtype in {
            "token_ids": np.int32,
            "loss_mask": np.uint8,
            "behavior_logprob": np.float32,
            "behavior_version": np.int32,
        }.items():
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != 1:
                raise TypeError(
                    f"Segment.{name} must be a 1-d numpy {np.dtype(dtype).name} array, "
                    f"got {type(value).__name__}: trainer input is built from token ids only."
                )
            if len(value) != len(self.token_ids):
                raise ValueError(
                    f"Segment.{name} has {len(value)} entries for {len(self.token_ids)} tokens."
                )

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def turns(self) -> np.ndarray:
        """int32 [T]: the episode's index of each token's sampled turn, -1 outside them."""
        turns = np.full(len(self.token_ids), -1, dtype=np.int32)
        for turn, (start, end) in enumerate(self.turn_spans, self.first_turn):
            turns[start:end] = turn
        return turns

    def version_range(self) -> tuple[int, int]:
        """(oldest, newest) weight version among sampled tokens; (-1, -1) when none was sampled."""
        sampled = self.behavior_version[self.loss_mask.astype(bool)]
        return (int(sampled.min()), int(sampled.max())) if len(sampled) else (-1, -1)


class Batch(list[Segment]):
    """A worker's Segments as Ray moves them: one in-band pickle, not one buffer per array.

    Ray puts 64 tiny-policy segments in 3.2 ms and gets them in 1.4, as a Batch in 1.0 and 0.6
    (bench/README.md).
    """

    def __reduce__(self) -> "tuple[Callable[[bytes], Batch], tuple[bytes]]":
        try:
            blob = pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError):
            # a plugin's info holds a lambda, a local class, ...
            from ray import cloudpickle

            blob = cloudpickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)
        return _unbatch, (blob,)


def _unbatch(blob: bytes) -> Batch:
    return Batch(pickle.loads(blob))


def image_name(image: bytes) -> str:
    """The run store's file name of an encoded image (`runs/<id>/images/<name>`): a content hash."""
    return hashlib.sha256(image).hexdigest()[:16] + ".png"
