"""Token log-probs, masked mean, PPO-clip loss and KL estimators against hand-computed values."""

import math

import pytest
import torch

from workbench.algo.losses import (
    POLICY_LOSSES,
    approx_kl,
    masked_mean,
    policy_gradient_loss,
    sequence_ratio_logprob,
    token_logprobs,
)

# ---------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_reads_the_previous_steps_distribution():
    # step 0 logits [0, 0] -> p = [1/2, 1/2]; token 1 -> log(1/2)
    # step 1 logits [ln 3, 0] -> p = [3/4, 1/4]; token 0 -> log(3/4); step 2 logits unused
    logits = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0], [99.0, -99.0]]])  # [1, 3, 2]
    token_ids = torch.tensor([[0, 1, 0]])
    torch.testing.assert_close(
        token_logprobs(logits, token_ids), torch.tensor([[0.0, math.log(0.5), math.log(0.75)]])
    )


def test_token_logprobs_divides_logits_by_temperature():
    # logits [ln 3, 0] / 2 = [ln sqrt3, 0] -> p(token 0) = sqrt3 / (sqrt3 + 1)
    logits = torch.tensor([[[math.log(3), 0.0], [0.0, 0.0]]])
    token_ids = torch.tensor([[1, 0]])
    expected = torch.tensor([[0.0, math.log(3**0.5 / (3**0.5 + 1))]])
    torch.testing.assert_close(token_logprobs(logits, token_ids, temperature=2.0), expected)


def test_token_logprobs_matches_plain_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=generator)
    token_ids = torch.randint(0, 11, (3, 6), generator=generator)
    expected = torch.zeros(3, 6)
    for b in range(3):
        for t in range(1, 6):
            expected[b, t] = torch.log_softmax(logits[b, t - 1] / 0.7, dim=-1)[token_ids[b, t]]
    torch.testing.assert_close(token_logprobs(logits, token_ids, temperature=0.7), expected)


# ---------------------------------------------------------------------------- masked_mean


def test_masked_mean_ignores_masked_out_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 4) / 3)
    assert masked_mean(x, mask, dim=-1).tolist() == [1.5, 4.0]
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


