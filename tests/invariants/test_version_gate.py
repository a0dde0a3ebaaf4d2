"""Version gate: staleness and ratio decisions per sequence, IS weights per token, against
hand-computed values.

Log-probs are built so that e^δ is a round number: behavior log-prob −2 everywhere and
train log-prob −2 + ln(ratio), so δ = ln(ratio) (ratios 0.25, 0.5, 1, 1.5, 2, 3 ...).
"""

import itertools
import math

import pytest
import torch

from workbench.algo.losses import policy_gradient_loss
from workbench.config import ConfigError, compose_config
from workbench.invariants.version_gate import (
    DENOMINATORS,
    LEVELS,
    MODES,
    gate_metrics,
    version_gate,
)

# every behavior log-prob; train log-prob = BEHAVIOR + ln(ratio)
BEHAVIOR = -2.0
# ratio at an unsampled position: it would flip every decision if the gate read it
X = 100.0
BAND = (0.5, 2.0)
LEVEL_MODES = [
    ("off", "mask"),
    ("token", "mask"),
    ("token", "clip"),
    ("token", "trunc"),
    ("seq", "mask"),
    ("geo", "mask"),
]


def logprobs(ratios):
    """(behavior_logprob, train_logprob) [B, T] with e^(train − behavior) = ratios."""
    ratio = torch.tensor(ratios, dtype=torch.float32)  # [B, T]
    behavior_logprob = torch.full_like(ratio, BEHAVIOR)
    return behavior_logprob, behavior_logprob + ratio.log()


def gate(ratios, mask, versions=None, learner_version=0, **options):
    """version_gate on a batch given by its per-token ratios; versions default to on-policy
    (−1 unsampled)."""
    behavior_logprob, train_logprob = logprobs(ratios)
    loss_mask = torch.tensor(mask, dtype=torch.bool)  # [B, T]
    if versions is None:
        behavior_version = torch.where(loss_mask, learner_version, -1)  # [B, T]
    else:
        behavior_version = torch.tensor(versions, dtype=torch.long)
    return version_gate(
        behavior_logprob, train_logprob, loss_mask, behavior_version, learner_version, **options
    )


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_unknown_level_mode_or_denominator_is_refused():
    for options in ({"level": "sequence"}, {"mode": "clamp"}, {"denominator": "sampled"}):
        with pytest.raises(ValueError, match="level/mode/denominator"):
            gate([[1.0]], [[1]], **options)


# ---------------------------------------------------------------------- off and token level


