"""One rollout batch as the learner takes it: the padded tensors built from Segment records
(token ids only), the token-identity audit, the batch's metrics and the rows the run store keeps.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from workbench.algo.losses import approx_kl, masked_mean
from workbench.invariants.token_identity import SEAL_REASONS
from workbench.invariants.version_gate import GateResult
from workbench.segment import Segment

# the version gate's per-sequence tensors the run store keeps (with its reasons)
GATE_COLUMNS = ("staleness", "seq_log_ratio", "geo_ratio", "kept", "tokens_masked")


@dataclass
class TrainBatch:
    """One rollout batch as the learner trains on it: its Segments' rows right-padded to the
    longest (`collate`), one field per tensor. Not `segment.Batch`, the Segments Ray moves."""

    token_ids: torch.Tensor  # [rows, tokens] int64, 0 after a row's end
    attention_mask: torch.Tensor  # [rows, tokens] int64, 1 on a row's tokens
    loss_mask: torch.Tensor  # [rows, tokens] bool, the sampled tokens
    behavior_logprob: torch.Tensor  # [rows, tokens] float32, the engine's log-probs
    behavior_version: torch.Tensor  # [rows, tokens] int32, the weight version that sampled, or -1
    # encoded images per row (vision-language policies)
    images: list[list[bytes]]  # [rows]
    rewards: torch.Tensor  # [rows] float32
    group_ids: torch.Tensor  # [rows]
    rollout_ids: torch.Tensor  # [rows]
    # the episode's turn of each token, -1 outside sampled turns
    turns: torch.Tensor  # [rows, tokens] int64
    # the rewards of each row's episode by turn, NaN after its last (a column at least, even in a
    # batch of no turns)
    turn_rewards: torch.Tensor  # [rows, most turns + 1] float32
    # the experts the rollout's router chose, -1 = unknown; None when no Segment recorded routes
    routed_experts: torch.Tensor | None = None  # [rows, tokens, layers, k] int16
    # the engine's log-probs before top_p's truncation, NaN where it gave none
    raw_logprob: torch.Tensor | None = None  # [rows, tokens] float32


@dataclass
class LossTargets:
    """What the policy loss compares a minibatch's live log-probs with (`Learner.loss`). The sft
    loss reads the mask alone."""

    # the PPO ratio's anchor (gate.anchor): π_old, or the policy that sampled
    old_logprob: torch.Tensor | None  # [rows, tokens]
    advantages: torch.Tensor | None  # [rows] or [rows, tokens]
    # the gate's loss mask, less the groups dynamic filtering drops
    loss_mask: torch.Tensor  # [rows, tokens] bool
    is_weight: torch.Tensor | None  # [rows, tokens] the gate's IS weights
    # the KL reference's log-probs, when `algo.kl_coef` > 0
    reference: torch.Tensor | None = None  # [rows, tokens]


@dataclass
class TokenLogprobs:
    """A policy forward's log-probs of a batch's own ids, and the entropies of the distributions
    they are taken from; they carry the graph where the forward did."""

    logprob: torch.Tensor  # [rows, tokens]
    entropy: torch.Tensor | None  # [rows, tokens]; None where the forward computed none


@dataclass
class OldLogprobs:
    """π_old of one batch, as `Learner.old_logprobs` computes it."""

    logprob: torch.Tensor  # [rows, tokens] detached
    # π_old's entropies; None where no forward computes them
    entropy: torch.Tensor | None  # [rows, tokens]
    # the route mismatches of a MoE policy (`replay_routes`: mismatch, known, live), else empty
    routing: dict[str, torch.Tensor]
    # the training forward itself, when it has π_old's value (it then runs once), else None
    live: TokenLogprobs | None = None


# a dataclass of per-row fields: `rows_of` picks rows of either
Rows = TypeVar("Rows", TrainBatch, LossTargets)


def collate(segments: list[Segment]) -> TrainBatch:
    """Right-padded batch tensors built from token ids only (text cannot reach the trainer)."""
    if not all(isinstance(s, Segment) for s in segments):
        raise TypeError("The learner trains on Segment records only (token ids), never on text.")
    lengths = np.array([len(s.token_ids) for s in segments])

    def padded(field: str, dtype: type, fill: float = 0) -> torch.Tensor:
        """[rows, tokens, ...] right-padded, filled in numpy (and where a Segment has None)."""
        values = [getattr(s, field) for s in segments]
        shape = next((value.shape[1:] for value in values if value is not None), ())
        out = np.full((len(segments), lengths.max(), *shape), fill, dtype=dtype)
        for row, value in enumerate(values):
            if value is not None:
                out[row, : lengths[row]] = value
        return torch.from_numpy(out)

    routed_experts = None
    if any(s.routed_experts is not None for s in segments):
        routed_experts = padded("routed_experts", np.int16, -1)
    return TrainBatch(
        token_ids=padded("token_ids", np.int64),
        attention_mask=torch.from_numpy(
            (np.arange(lengths.max()) < lengths[:, None]).astype(np.int64)
        ),
        loss_mask=padded("loss_mask", bool),
        behavior_logprob=padded("behavior_logprob", np.float32),
        behavior_version=padded("behavior_version", np.int32, -1),
        images=[s.images for s in segments],
        rewards=torch.tensor([s.reward for s in segments], dtype=torch.float32),
        group_ids=torch.tensor([s.group_id for s in segments]),
        rollout_ids=torch.tensor([s.rollout_id for s in segments]),
        turns=padded("turns", np.int64, -1),
        turn_rewards=pad_sequence(
            [torch.tensor([*s.turn_rewards, torch.nan]) for s in segments],
            batch_first=True,
            padding_value=torch.nan,
        ),
        routed_experts=routed_experts,
        raw_logprob=padded("raw_logprob", np.float32, np.nan),
    )


def audit_identity(segments: list[Segment], train_batch: TrainBatch) -> dict[str, float]:
    """Token identity, checked on every batch: the rollout's audit (mask-1 ids are the engine's
    sampled ids, in order) and the trainer's input ids equal to the segment's ids. A violation
    stops the run."""
    violations = sum(not s.audit.get("identity", True) for s in segments)
    ids = train_batch.token_ids.numpy()
    violations += sum(
        not np.array_equal(ids[row, : len(s.token_ids)], s.token_ids)
        for row, s in enumerate(segments)
    )
    if violations:
        raise RuntimeError(
            f"Token identity violated in {violations} segment(s): trainer input no longer equals "
            f"the sampled ids; this is a bug in the rollout path, please report it with the run "
            f"folder."
        )
    drift = [s.audit["retokenize_drift"] for s in segments if "retokenize_drift" in s.audit]
    metrics = {
        "identity/violations": 0.0,
        "identity/retokenize_drift": float(np.mean(drift)) if drift else 0.0,
    }
    # seals by reason: each starts a segment that prefills the whole history again
    for reason in SEAL_REASONS:
        metrics[f"identity/seals_{reason}"] = float(sum(s.seal_reason == reason for s in segments))
    # per episode: its segments, and the prompt tokens of those after its first (each renders a
    # history its earlier segment already held: prefilled again)
    episodes = max(len({s.rollout_id for s in segments}), 1)
    prefilled_again = sum(
        s.turn_spans[0][0] if s.turn_spans else len(s.token_ids) for s in segments if s.segment_idx
    )
    metrics["identity/segments_per_episode"] = len(segments) / episodes
    metrics["identity/prefilled_again_tokens"] = prefilled_again / episodes
    # tool calls the response template could not parse: their replies went to the agent as text
    metrics["identity/malformed_tool_calls"] = float(
        sum(row.get("malformed_tool_calls", 0) for s in segments for row in s.requests)
    )
    return metrics


def routing_table_rows(
    segments: list[Segment], routing: dict[str, torch.Tensor]
) -> list[dict[str, Any]]:
    """One row per (segment, MoE layer): tokens with a recorded route, how many the live router
    routed differently, their positions and, at each, the rollout's and the learner's experts."""
    rows = []
    for row, s in enumerate(segments):
        n = len(s.token_ids)
        for layer in range(routing["known"].shape[-1]):
            positions = torch.nonzero(routing["mismatch"][row, :n, layer]).flatten().tolist()
            rows.append(
                {
                    "rollout_id": s.rollout_id,
                    "segment_idx": s.segment_idx,
                    "layer": layer,
                    "tokens": int(routing["known"][row, :n, layer].sum()),
                    "mismatched": len(positions),
                    "positions": positions,
                    "rollout_experts": [s.routed_experts[p, layer].tolist() for p in positions],
                    "learner_experts": [routing["live"][row, p, layer].tolist() for p in positions],
                }
            )
    return rows


def batch_metrics(
    segments: list[Segment],
    train_batch: TrainBatch,
    old_logprob: torch.Tensor,
    entropy: torch.Tensor | None,
) -> dict[str, float]:
    """Rewards, sizes, the rollout-learner mismatch of one batch and, where the learner computed
    it, the mean entropy of its sampled tokens."""
    mask = train_batch.loss_mask
    sampled = mask.sum(-1).float()
    # only where the mask is set: a prompt's vision marker has a log-prob of -inf (-inf * 0 is NaN)
    abs_logprob_diff = torch.where(
        mask.bool(), (old_logprob - train_batch.behavior_logprob).abs(), 0.0
    )
    metrics = {
        "reward/mean": float(train_batch.rewards.mean()),
        "reward/std": float(train_batch.rewards.std(correction=0)),
        "rollout/segments": float(len(segments)),
        "rollout/tokens": float(train_batch.attention_mask.sum()),
        "rollout/sampled_tokens": float(sampled.sum()),
        "rollout/response_len": float(sampled.mean()),
        "mismatch/kl": float(approx_kl(train_batch.behavior_logprob, old_logprob, mask, "k3")),
        "mismatch/max_abs_logprob_diff": float(abs_logprob_diff.max()),
    }
    if entropy is not None:
        metrics["policy/entropy"] = float(masked_mean(entropy, mask))
    return metrics


def rows_of(batch: Rows, rows: torch.Tensor) -> Rows:
    """The rows `rows` of every tensor (or list) in `batch` (a field that is None stays None)."""
    picked = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if torch.is_tensor(value):
            picked[field.name] = value[rows]
        elif value is not None:
            picked[field.name] = [value[i] for i in rows.tolist()]
    return dataclasses.replace(batch, **picked)


def step_means(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each `loss/` metric averaged over the optimizer steps of one batch."""
    means = {}
    for key in steps[0]:
        means[f"loss/{key}"] = float(np.mean([step[key] for step in steps]))
    return means


