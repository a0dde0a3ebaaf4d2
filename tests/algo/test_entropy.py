"""Per-token entropy of the learner's distributions and the entropy bonus, against hand-computed
values."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from workbench.algo.losses import POLICY_LOSSES, token_logprobs, token_logprobs_entropy
from workbench.config import ConfigError, compose_config
from workbench.learner.learner import Learner
from workbench.rollout.worker import RolloutWorker
from workbench.run.data import Prompts

# logits [ln 3, 0] -> p = [3/4, 1/4]
LN3 = math.log(3)
H_QUARTER = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))


def test_entropy_reads_the_previous_steps_distribution():
    # step 0 logits [0, 0] -> H = ln 2; step 1 logits [ln 3, 0] -> H(3/4, 1/4); step 2 unused
    logits = torch.tensor([[[0.0, 0.0], [LN3, 0.0], [99.0, -99.0]]])  # [1, 3, 2]
    token_ids = torch.tensor([[0, 1, 0]])
    logprob, entropy = token_logprobs_entropy(logits, token_ids)
    torch.testing.assert_close(entropy, torch.tensor([[0.0, math.log(2), H_QUARTER]]))
    torch.testing.assert_close(logprob, token_logprobs(logits, token_ids))


def test_entropy_divides_logits_by_temperature_like_the_log_prob():
    # logits [ln 3, 0] / 2 -> p = [sqrt3, 1] / (sqrt3 + 1)
    logits = torch.tensor([[[LN3, 0.0], [0.0, 0.0]]])
    p = 3**0.5 / (3**0.5 + 1)
    _, entropy = token_logprobs_entropy(logits, torch.tensor([[1, 0]]), temperature=2.0)
    expected = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    torch.testing.assert_close(entropy, torch.tensor([[0.0, expected]]))


def test_entropy_matches_the_categorical_entropy_in_a_plain_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=generator) * 3
    token_ids = torch.randint(0, 11, (3, 6), generator=generator)
    expected = torch.zeros(3, 6)
    for b in range(3):
        for t in range(1, 6):
            expected[b, t] = torch.distributions.Categorical(
                logits=logits[b, t - 1] / 0.7
            ).entropy()
    _, entropy = token_logprobs_entropy(logits, token_ids, temperature=0.7)
    torch.testing.assert_close(entropy, expected)


def test_without_entropy_none_is_computed():
    logits = torch.zeros(1, 2, 3)
    assert (
        token_logprobs_entropy(logits, torch.zeros(1, 2, dtype=torch.long), entropy=False)[1]
        is None
    )


def toy_loss(logit, entropy_coef, policy_loss="ppo"):
    """One sampled token (id 0) drawn from logits [a, 0]; advantage 0, so only the bonus acts."""
    # [1, 2, 2]: position 1 is drawn from position 0's logits
    logits = torch.stack([torch.stack([logit, torch.tensor(0.0)]), torch.zeros(2)])[None]
    logprob, entropy = token_logprobs_entropy(logits, torch.tensor([[0, 0]]))
    mask = torch.tensor([[False, True]])
    loss, _ = POLICY_LOSSES[policy_loss](
        logprob,
        logprob.detach(),
        torch.zeros(1),
        mask,
        mask,
        entropy=entropy,
        entropy_coef=entropy_coef,
    )
    return loss, float(entropy.detach()[0, 1])


# every RL loss; sft (`molt-wb sft`, the warm start) is supervised and takes no entropy bonus
@pytest.mark.parametrize("policy_loss", sorted(set(POLICY_LOSSES) - {"sft"}))
def test_entropy_bonus_gradient_raises_the_entropy(policy_loss):
    # p = sigmoid(a) = 3/4 at a = ln 3; dH/da = -a p (1 - p) = -ln3 * 3/16, so
    # d(-coef H)/da = coef * ln3 * 3/16: a step down the gradient moves a toward 0, H up
    logit = torch.tensor(LN3, requires_grad=True)
    loss, before = toy_loss(logit, 0.5, policy_loss)
    assert loss.item() == pytest.approx(-0.5 * H_QUARTER, rel=1e-5)
    loss.backward()
    assert logit.grad.item() == pytest.approx(0.5 * LN3 * 3 / 16, rel=1e-5)
    _, after = toy_loss(logit.detach() - 0.5 * logit.grad, 0.5, policy_loss)
    assert before == pytest.approx(H_QUARTER) and after > before


def test_entropy_coef_zero_leaves_loss_and_gradient_as_without_entropy():
    logit = torch.tensor(LN3, requires_grad=True)
    loss, _ = toy_loss(logit, 0.0)
    loss.backward()
    assert loss.item() == 0.0 and logit.grad.item() == 0.0


def test_entropy_without_grad_builds_no_graph_while_the_log_prob_keeps_its_own():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    token_ids = torch.zeros(2, 3, dtype=torch.long)
    logprob, entropy = token_logprobs_entropy(logits, token_ids, entropy_grad=False)
    assert logprob.requires_grad and not entropy.requires_grad
    _, with_grad = token_logprobs_entropy(logits, token_ids)
    torch.testing.assert_close(entropy, with_grad.detach())


def learner_and_batch(tiny_path, *overrides):
    """A learner on the tiny model and one batch of its episodes, every reward equal: advantage
    0, so the policy term has no gradient."""
    cfg = compose_config(
        [
            "tracking=none",
            "trainer.prompts_per_step=2",
            "trainer.group_size=2",
            "engine.max_tokens=4",
            *overrides,
        ]
    )
    OmegaConf.update(cfg, "run.id", "entropy")
    segments = RolloutWorker(cfg, tiny_path).rollout(Prompts(cfg).next_jobs(1)[0])
    for segment in segments:
        segment.reward = 1.0
    return Learner(cfg, tiny_path), segments


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.minibatches=1"],
        ["trainer.minibatches=2"],
        ["trainer.max_tokens_per_microbatch=40"],
    ],
)
def test_the_learner_reports_its_entropy_per_token_and_per_step(tiny_path, overrides):
    learner, segments = learner_and_batch(tiny_path, *overrides)
    metrics, rows = learner.train(segments)
    entropy = torch.from_numpy(rows["entropy"][0])
    sampled = torch.from_numpy(np.concatenate([s.loss_mask for s in segments])).bool()
    assert len(entropy) == sum(len(s.token_ids) for s in segments)
    vocabulary = learner.model.config.vocab_size
    assert 0 < metrics["policy/entropy"] <= math.log(vocabulary)
    assert metrics["policy/entropy"] == pytest.approx(float(entropy[sampled].mean()), rel=1e-5)


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_entropy_coef_raises_the_learners_entropy_and_zero_leaves_it(tiny_path, coef):
    # measured: 6.2120 -> 6.2176 (coef 1, lr 1e-3); coef 0: no gradient, Adam moves nothing
    learner, segments = learner_and_batch(tiny_path, f"algo.entropy_coef={coef}", "trainer.lr=1e-3")
    before, _ = learner.train(segments)
    after, _ = learner.train(segments)
    if coef:
        assert after["policy/entropy"] > before["policy/entropy"] + 1e-3
    else:
        assert after["policy/entropy"] == pytest.approx(before["policy/entropy"], abs=1e-6)


def test_an_entropy_bonus_with_packed_micro_batches_is_refused_in_one_sentence():
    with pytest.raises(ConfigError, match=r"^algo\.entropy_coef needs .*entropy_coef=0\.$"):
        compose_config(["algo.entropy_coef=0.01", "trainer.max_tokens_per_microbatch=64"])