def test_off_gives_weight_one_to_every_sampled_token_whatever_its_ratio():
    result = gate([[0.25, 1.0, 3.0], [1000.0, X, X]], [[1, 1, 1], [1, 0, 0]], level="off")
    assert torch.equal(result.token_weight, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    assert result.kept.tolist() == [True, True]
    assert result.reason == ["ok", "ok"]
    assert result.tokens_masked.tolist() == [0, 0]


def test_token_mask_zeroes_tokens_outside_the_band_and_keeps_the_sequence():
    # band (0.5, 2): 0.25 below, 1 inside, 3 above -> weights 0, 1, 0; 1.5 inside -> 1.5
    result = gate(
        [[0.25, 1.0, 3.0], [1.5, X, X]],
        [[1, 1, 1], [1, 0, 0]],
        level="token",
        mode="mask",
        band=BAND,
    )
    close(result.token_weight, [[0.0, 1.0, 0.0], [1.5, 0.0, 0.0]])
    assert result.kept.tolist() == [True, True]
    assert result.reason == ["ok", "ok"]
    assert result.tokens_masked.tolist() == [2, 0]


def test_token_clip_clamps_weights_into_the_band_from_both_sides():
    # 0.25 -> 0.5, 1 -> 1, 3 -> 2; 1.5 stays
    result = gate(
        [[0.25, 1.0, 3.0], [1.5, X, X]],
        [[1, 1, 1], [1, 0, 0]],
        level="token",
        mode="clip",
        band=BAND,
    )
    close(result.token_weight, [[0.5, 1.0, 2.0], [1.5, 0.0, 0.0]])
    assert result.tokens_masked.tolist() == [0, 0]
    assert result.kept.tolist() == [True, True]


def test_token_trunc_clamps_weights_from_above_only():
    # 0.25 stays 0.25 (no lower clamp), 1 -> 1, 3 -> 2
    result = gate(
        [[0.25, 1.0, 3.0], [1.5, X, X]],
        [[1, 1, 1], [1, 0, 0]],
        level="token",
        mode="trunc",
        band=BAND,
    )
    close(result.token_weight, [[0.25, 1.0, 2.0], [1.5, 0.0, 0.0]])
    assert result.tokens_masked.tolist() == [0, 0]
    assert result.kept.tolist() == [True, True]


@pytest.mark.parametrize("mode", MODES)
def test_anchor_behavior_leaves_the_correction_to_the_loss_and_weights_only_keep_or_drop(mode):
    # the loss's ratio to the behavior log-probs carries e^δ: a kept token weighs 1, whatever its
    # ratio; mask mode still drops 0.25 and 3 (outside the band)
    result = gate(
        [[0.25, 1.0, 3.0], [1.5, X, X]],
        [[1, 1, 1], [1, 0, 0]],
        level="token",
        mode=mode,
        band=BAND,
        anchor="behavior",
    )
    kept = [0.0, 1.0, 0.0] if mode == "mask" else [1.0, 1.0, 1.0]
    close(result.token_weight, [kept, [1.0, 0.0, 0.0]])
    # under a geo filter a dropped sequence still weighs 0 and the token cap no longer applies
    geo = gate(SEQ_RATIOS, SEQ_MASK, level="geo", band=BAND, token_cap=1.5, anchor="behavior")
    assert geo.reason == ["ok", "ok", "ok", "ratio_low"]
    close(geo.token_weight, [[1.0, 1.0, 1.0, 0.0], [1.0] * 4, [1.0] * 4, [0.0] * 4])


def test_anchor_defaults_to_behavior_when_asynchronous_and_old_on_policy():
    assert compose_config(["trainer.async_depth=1", "gate=token"]).gate.anchor == "behavior"
    assert compose_config([]).gate.anchor == "old"
    with pytest.warns(UserWarning, match="gate.anchor=old with trainer.async_depth > 0 lost"):
        compose_config(["trainer.async_depth=1", "gate=token", "gate.anchor=old"])


# ---------------------------------------------------------------------- seq and geo level

# row 0: 2·2·1 = 4 (seq high);          geo 4^(1/3) ≈ 1.587 (ok)   -- unsampled X ignored
# row 1: 0.5·0.5·0.5·3 = 0.375 (low);   geo 0.375^(1/4) ≈ 0.783 (ok)
# row 2: 3·0.5·1·1 = 1.5 (ok);          geo 1.5^(1/4) ≈ 1.107 (ok)
# row 3: 0.25·0.25 = 1/16 (low);        geo 0.25 (low)              -- two unsampled X ignored
SEQ_RATIOS = [[2.0, 2.0, 1.0, X], [0.5, 0.5, 0.5, 3.0], [3.0, 0.5, 1.0, 1.0], [0.25, 0.25, X, X]]
SEQ_MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.parametrize("mode", MODES)
def test_seq_filter_drops_on_the_product_of_ratios_and_keeps_per_token_weights(mode):
    result = gate(SEQ_RATIOS, SEQ_MASK, level="seq", mode=mode, band=BAND)
    assert result.reason == ["ratio_high", "ratio_low", "ok", "ratio_low"]
    assert result.kept.tolist() == [False, False, True, False]
    # dropped rows weigh 0; the kept row carries e^δ per token, not the sequence ratio
    close(result.token_weight, [[0, 0, 0, 0], [0, 0, 0, 0], [3.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]])
    close(result.seq_log_ratio, [math.log(4), math.log(0.375), math.log(1.5), math.log(1 / 16)])
    close(result.geo_ratio, [4 ** (1 / 3), 0.375 ** (1 / 4), 1.5 ** (1 / 4), 0.25])
    assert result.tokens_masked.tolist() == [3, 4, 0, 2]


def test_geo_filter_drops_on_the_geometric_mean_ratio():
    result = gate(SEQ_RATIOS, SEQ_MASK, level="geo", band=BAND)
    assert result.reason == ["ok", "ok", "ok", "ratio_low"]
    assert result.kept.tolist() == [True, True, True, False]
    close(
        result.token_weight,
        [[2.0, 2.0, 1.0, 0.0], [0.5, 0.5, 0.5, 3.0], [3.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]],
    )
    assert result.tokens_masked.tolist() == [0, 0, 0, 2]


def test_token_cap_truncates_kept_weights_without_changing_the_decision():
    # cap 2: the 3s become 2, everything else is already ≤ 2
    seq = gate(SEQ_RATIOS, SEQ_MASK, level="seq", band=BAND, token_cap=2.0)
    assert seq.reason == ["ratio_high", "ratio_low", "ok", "ratio_low"]
    close(seq.token_weight, [[0, 0, 0, 0], [0, 0, 0, 0], [2.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]])
    geo = gate(SEQ_RATIOS, SEQ_MASK, level="geo", band=BAND, token_cap=2.0)
    assert geo.reason == ["ok", "ok", "ok", "ratio_low"]
    close(
        geo.token_weight,
        [[2.0, 2.0, 1.0, 0.0], [0.5, 0.5, 0.5, 2.0], [2.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]],
    )


# ---------------------------------------------------------------------- staleness

ONES = [[1.0, 1.0, 1.0, 1.0]] * 4


def test_staleness_counts_from_the_oldest_sampled_token_and_ignores_unsampled_ones():
    versions = [
        # oldest sampled 3 -> 6 − 3 = 3 (the −1 would give 7)
        [5, 3, 4, -1],
        # 6 − 6 = 0
        [6, 6, -1, -1],
        # version 1 sits on an unsampled (prompt) token -> 0, not 5
        [1, 6, 6, 6],
        # nothing sampled -> 0
        [-1, -1, -1, -1],
    ]
    mask = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]]
    result = gate(ONES, mask, versions, learner_version=6)
    assert result.staleness.tolist() == [3, 0, 0, 0]


