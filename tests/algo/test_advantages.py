"""Advantage estimators against hand-computed values, and the vectorised path against the loop."""

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from workbench.algo.advantages import (
    ADVANTAGES,
    REWARD_ESTIMATORS,
    compute_advantages,
    distill_advantages,
    turn_advantages,
    uniform_groups,
)

EPS = 1e-6
# Group 0 holds rewards 1, 0, 0.5; group 1 holds a single rollout with reward 2.
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 0, 1])


def _reference_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    estimator: str,
    rollout_ids: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Plain-loop `compute_advantages`: the reference its vectorised path is checked against."""
    rollouts = list(range(len(rewards))) if rollout_ids is None else rollout_ids.tolist()
    reward_of = {}
    group_of = {}
    for row, rollout in enumerate(rollouts):
        reward_of.setdefault(rollout, rewards[row].item())
        group_of.setdefault(rollout, group_ids[row].item())
    batch_mean = sum(reward_of.values()) / len(reward_of)
    advantage_of = {}
    for rollout, r in reward_of.items():
        group = [reward_of[o] for o in reward_of if group_of[o] == group_of[rollout]]
        n = len(group)
        mean = sum(group) / n
        if estimator == "reinforce":
            advantage_of[rollout] = r
        elif estimator == "reinforce_baseline":
            advantage_of[rollout] = r - batch_mean
        elif n == 1:
            advantage_of[rollout] = 0.0
        elif estimator == "rloo":
            advantage_of[rollout] = r - (sum(group) - r) / (n - 1)
        elif estimator == "grpo":
            std = (sum((x - mean) ** 2 for x in group) / (n - 1)) ** 0.5
            advantage_of[rollout] = (r - mean) / (std + eps)
        else:
            advantage_of[rollout] = r - mean
    return torch.tensor([advantage_of[o] for o in rollouts], dtype=rewards.dtype)


def test_reinforce_is_the_raw_reward():
    assert compute_advantages(REWARDS, GROUPS, "reinforce").tolist() == [1.0, 0.0, 0.5, 2.0]


def test_reinforce_baseline_subtracts_the_batch_mean():
    # batch mean = (1 + 0 + 0.5 + 2) / 4 = 0.875
    expected = [1 - 0.875, 0 - 0.875, 0.5 - 0.875, 2 - 0.875]
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "reinforce_baseline"),
        torch.tensor(expected, dtype=torch.float64),
    )


def test_rloo_subtracts_the_mean_of_the_other_rollouts_in_the_group():
    # row0: 1 - (0 + 0.5)/2 = 0.75; row1: 0 - (1 + 0.5)/2 = -0.75; row2: 0.5 - (1 + 0)/2 = 0
    # row3: alone in its group -> 0
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "rloo"),
        torch.tensor([0.75, -0.75, 0.0, 0.0], dtype=torch.float64),
    )


def test_grpo_divides_by_the_unbiased_group_std():
    # group 0: mean 0.5, deviations 0.5, -0.5, 0; var = (0.25 + 0.25 + 0) / (3 - 1) = 0.25, std 0.5
    expected = [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0]
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "grpo", eps=EPS),
        torch.tensor(expected, dtype=torch.float64),
    )


def test_dr_grpo_subtracts_the_group_mean_without_std():
    # group 0 mean 0.5: 1 - 0.5, 0 - 0.5, 0.5 - 0.5; row3 alone -> 2 - 2 = 0
    torch.testing.assert_close(
        compute_advantages(REWARDS, GROUPS, "dr_grpo"),
        torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64),
    )


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "dr_grpo"])
def test_group_of_one_gets_zero_advantage(estimator):
    advantage = compute_advantages(torch.tensor([3.0, -1.0]), torch.tensor([7, 8]), estimator)
    assert advantage.tolist() == [0.0, 0.0]


def test_grpo_on_a_group_with_equal_rewards_is_zero_not_nan():
    advantage = compute_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]), "grpo")
    assert advantage.tolist() == [0.0, 0.0, 0.0]


# Rollout 10 (reward 1) spans three rows, rollout 11 (reward 0) one row, both in group 0.
# Counting rows, the group mean would be 3/4; counting rollouts it is (1 + 0) / 2 = 0.5.
SEGMENT_REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
SEGMENT_GROUPS = torch.tensor([0, 0, 0, 0])
SEGMENT_ROLLOUTS = torch.tensor([10, 10, 10, 11])


@pytest.mark.parametrize(
    "estimator, rollout_10, rollout_11",
    [
        ("reinforce_baseline", 0.5, -0.5),  # batch mean over rollouts 0.5
        ("dr_grpo", 0.5, -0.5),  # group mean 0.5
        ("rloo", 1.0, -1.0),  # 1 - 0, 0 - 1
        ("grpo", 0.5 / (0.5**0.5 + EPS), -0.5 / (0.5**0.5 + EPS)),  # var = (0.25 + 0.25) / 1
    ],
)
def test_rollout_segments_count_once_in_the_baseline(estimator, rollout_10, rollout_11):
    advantage = compute_advantages(
        SEGMENT_REWARDS, SEGMENT_GROUPS, estimator, rollout_ids=SEGMENT_ROLLOUTS, eps=EPS
    )
    expected = torch.tensor([rollout_10] * 3 + [rollout_11], dtype=torch.float64)
    torch.testing.assert_close(advantage, expected)


def test_rows_of_one_rollout_with_different_rewards_are_refused():
    with pytest.raises(ValueError, match="same reward"):
        compute_advantages(
            torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "grpo", rollout_ids=torch.tensor([5, 5])
        )


def test_unknown_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="reinforce, reinforce_baseline, rloo, grpo, dr_grpo"):
        compute_advantages(REWARDS, GROUPS, "ppo")


@pytest.mark.parametrize("estimator", REWARD_ESTIMATORS)
@pytest.mark.parametrize("seed", range(5))
def test_vectorised_matches_reference_loop(estimator, seed):
    generator = torch.Generator().manual_seed(seed)
    n_rollouts = 40
    rollout_reward = torch.randint(0, 3, (n_rollouts,), generator=generator).double()  # ties likely
    rollout_group = torch.randint(0, 12, (n_rollouts,), generator=generator) * 7  # sparse ids
    rows = torch.randint(0, n_rollouts, (90,), generator=generator)  # rollouts spread over rows
    # ids are arbitrary labels, not indices
    rollout_ids = rows * 3 + 100
    args = (rollout_reward[rows], rollout_group[rows], estimator)
    torch.testing.assert_close(
        compute_advantages(*args, rollout_ids=rollout_ids),
        _reference_advantages(*args, rollout_ids=rollout_ids),
    )
    # without rollout_ids every row is its own rollout
    torch.testing.assert_close(compute_advantages(*args), _reference_advantages(*args))


def test_on_policy_distill_advantage_is_minus_coef_times_the_log_ratio_on_sampled_tokens():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[0, 1, 1]])
    # coef 2: token 1: -2 * (-2 + 1) = 2; token 2: -2 * (-0.5 + 3) = -5; token 0 not sampled -> 0
    assert distill_advantages(student, teacher, mask, coef=2.0).tolist() == [[0.0, 2.0, -5.0]]


def test_uniform_groups_marks_every_row_of_a_group_with_one_reward():
    # group 0 all 1 -> dropped; group 1 holds 0 and 0.5 -> kept; group 2 a single row -> dropped
    flags = uniform_groups(torch.tensor([1.0, 1.0, 0.0, 0.5, 3.0]), torch.tensor([0, 0, 1, 1, 2]))
    assert flags.tolist() == [True, True, False, False, True]


# ---------------------------------------------------------------------------- the registry


@pytest.mark.parametrize(
    "name, expected",
    [
        ("reinforce", [1.0, 0.0, 0.5, 2.0]),
        ("reinforce_baseline", [0.125, -0.875, -0.375, 1.125]),  # batch mean 0.875
        ("rloo", [0.75, -0.75, 0.0, 0.0]),
        ("dr_grpo", [0.5, -0.5, 0.0, 0.0]),
    ],
)
def test_registered_reward_estimators_read_the_batch_and_give_hand_values(name, expected):
    # the fields of a TrainBatch the estimator reads
    batch = SimpleNamespace(rewards=REWARDS, group_ids=GROUPS, rollout_ids=torch.arange(4))
    advantages, metrics = ADVANTAGES[name].estimate(batch, None, None, None)
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    assert metrics == {}


def test_registered_on_policy_distill_reads_the_teacher_and_reports_its_kl():
    batch = SimpleNamespace(loss_mask=torch.tensor([[0, 1, 1]]))
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0]])
    algo = SimpleNamespace(distill_coef=2.0)
    advantages, metrics = ADVANTAGES["on_policy_distill"].estimate(batch, student, teacher, algo)
    assert advantages.tolist() == [[0.0, 2.0, -5.0]]
    # k1 over the sampled tokens: ((-2 + 1) + (-0.5 + 3)) / 2 = 0.75
    assert metrics == {"distill/kl": pytest.approx(0.75)}


def test_the_registry_says_which_estimators_need_a_teacher_or_a_group():
    assert [name for name, e in ADVANTAGES.items() if e.teacher] == ["on_policy_distill"]
    assert [name for name, e in ADVANTAGES.items() if e.groups] == [
        "rloo",
        "grpo",
        "dr_grpo",
        "turn",
    ]


NAN = float("nan")


def test_turn_advantage_is_the_discounted_return_less_the_groups_mean_at_that_turn():
    # group 0: rollout 10 (rewards 1, 0, 2; its third turn in a second segment: row 2), rollout
    # 11 (0, 2), rollout 12 (3); group 1: rollout 13 (1, 1) alone. γ = 0.5:
    # returns 10: 1.5, 1, 2   11: 1, 2   12: 3   13: 1.5, 1
    # group 0's mean return at turn 0: (1.5 + 1 + 3) / 3 = 11/6, at turn 1: (1 + 2) / 2 = 1.5;
    # turn 2 only rollout 10 reached, and rollout 13 has no other: advantage 0
    turn_rewards = torch.tensor([[1, 0, 2], [1, 0, 2], [0, 2, NAN], [3, NAN, NAN], [1, 1, NAN]])
    turns = torch.tensor(
        [
            [-1, -1, 0, 0, -1, 1],
            [-1, -1, 2, 2, -1, -1],
            [-1, 0, -1, 1, 1, -1],
            [-1, 0, 0, -1, -1, -1],
            [-1, 0, -1, 1, -1, -1],
        ]
    )
    groups = torch.tensor([0, 0, 0, 0, 1])
    rollouts = torch.tensor([10, 10, 11, 12, 13])
    advantages = turn_advantages(turn_rewards, turns, groups, rollouts, discount=0.5)
    expected = [
        [0, 0, -1 / 3, -1 / 3, 0, -0.5],
        [0, 0, 0, 0, 0, 0],
        [0, -5 / 6, 0, 0.5, 0.5, 0],
        [0, 7 / 6, 7 / 6, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    torch.testing.assert_close(advantages, torch.tensor(expected))


def test_turn_advantage_with_no_discount_and_a_final_reward_is_dr_grpo_at_every_turn():
    # REWARDS at the second of two turns; each row's tokens: prompt, turn 0, turn 1
    batch = SimpleNamespace(
        turn_rewards=torch.stack([torch.zeros(4), REWARDS.float()], dim=1),
        turns=torch.tensor([[-1, 0, 1]]).repeat(4, 1),
        group_ids=GROUPS,
        rollout_ids=torch.arange(4),
    )
    algo = SimpleNamespace(turn_discount=1.0)
    advantages, metrics = ADVANTAGES["turn"].estimate(batch, None, None, algo)
    dr_grpo = [[0.0, a, a] for a in (0.5, -0.5, 0.0, 0.0)]
    torch.testing.assert_close(advantages, torch.tensor(dr_grpo))
    assert metrics == {}