# ---------------------------------------------------------------------------- policy_gradient_loss
# clip band [0.8, 1.2]. Per masked token: ratio, advantage -> per-token loss -min(r*A, clip(r)*A)
#   seq 0: 1.1, +1 -> -1.1 (inside)        1.5, +1 -> -1.2 (clipped)
#          0.5, +1 -> -0.5 (unclipped wins)
#          4th token masked out (old_logprob = -inf, huge advantage: must not leak)
#   seq 1: 0.5, -1 -> +0.8 (clipped)       1.5, -1 -> +1.5 (unclipped wins)
#          0.9, -2 -> +1.8 (inside)        1.0, -1 -> +1.0 (inside)
# seq 0 sum -2.8 over 3 tokens, seq 1 sum 5.1 over 4 tokens.
RATIOS = [[1.1, 1.5, 0.5, 1.0], [0.5, 1.5, 0.9, 1.0]]
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0, 1000.0], [-1.0, -1.0, -2.0, -1.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
OLD = torch.tensor([[-1.0, -2.0, -0.5, -math.inf], [-1.0, -1.0, -3.0, -0.2]])


def logprob_for(ratios=RATIOS):
    """logprob with exp(logprob - OLD) = ratio on masked tokens, 50 on the masked-out one."""
    logprob = torch.log(torch.tensor(ratios)) + OLD
    logprob[0, 3] = 50.0
    return logprob.requires_grad_()


@pytest.mark.parametrize(
    "aggregation, denominator, expected",
    [
        ("token_mean", None, (-2.8 + 5.1) / 7),
        ("seq_mean", None, (-2.8 / 3 + 5.1 / 4) / 2),
        ("constant", 10.0, (-2.8 + 5.1) / 10),
    ],
)
def test_ppo_clip_loss_matches_hand_values(aggregation, denominator, expected):
    loss, _ = policy_gradient_loss(
        logprob_for(),
        OLD,
        ADVANTAGES,
        MASK,
        aggregation=aggregation,
        constant_denominator=denominator,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_ppo_clip_metrics_match_hand_values():
    _, metrics = policy_gradient_loss(logprob_for(), OLD, ADVANTAGES, MASK)
    assert metrics["clip_frac"] == pytest.approx(2 / 7)  # (1.5, +1) and (0.5, -1)
    assert metrics["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 0.5 + 1.5 + 0.9 + 1.0) / 7)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    # k3 = sum(r - 1 - ln r) / 7; sum(r - 1) = 0 here,
    # so k3 = -ln(1.1 * 1.5 * 0.5 * 0.5 * 1.5 * 0.9 * 1) / 7
    assert metrics["approx_kl"] == pytest.approx(
        -math.log(1.1 * 1.5**2 * 0.5**2 * 0.9) / 7, rel=1e-5
    )


def test_ppo_clip_gradient_is_minus_ratio_times_advantage_and_zero_where_clipped():
    logprob = logprob_for()
    loss, _ = policy_gradient_loss(logprob, OLD, ADVANTAGES, MASK)
    loss.backward()
    # d(-r*A/7)/d logprob = -r*A/7 where the unclipped term is active; 0 where clipped or masked out
    expected = torch.tensor([[-1.1, 0.0, -0.5, 0.0], [0.0, 1.5, 1.8, 1.0]]) / 7
    torch.testing.assert_close(logprob.grad, expected)


def test_is_weight_scales_each_tokens_loss_and_gets_no_gradient():
    is_weight = torch.tensor([[0.5, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 2.0]], requires_grad=True)
    loss, _ = policy_gradient_loss(logprob_for(), OLD, ADVANTAGES, MASK, is_weight=is_weight)
    # seq 0: -1.1*0.5 - 1.2 - 0.5 = -2.25; seq 1: 0.8 + 1.5 + 1.8 + 1.0*2 = 6.1
    assert loss.item() == pytest.approx((-2.25 + 6.1) / 7, rel=1e-5)
    loss.backward()
    assert is_weight.grad is None


def test_per_sequence_advantage_broadcasts_over_tokens():
    logprob = logprob_for()
    per_sequence, _ = policy_gradient_loss(logprob, OLD, torch.tensor([1.0, -1.0]), MASK)
    per_token, _ = policy_gradient_loss(logprob, OLD, torch.tensor([[1.0] * 4, [-1.0] * 4]), MASK)
    # seq 0 as before: -2.8; seq 1 with A = -1: 0.8 + 1.5 + 0.9 + 1.0 = 4.2
    assert per_sequence.item() == pytest.approx((-2.8 + 4.2) / 7, rel=1e-5)
    assert per_sequence.item() == per_token.item()


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
def test_empty_mask_gives_zero_loss_with_graph_and_zero_metrics(aggregation):
    logprob = logprob_for()
    loss, metrics = policy_gradient_loss(
        logprob,
        OLD,
        ADVANTAGES,
        torch.zeros_like(MASK),
        aggregation=aggregation,
        constant_denominator=4.0,
    )
    assert loss.item() == 0.0
    loss.backward()
    assert logprob.grad.tolist() == [[0.0] * 4, [0.0] * 4]
    assert metrics == {"clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "approx_kl": 0.0}


def test_constant_aggregation_without_denominator_is_refused():
    with pytest.raises(ValueError, match="constant_denominator"):
        policy_gradient_loss(logprob_for(), OLD, ADVANTAGES, MASK, aggregation="constant")


def test_unknown_aggregation_names_the_valid_ones():
    with pytest.raises(ValueError, match="token_mean, seq_mean, constant"):
        policy_gradient_loss(logprob_for(), OLD, ADVANTAGES, MASK, aggregation="sum")


# ---------------------------------------------------------------------------- approx_kl
# log r = logq - logp = [ln 2, -ln 2] on the two masked tokens (third masked out)
#   k1 = mean(-ln 2, ln 2) = 0
#   k2 = mean((ln 2)^2 / 2, (ln 2)^2 / 2) = (ln 2)^2 / 2
#   k3 = mean(2 - 1 - ln 2, 0.5 - 1 + ln 2) = 0.5 / 2 = 0.25
KL_LOGP = torch.tensor([[0.0, 0.0, 0.0]])
KL_LOGQ = torch.tensor([[math.log(2), -math.log(2), 7.0]])
KL_MASK = torch.tensor([[1, 1, 0]])


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", 0.0),
        ("k2", math.log(2) ** 2 / 2),
        ("k3", 0.25),
    ],
)
def test_kl_estimators_match_hand_values(estimator, expected):
    value = approx_kl(KL_LOGP, KL_LOGQ, KL_MASK, estimator)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_unknown_kl_estimator_names_the_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        approx_kl(KL_LOGP, KL_LOGQ, KL_MASK, "k4")


def test_gspo_ratio_is_the_geometric_mean_and_its_gradient_is_shared_evenly():
    old = torch.tensor([[0.0, -1.0, -1.0]])
    logprob = torch.tensor([[0.0, -1.0 + math.log(2.0), -1.0]], requires_grad=True)
    mask = torch.tensor([[False, True, True]])
    # sequence ratio s = exp((ln 2 + 0) / 2) = sqrt(2) ≈ 1.4142 for every sampled token
    stand_in = sequence_ratio_logprob(logprob, old, mask)
    torch.testing.assert_close((stand_in - old)[mask].exp(), torch.full((2,), math.sqrt(2.0)))
    # wide band: loss = -s * A = -sqrt(2) (seq_mean);
    # d loss / d logprob_t = -s * A / 2 per sampled token
    loss, _ = policy_gradient_loss(
        stand_in, old, torch.tensor([1.0]), mask, clip_low=10, clip_high=10, aggregation="seq_mean"
    )
    loss.backward()
    assert abs(loss.item() + math.sqrt(2.0)) < 1e-6
    torch.testing.assert_close(
        logprob.grad, torch.tensor([[0.0, -math.sqrt(2.0) / 2, -math.sqrt(2.0) / 2]])
    )
    # narrow band: s is clipped at 1 + 4e-4 for the whole sequence, and no gradient flows
    logprob.grad = None
    loss, metrics = policy_gradient_loss(
        sequence_ratio_logprob(logprob, old, mask),
        old,
        torch.tensor([1.0]),
        mask,
        clip_low=3e-4,
        clip_high=4e-4,
        aggregation="seq_mean",
    )
    loss.backward()
    assert abs(loss.item() + 1.0004) < 1e-6 and metrics["clip_frac"] == 1.0
    assert torch.count_nonzero(logprob.grad) == 0


def test_cispo_weights_log_prob_by_the_clipped_ratio_and_keeps_gradient_on_clipped_tokens():
    logprob = logprob_for()
    loss, metrics = POLICY_LOSSES["cispo"](logprob, OLD, ADVANTAGES, MASK, MASK)
    # weights clip(r, 0.8, 1.2): seq 0: 1.1, 1.2, 0.8 (A = +1);
    # seq 1: 0.8, 1.2, 0.9, 1.0 (A = -1, -1, -2, -1)
    weight_times_advantage = [1.1, 1.2, 0.8, -0.8, -1.2, -1.8, -1.0]
    logprobs = [
        math.log(1.1) - 1,
        math.log(1.5) - 2,
        math.log(0.5) - 0.5,
        math.log(0.5) - 1,
        math.log(1.5) - 1,
        math.log(0.9) - 3,
        -0.2,
    ]
    assert loss.item() == pytest.approx(
        -sum(w * lp for w, lp in zip(weight_times_advantage, logprobs, strict=True)) / 7, rel=1e-5
    )
    loss.backward()
    # d/d logprob = -w*A/7 on every sampled token, clipped ones included; 0 on the masked-out token
    torch.testing.assert_close(
        logprob.grad, torch.tensor([[-1.1, -1.2, -0.8, 0.0], [0.8, 1.2, 1.8, 1.0]]) / 7
    )
    # ratios 1.5, 0.5, 0.5, 1.5 lie outside [0.8, 1.2]
    assert metrics["clip_frac"] == pytest.approx(4 / 7)


@pytest.mark.parametrize(
    "estimator, expected_grad",
    [
        # d(logp - logq)/d logp / 2
        ("k1", [0.5, 0.5, 0.0]),
        # -(log r) / 2
        ("k2", [-math.log(2) / 2, math.log(2) / 2, 0.0]),
        # (1 - r) / 2 with r = 2, 1/2
        ("k3", [-0.5, 0.25, 0.0]),
    ],
)
def test_kl_penalty_gradient_flows_to_the_policy_log_probs(estimator, expected_grad):
    logp = KL_LOGP.clone().requires_grad_()
    approx_kl(logp, KL_LOGQ, KL_MASK, estimator).backward()
    torch.testing.assert_close(logp.grad, torch.tensor([expected_grad]))


# ---------------------------------------------------------------------------- the registry


def test_registered_ppo_is_the_ppo_clip_loss_with_its_hand_values():
    loss, metrics = POLICY_LOSSES["ppo"](logprob_for(), OLD, ADVANTAGES, MASK, MASK)
    assert loss.item() == pytest.approx((-2.8 + 5.1) / 7, rel=1e-5)
    assert metrics["clip_frac"] == pytest.approx(2 / 7)


def test_registered_gspo_takes_its_sequence_ratio_over_the_sampled_tokens_not_the_loss_mask():
    old = torch.tensor([[0.0, -1.0, -1.0]])
    logprob = torch.tensor([[0.0, -1.0 + math.log(2.0), -1.0 + math.log(8.0)]], requires_grad=True)
    sampled = torch.tensor([[False, True, True]])
    gated = torch.tensor([[False, True, False]])  # the gate masked token 2 out of the loss
    # s = exp((ln 2 + ln 8) / 2) = 4 over both sampled tokens; the loss sees token 1 only: -s * A
    loss, metrics = POLICY_LOSSES["gspo"](
        logprob, old, torch.tensor([1.0]), gated, sampled, clip_low=10, clip_high=10
    )
    assert loss.item() == pytest.approx(-4.0, rel=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(4.0, rel=1e-6)
    loss.backward()
    # d(-s)/d logprob_t = -s per token in the loss (s is constant in the stand-in's gradient)
    torch.testing.assert_close(logprob.grad, torch.tensor([[0.0, -4.0, 0.0]]))


def test_sft_loss_is_minus_the_token_mean_log_prob_over_the_mask():
    logprob = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, float("-inf")]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    loss, metrics = POLICY_LOSSES["sft"](logprob, None, None, mask, mask)
    # (1 + 2 + 3) / 3 tokens; the -inf outside the mask reaches nothing
    assert loss.item() == pytest.approx(2.0) and metrics == {"tokens": 3.0}