@pytest.mark.parametrize("level", LEVELS)
def test_max_staleness_drops_sequences_strictly_older_than_it_at_every_level(level):
    # staleness 6 − 3 = 3 > 2 -> stale; 6 − 4 = 2 is not more than 2 -> kept
    versions = [[6, 3, 5], [4, 6, 6], [6, 6, -1]]
    mask = [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
    result = gate([[1.0] * 3] * 3, mask, versions, learner_version=6, level=level, max_staleness=2)
    assert result.staleness.tolist() == [3, 2, 0]
    assert result.reason == ["stale", "ok", "ok"]
    assert result.kept.tolist() == [False, True, True]
    close(result.token_weight, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert result.tokens_masked.tolist() == [3, 0, 0]


def test_stale_takes_precedence_over_a_ratio_reason():
    # products 3 (high), 0.25 (low), 3, 1
    ratios = [[3.0, 1.0], [0.25, 1.0], [3.0, 1.0], [1.0, 1.0]]
    versions = [[3, 6], [2, 6], [6, 6], [4, 5]]  # staleness 3, 4, 0, 2
    result = gate(
        ratios, [[1, 1]] * 4, versions, learner_version=6, level="seq", band=BAND, max_staleness=2
    )
    assert result.reason == ["stale", "stale", "ratio_high", "ok"]
    assert result.kept.tolist() == [False, False, False, True]


def test_max_staleness_none_never_drops():
    # 100 versions behind, still kept with full weight; the staleness is still reported
    result = gate(
        [[1.0, 1.0]], [[1, 1]], [[0, 3]], learner_version=100, level="token", max_staleness=None
    )
    assert result.staleness.tolist() == [100]
    assert result.reason == ["ok"]
    close(result.token_weight, [[1.0, 1.0]])


# ---------------------------------------------------------------------- empty masks and extremes


@pytest.mark.parametrize(
    ("level", "mode", "denominator"),
    [(level, mode, denominator) for level, mode in LEVEL_MODES for denominator in DENOMINATORS],
)
def test_sequence_with_no_sampled_token_is_kept_with_weight_zero_and_no_nan(
    level, mode, denominator
):
    # row 1: padding, never sampled
    behavior_logprob = torch.tensor([[-2.0, -2.0], [-math.inf, -math.inf]])
    train_logprob = torch.tensor([[-2.0 + math.log(1.5), -2.0], [0.0, -math.inf]])
    loss_mask = torch.tensor([[True, True], [False, False]])
    behavior_version = torch.tensor([[7, 7], [-1, -1]])
    # max_staleness 0: the empty row must read staleness 0, not 7 − (−1) = 8 nor 7 − int-max
    result = version_gate(
        behavior_logprob,
        train_logprob,
        loss_mask,
        behavior_version,
        7,
        level=level,
        mode=mode,
        band=BAND,
        max_staleness=0,
        denominator=denominator,
    )
    assert result.staleness.tolist() == [0, 0]
    assert result.kept.tolist() == [True, True]
    assert result.reason == ["ok", "ok"]
    assert result.token_weight[1].tolist() == [0.0, 0.0]
    assert result.loss_mask[1].tolist() == [False, False]
    assert result.tokens_masked.tolist() == [0, 0]
    assert result.seq_log_ratio[1].item() == 0.0 and result.geo_ratio[1].item() == 1.0
    for tensor in (result.token_weight, result.seq_log_ratio, result.geo_ratio):
        assert torch.isfinite(tensor).all()
    assert all(math.isfinite(value) for value in gate_metrics(result, loss_mask).values())


def test_gate_metrics_of_a_batch_with_no_sampled_token_are_zero():
    loss_mask = torch.zeros(2, 3, dtype=torch.bool)
    result = gate(
        [[X] * 3] * 2,
        loss_mask.tolist(),
        [[-1] * 3] * 2,
        learner_version=4,
        level="seq",
        max_staleness=0,
    )
    assert gate_metrics(result, loss_mask) == {
        "gate/kept_frac": 1.0,
        "gate/stale_frac": 0.0,
        "gate/is_filter_ratio": 0.0,
        "gate/weight_mean": 0.0,
        "async/mean_staleness": 0.0,
    }


def test_extreme_log_ratios_are_clamped_to_20_before_exp_and_stay_finite():
    # δ per row: [+1000, −1000], [+1000, +1000], [−1000, −1000]; each δ is clamped to ±20 first
    behavior_logprob = torch.tensor([[-1000.0, -1.0], [-1000.0, -1000.0], [-1.0, -1.0]])
    train_logprob = torch.tensor([[0.0, -1001.0], [0.0, 0.0], [-1001.0, -1001.0]])
    loss_mask = torch.ones(3, 2, dtype=torch.bool)
    behavior_version = torch.zeros(3, 2, dtype=torch.long)
    e20 = math.exp(20)  # ≈ 4.85e8
    e_20 = math.exp(-20)  # ≈ 2.06e-9

    def run(level, mode="mask", band=BAND):
        return version_gate(
            behavior_logprob,
            train_logprob,
            loss_mask,
            behavior_version,
            0,
            level=level,
            mode=mode,
            band=band,
        )

    for level, mode in LEVEL_MODES:
        result = run(level, mode)
        for tensor in (result.token_weight, result.seq_log_ratio, result.geo_ratio):
            assert torch.isfinite(tensor).all(), (level, mode)
    # seq: Σδ = 20 − 20 = 0 -> ratio 1 -> kept with weights e^20, e^−20; ±40 -> high / low
    seq = run("seq")
    close(seq.seq_log_ratio, [0.0, 40.0, -40.0])
    close(seq.geo_ratio, [1.0, e20, e_20])
    assert seq.reason == ["ok", "ratio_high", "ratio_low"]
    close(seq.token_weight, [[e20, e_20], [0.0, 0.0], [0.0, 0.0]])
    # seq with an unbounded band: Σδ = 40 is clamped to 20 before exp, so the decision sees e^20,
    # not inf
    assert run("seq", band=(0.0, math.inf)).kept.tolist() == [True, True, True]
    close(run("token", "trunc").token_weight, [[2.0, e_20], [2.0, 2.0], [e_20, e_20]])
    close(run("token", "clip").token_weight, [[2.0, 0.5], [2.0, 2.0], [0.5, 0.5]])
    close(run("token", "mask").token_weight, [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])


# ---------------------------------------------------------------------- denominator and the loss

# token/mask, band (0.5, 2): row 0 ratios 1, 3, 1.5 -> weights 1, 0, 1.5; row 1 ratios 0.25, 1
# -> 0, 1
TOKEN_RATIOS = [[1.0, 3.0, 1.5], [0.25, 1.0, X]]
TOKEN_MASK = [[1, 1, 1], [1, 1, 0]]


def test_denominator_all_keeps_the_input_mask_and_kept_keeps_only_surviving_tokens():
    for_all = gate(
        TOKEN_RATIOS, TOKEN_MASK, level="token", mode="mask", band=BAND, denominator="all"
    )
    assert for_all.loss_mask.tolist() == [[True, True, True], [True, True, False]]
    for_kept = gate(
        TOKEN_RATIOS, TOKEN_MASK, level="token", mode="mask", band=BAND, denominator="kept"
    )
    assert for_kept.loss_mask.tolist() == [[True, False, True], [False, True, False]]
    # the denominator changes no weight
    assert torch.equal(for_all.token_weight, for_kept.token_weight)
    # a dropped sequence leaves the `kept` mask entirely (seq: row 0 product 3 > 2)
    seq = gate(
        [[3.0, 1.0], [1.0, 1.0]], [[1, 1], [1, 1]], level="seq", band=BAND, denominator="kept"
    )
    assert seq.loss_mask.tolist() == [[False, False], [True, True]]


def test_token_mean_loss_divides_by_all_sampled_tokens_or_by_kept_tokens():
    # logprob == old_logprob -> PPO ratio 1, no clipping: per-token loss = −A · w
    # row 0 (A = 2): −2·(1 + 0 + 1.5) = −5;  row 1 (A = −1): +1·(0 + 1) = +1;  sum −4
    # all: 5 sampled tokens -> −4/5 = −0.8;  kept: 3 surviving tokens -> −4/3
    logprob = torch.zeros(2, 3)
    advantages = torch.tensor([2.0, -1.0])
    expected = {"all": -0.8, "kept": -4 / 3}
    for denominator, value in expected.items():
        result = gate(
            TOKEN_RATIOS, TOKEN_MASK, level="token", mode="mask", band=BAND, denominator=denominator
        )
        loss, _ = policy_gradient_loss(
            logprob, logprob, advantages, result.loss_mask, is_weight=result.token_weight
        )
        assert loss.item() == pytest.approx(value, rel=1e-6), denominator


def test_mostly_rejected_batch_moves_the_policy_less_under_denominator_all():
    # seq: row 0 (3 tokens, product 3) dropped, row 1 (1 sampled token, ratio 1) kept; A = 1 for
    # both
    # all: −1·1 / 4 sampled = −0.25;  kept: −1·1 / 1 surviving = −1 (the survivor is amplified 4×)
    logprob = torch.zeros(2, 3)
    advantages = torch.tensor([1.0, 1.0])
    expected = {"all": -0.25, "kept": -1.0}
    for denominator, value in expected.items():
        result = gate(
            [[3.0, 1.0, 1.0], [1.0, X, X]],
            [[1, 1, 1], [1, 0, 0]],
            level="seq",
            band=BAND,
            denominator=denominator,
        )
        loss, _ = policy_gradient_loss(
            logprob, logprob, advantages, result.loss_mask, is_weight=result.token_weight
        )
        assert loss.item() == pytest.approx(value, rel=1e-6), denominator


# ---------------------------------------------------------------------- metrics


def test_gate_metrics_on_a_hand_case():
    ratios = [[1.0, 3.0, 1.0], [1.0, 1.0, X], [0.25, 1.0, 1.0], [X, X, X]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]]
    versions = [
        # staleness 0; ratio 3 masked -> 1 token filtered, weights 1 + 1
        [5, 5, 5],
        # staleness 2 > 1 -> stale, both sampled tokens filtered
        [3, 4, -1],
        # staleness 1 (not > 1, kept); ratio 0.25 masked -> 1 filtered, weights 1 + 1
        [4, 5, 5],
        # nothing sampled: staleness 0, kept
        [-1, -1, -1],
    ]
    result = gate(
        ratios,
        mask,
        versions,
        learner_version=5,
        level="token",
        mode="mask",
        band=BAND,
        max_staleness=1,
    )
    assert result.tokens_masked.tolist() == [1, 2, 1, 0]
    metrics = gate_metrics(result, torch.tensor(mask))
    assert metrics["gate/kept_frac"] == pytest.approx(3 / 4)  # rows 0, 2, 3
    assert metrics["gate/stale_frac"] == pytest.approx(1 / 4)  # row 1
    # (1 + 2 + 1 + 0) filtered / 8 sampled
    assert metrics["gate/is_filter_ratio"] == pytest.approx(4 / 8)
    assert metrics["gate/weight_mean"] == pytest.approx(4 / 8)  # (2 + 0 + 2 + 0) weight / 8 sampled
    assert metrics["async/mean_staleness"] == pytest.approx(3 / 4)  # (0 + 2 + 1 + 0) / 4


# ---------------------------------------------------------------------- on-policy identity


@pytest.mark.parametrize(
    ("level", "mode", "band"),
    [
        (level, mode, band)
        for (level, mode), band in itertools.product(LEVEL_MODES, [(0.5, 2.0), (1.0, 1.0)])
    ],
)
def test_on_policy_batch_passes_every_level_with_weight_exactly_one(level, mode, band):
    # train == behavior -> δ = 0 exactly -> e^0 = 1, inside even the degenerate band [1, 1]
    behavior_logprob = torch.tensor([[-0.5, -1.25, -3.0], [-0.1, -2.0, -7.5]])
    loss_mask = torch.tensor([[True, True, False], [True, True, True]])
    behavior_version = torch.where(loss_mask, 4, -1)
    for denominator in DENOMINATORS:
        result = version_gate(
            behavior_logprob,
            behavior_logprob.clone(),
            loss_mask,
            behavior_version,
            4,
            level=level,
            mode=mode,
            band=band,
            max_staleness=0,
            denominator=denominator,
        )
        assert result.kept.tolist() == [True, True]
        assert result.reason == ["ok", "ok"]
        assert torch.equal(result.token_weight, loss_mask.float())
        assert torch.equal(result.loss_mask, loss_mask)
        assert result.staleness.tolist() == [0, 0]
        assert result.tokens_masked.tolist() == [0, 0]


# ---------------------------------------------------------------------- corrections that compose


def test_token_band_masks_kept_sequences_tokens_under_a_seq_filter():
    # row 2 (3, 0.5, 1, 1) is kept by seq; its 3 lies outside the token band [0.5, 2] -> weight 0
    result = gate(SEQ_RATIOS, SEQ_MASK, level="seq", band=BAND, token_band=(0.5, 2.0))
    assert result.reason == ["ratio_high", "ratio_low", "ok", "ratio_low"]
    close(result.token_weight, [[0, 0, 0, 0], [0, 0, 0, 0], [0.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]])
    assert result.tokens_masked.tolist() == [3, 4, 1, 2]


def test_token_band_and_token_cap_compose_with_the_geo_filter():
    # geo keeps rows 0-2 (row 3: ratio_low); token band [0.5, 2] zeroes row 1's 3 and row 2's 3;
    # the cap 1.5 truncates row 0's 2s; the decisions stay geo's
    result = gate(
        SEQ_RATIOS, SEQ_MASK, level="geo", band=BAND, token_band=(0.5, 2.0), token_cap=1.5
    )
    assert result.reason == ["ok", "ok", "ok", "ratio_low"]
    close(
        result.token_weight,
        [[1.5, 1.5, 1.0, 0.0], [0.5, 0.5, 0.5, 0.0], [0.0, 0.5, 1.0, 1.0], [0, 0, 0, 0]],
    )
    assert result.tokens_masked.tolist() == [0, 1, 1, 2]
    # denominator kept: the masked tokens leave the token-mean denominator too
    kept = gate(
        SEQ_RATIOS, SEQ_MASK, level="geo", band=BAND, token_band=(0.5, 2.0), denominator="kept"
    )
    assert kept.loss_mask.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]]


