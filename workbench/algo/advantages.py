"""Advantage estimators: every rollout counts once in its group's baseline, however many rows it
spans.

A rollout split into several training rows (segments of one episode) shares one reward; the
estimators below dedup rows by `rollout_ids` before taking any mean or std, then give each row
its rollout's advantage.

`ADVANTAGES` maps each `algo.advantage` name to its estimator, registered with `@advantage`:
a new estimator is one function at the end of this module and its test in
tests/algo/test_advantages.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from workbench.algo.losses import masked_mean

if TYPE_CHECKING:
    from collections.abc import Callable

    from workbench.config import AlgoConfig
    from workbench.learner.batch import TrainBatch

    # (train batch, logprob, teacher_logprob or None, algo config) -> (advantages, metrics)
    Estimate = Callable[..., tuple[Tensor, dict[str, float]]]

# the estimators `compute_advantages` computes from rewards alone
REWARD_ESTIMATORS = ("reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo")


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator as the learner calls it, and what it needs."""

    estimate: Estimate
    """(train batch (`learner.batch.TrainBatch`), logprob [B, T], teacher_logprob [B, T] or None,
    algo config) ->
    (advantages [B] or [B, T], metrics)."""
    teacher: bool = False
    """It reads a frozen teacher's log-probs: the learner loads the teacher for it."""
    groups: bool = True
    """It compares the samples of one prompt, so it needs trainer.group_size of 2 or more."""


ADVANTAGES: dict[str, Estimator] = {}
"""algo.advantage -> its estimator, in the order of registration."""


def compute_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    estimator: str,
    rollout_ids: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Per-row advantage [N] from per-row rewards [N], prompt groups [N] and rollouts [N].

    reinforce: r.  reinforce_baseline: r - batch mean.  rloo: r - mean of the other rollouts
    of the group.  grpo: (r - group mean) / (unbiased group std + eps).  dr_grpo: r - group mean.
    A group holding a single rollout gets advantage 0 under rloo, grpo and dr_grpo.
    """
    if estimator not in REWARD_ESTIMATORS:
        choices = ", ".join(REWARD_ESTIMATORS)
        raise ValueError(f"Unknown advantage estimator {estimator!r}; choose one of {choices}.")
    n_rows = rewards.shape[0]
    if rollout_ids is None:
        rollout_ids = torch.arange(n_rows, device=rewards.device)
    rollouts, row_rollout = torch.unique(rollout_ids, return_inverse=True)  # [N] -> rollout index
    rows = torch.arange(n_rows, device=rewards.device)
    # [R] one representative row per rollout
    first_row = torch.full((len(rollouts),), n_rows, device=rewards.device).scatter_reduce(
        0, row_rollout, rows, reduce="amin"
    )
    reward = rewards[first_row]  # [R]
    group = group_ids[first_row]  # [R]
    if (rewards != reward[row_rollout]).any() or (group_ids != group[row_rollout]).any():
        raise ValueError("Rows sharing a rollout_id must share the same reward and group_id.")

    if estimator == "reinforce":
        return reward[row_rollout]
    if estimator == "reinforce_baseline":
        return (reward - reward.mean())[row_rollout]

    groups, rollout_group = torch.unique(group, return_inverse=True)  # [R] -> group index
    zeros = torch.zeros(len(groups), dtype=reward.dtype, device=reward.device)
    count = zeros.index_add(0, rollout_group, torch.ones_like(reward))[rollout_group]  # [R]
    total = zeros.index_add(0, rollout_group, reward)[rollout_group]  # [R]
    centered = reward - total / count  # [R]
    # [R] n - 1, kept >= 1 so singletons don't divide by 0
    others = (count - 1).clamp(min=1)

    if estimator == "dr_grpo":
        advantage = centered
    elif estimator == "rloo":
        advantage = reward - (total - reward) / others
    else:
        # grpo
        variance = zeros.index_add(0, rollout_group, centered**2)[rollout_group] / others
        advantage = centered / (variance.sqrt() + eps)
    return torch.where(count > 1, advantage, 0.0)[row_rollout]


def turn_advantages(
    turn_rewards: Tensor,
    turns: Tensor,
    group_ids: Tensor,
    rollout_ids: Tensor,
    discount: float,
) -> Tensor:
    """Per-token advantage [N, T] from the rewards of each row's episode by turn [N, K] (NaN
    after its last), the episode's turn of each token [N, T] (-1 outside sampled turns: advantage
    0), prompt groups [N] and rollouts [N].

    A turn's return is G_t = Σ_{k≥t} γ^(k−t)·r_k; its advantage is dr_grpo's of G_t among the
    group's episodes that reached turn t: G_t less their mean G_t, 0 where only one did. The
    baseline is taken at the same turn index, not from whole-episode returns: a later turn has
    fewer rewards ahead of it, and would otherwise look worse for that alone. With γ = 1 and a
    reward at the last turn only, episodes of one length get dr_grpo's advantage at every turn.
    """
    reached = turn_rewards.isfinite()  # [N, K]
    rewards = turn_rewards.nan_to_num()  # [N, K]
    returns = torch.zeros_like(rewards)  # [N, K]
    ahead = torch.zeros(len(rewards))  # [N] the return of the turn after
    for turn in reversed(range(rewards.shape[1])):
        ahead = rewards[:, turn] + discount * ahead
        returns[:, turn] = ahead
    advantages = torch.zeros_like(rewards)  # [N, K]
    for turn in range(rewards.shape[1]):
        rows = reached[:, turn]
        advantages[rows, turn] = compute_advantages(
            returns[rows, turn], group_ids[rows], "dr_grpo", rollout_ids[rows]
        )
    return torch.where(turns >= 0, advantages.gather(1, turns.clamp(min=0)), 0.0)


def distill_advantages(
    student_logprob: Tensor, teacher_logprob: Tensor, loss_mask: Tensor, coef: float = 1.0
) -> Tensor:
    """on_policy_distill: per-token advantage [B, T] = -coef·(log π_student − log π_teacher) on
    sampled tokens, 0 elsewhere.

    No scalar reward: each token the student sampled is pushed towards the teacher by how much
    more likely the student finds it; its mean over sampled tokens is the k1 estimate of reverse
    KL(student || teacher).
    """
    return torch.where(loss_mask.bool(), -coef * (student_logprob - teacher_logprob).detach(), 0.0)


def uniform_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Rows [N] (bool) whose prompt group has one reward for all its rows: no relative signal, so
    dynamic filtering drops them."""
    groups, group = torch.unique(group_ids, return_inverse=True)  # [N] -> group index
    low = torch.full((len(groups),), torch.inf, dtype=rewards.dtype).scatter_reduce(
        0, group, rewards, reduce="amin"
    )
    high = torch.full((len(groups),), -torch.inf, dtype=rewards.dtype).scatter_reduce(
        0, group, rewards, reduce="amax"
    )
    return (low == high)[group]