def generate_seconds(worker_segments: tuple[list[Segment], ...]) -> float:
    """The slowest worker's generation time for this batch (the workers run in parallel)."""
    slowest = 0.0
    for segments in worker_segments:
        slowest = max(slowest, sum(s.generate_s for s in segments))
    return slowest


def store_rows(
    train_batch: TrainBatch,
    old_logprob: torch.Tensor,
    gate: GateResult,
    advantages: torch.Tensor,
    consumed_at: int,
    routing_rows: list[dict[str, Any]],
    entropy: torch.Tensor | None = None,
) -> dict[str, Any]:
    """What the run store keeps of one batch: per-token log-probs, IS weights, entropies and
    advantages (where computed), each segment's advantage (its sampled tokens' mean) and gate
    decision, the learner version that consumed it and the routing table."""
    # right-padded: each segment's tokens in order, segment after segment
    real = train_batch.attention_mask.bool()
    token_advantage = None
    if advantages.dim() == 2:
        token_advantage = [advantages[real].numpy()]
        advantages = masked_mean(advantages, train_batch.loss_mask, dim=-1)
    rows = {
        "train_logprob": [old_logprob[real].numpy()],
        "is_weight": [gate.token_weight[real].numpy()],
        "advantage": advantages.tolist(),
        "token_advantage": token_advantage,
        "learner_version": consumed_at,
        "routing": routing_rows,
        # the gate's per-sequence columns of the gate_decisions table
        "gate": {name: getattr(gate, name).tolist() for name in GATE_COLUMNS},
    }
    rows["gate"]["reason"] = gate.reason
    if entropy is not None:
        rows["entropy"] = [entropy[real].numpy()]
    return rows