def test_veto_drops_sequences_holding_a_token_beyond_the_bound_on_either_side():
    # veto 10: 20 > 10 and 0.05 < 1/10 veto rows 0 and 1; row 2's 5 and 0.2 lie within
    # [0.1, 10] (trunc makes them 2 and 0.2); row 3's unsampled X is not read
    result = gate(
        [[1.0, 20.0], [1.0, 0.05], [5.0, 0.2], [1.0, X]],
        [[1, 1], [1, 1], [1, 1], [1, 0]],
        level="token",
        mode="trunc",
        band=BAND,
        veto=10.0,
    )
    assert result.reason == ["veto", "veto", "ok", "ok"]
    assert result.kept.tolist() == [False, False, True, True]
    close(result.token_weight, [[0.0, 0.0], [0.0, 0.0], [2.0, 0.2], [1.0, 0.0]])
    assert result.tokens_masked.tolist() == [2, 2, 0, 0]


@pytest.mark.parametrize("level", LEVELS)
def test_one_catastrophic_token_is_vetoed_at_every_level_though_the_geo_mean_passes(level):
    # seven 1s and one 100: geo 100^(1/8) ≈ 1.78 lies inside the band, the token does not
    ratios = [[1.0] * 7 + [100.0]]
    assert gate(ratios, [[1] * 8], level="geo", band=BAND).reason == ["ok"]
    result = gate(ratios, [[1] * 8], level=level, band=BAND, veto=50.0)
    assert result.reason == ["veto"]
    assert result.token_weight.sum().item() == 0.0 and result.tokens_masked.tolist() == [8]