# ---- the registry: `algo.advantage=NAME` selects ADVANTAGES[NAME]


def advantage(
    name: str, teacher: bool = False, groups: bool = True
) -> Callable[[Estimate], Estimate]:
    """Register the decorated function as the estimator `algo.advantage=name` (see `Estimator`)."""

    def register(estimate: Estimate) -> Estimate:
        ADVANTAGES[name] = Estimator(estimate, teacher=teacher, groups=groups)
        return estimate

    return register


def _from_rewards(estimator: str) -> Estimate:
    """`compute_advantages(..., estimator)` as the learner calls it: one advantage per row."""

    def estimate(
        train_batch: TrainBatch, logprob: Tensor, teacher_logprob: None, algo: AlgoConfig
    ) -> tuple[Tensor, dict[str, float]]:
        advantages = compute_advantages(
            train_batch.rewards, train_batch.group_ids, estimator, train_batch.rollout_ids
        )
        return advantages, {}

    return estimate


for name in REWARD_ESTIMATORS:
    # reinforce and reinforce_baseline compare no two samples of a prompt
    advantage(name, groups=not name.startswith("reinforce"))(_from_rewards(name))


@advantage("on_policy_distill", teacher=True, groups=False)
def on_policy_distill(
    train_batch: TrainBatch, logprob: Tensor, teacher_logprob: Tensor, algo: AlgoConfig
) -> tuple[Tensor, dict[str, float]]:
    """Per token, from the frozen teacher; no reward. Its metric: k1 of KL(student || teacher)."""
    mask = train_batch.loss_mask
    advantages = distill_advantages(logprob, teacher_logprob, mask, algo.distill_coef)  # [B, T]
    distill_kl = masked_mean(logprob - teacher_logprob, mask)
    return advantages, {"distill/kl": float(distill_kl)}


@advantage("turn")
def turn(
    train_batch: TrainBatch, logprob: Tensor, teacher_logprob: None, algo: AlgoConfig
) -> tuple[Tensor, dict[str, float]]:
    """`turn_advantages` of the batch, γ = `algo.turn_discount`."""
    advantages = turn_advantages(
        train_batch.turn_rewards,
        train_batch.turns,
        train_batch.group_ids,
        train_batch.rollout_ids,
        algo.turn_discount,
    )
    return advantages, {}