def test_veto_reads_the_ratio_before_the_clamp_at_20():
    # δ = 30: clamped to 20 it would lie within e^25, unclamped it does not
    result = gate(
        [[math.exp(30.0)]], [[1]], level="token", mode="clip", band=BAND, veto=math.exp(25)
    )
    assert result.reason == ["veto"]


def test_stale_takes_precedence_over_veto_and_veto_over_a_ratio_reason():
    # row 0: stale and vetoed -> stale; row 1: seq ratio 100 (high) and vetoed -> veto
    result = gate(
        [[100.0], [100.0]],
        [[1], [1]],
        [[3], [5]],
        learner_version=5,
        level="seq",
        band=BAND,
        max_staleness=1,
        veto=50.0,
    )
    assert result.reason == ["stale", "veto"]


def test_bypass_passes_an_on_policy_batch_and_refuses_a_stale_one_in_one_sentence():
    # bypass: the learner passes the behavior log-probs as π_old, so δ = 0 and every weight is 1
    on_policy = gate([[1.0, 1.0], [1.0, X]], [[1, 1], [1, 0]], level="geo", band=BAND, bypass=True)
    assert on_policy.reason == ["ok", "ok"]
    close(on_policy.token_weight, [[1.0, 1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match=r"^gate\.bypass .* 1 sequence\(s\) .*bypass=false\.$"):
        gate([[1.0], [1.0]], [[1], [1]], [[4], [5]], learner_version=5, bypass=True)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["gate.bypass=true", "gate.level=token", "trainer.async_depth=1"], "gate.bypass takes"),
        (["gate.bypass=true", "gate.level=token", "rollout.partial=true"], "gate.bypass takes"),
        (["gate.bypass=true", "engine.top_p=0.9"], "engine.top_p=1"),
        (["gate.veto=10", "engine.top_p=0.9"], "engine.top_p=1"),
        (["gate.level=token", "gate.token_band=[0.5,2.0]"], "gate.token_band masks tokens"),
        (["gate.level=seq", "gate.token_band=[2.0,0.5]"], "gate.token_band=[2.0, 0.5] must be"),
        (["gate.veto=0.5"], "gate.veto must be a ratio above 1"),
        (["gate.anchor=pi"], "gate.anchor=pi is unknown"),
    ],
)
def test_unsafe_or_invalid_corrections_are_refused_at_start_up_in_one_sentence(overrides, words):
    with pytest.raises(ConfigError) as error:
        compose_config(overrides)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_the_new_gate_keys_default_to_no_correction_so_presets_keep_their_meaning():
    for preset in ("on_policy", "token", "seq", "geo"):
        gate_cfg = compose_config([f"gate={preset}"]).gate
        assert (gate_cfg.token_band, gate_cfg.veto, gate_cfg.bypass) == (None, None, False)
