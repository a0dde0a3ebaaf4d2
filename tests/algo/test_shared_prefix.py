"""Shared-prefix forwards give the full forward's log-probs and gradients, on a real tiny Qwen3."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from workbench.algo.losses import token_logprobs, token_logprobs_entropy
from workbench.config import compose_config
from workbench.learner.batch import collate
from workbench.learner.learner import Learner
from workbench.models.multimodal import load_policy
from workbench.models.prefix import plan, shared_prefix_logprobs, unique_rows
from workbench.rollout.worker import RolloutWorker
from workbench.run.data import Prompts


def batch(rng, groups: int = 3, size: int = 4, prompt: tuple = (5, 9)):
    """Right-padded rows: per group one prompt, per row its own reply of its own length."""
    rows = []
    group_ids = []
    for g in range(groups):
        head = rng.integers(10, 500, size=int(rng.integers(*prompt)))
        for _ in range(size):
            rows.append(np.concatenate([head, rng.integers(10, 500, size=int(rng.integers(1, 6)))]))
            group_ids.append(g)
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.from_numpy(r)
        mask[i, : len(r)] = 1
    return ids, mask, torch.tensor(group_ids)


def full_logprobs(model, ids, mask, temperature):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return token_logprobs(
        model(input_ids=ids, attention_mask=mask, position_ids=positions).logits, ids, temperature
    )


@pytest.fixture(scope="module")
def model(tiny_path):
    torch.manual_seed(0)
    return load_policy(tiny_path).train()


def test_plan_finds_each_groups_common_prompt():
    ids, mask, groups = batch(np.random.default_rng(0))
    p = plan(ids, mask.sum(-1), groups)
    assert p is not None and len(p.prefix_len) == 3
    for g in range(3):
        rows = np.flatnonzero(p.group_of == g)
        n = p.prefix_len[g]
        assert (ids[rows, :n] == ids[rows[0], :n]).all()
        assert n < mask[rows].sum(-1).min()  # every row keeps a token of its own


def test_plan_refuses_when_little_is_shared():
    # groups of one row: nothing is saved
    ids, mask, groups = batch(np.random.default_rng(1), size=1)
    assert plan(ids, mask.sum(-1), groups) is None


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("temperature,shuffled", [(1.0, False), (0.7, True)])
def test_shared_prefix_logprobs_and_gradients_equal_the_full_forward(
    model, temperature, shuffled, packed
):
    ids, mask, groups = batch(np.random.default_rng(2))
    # a group's rows need not be neighbours
    if shuffled:
        order = torch.from_numpy(np.random.default_rng(5).permutation(len(ids)))
        ids = ids[order]
        mask = mask[order]
        groups = groups[order]
    weights = torch.randn(ids.shape)
    reference = full_logprobs(model, ids, mask, temperature)
    (reference * weights * mask).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    shared = shared_prefix_logprobs(
        model, ids, mask, plan(ids, mask.sum(-1), groups), temperature, packed
    )
    (shared * weights * mask).sum().backward()
    real = mask.bool()
    assert torch.allclose(shared[real], reference[real], atol=1e-5)
    # to float rounding, on each gradient's own scale
    for name, param in model.named_parameters():
        assert (param.grad - expected[name]).abs().max() <= 1e-5 * expected[name].abs().max(), name
    model.zero_grad()


def test_unique_rows_maps_each_prompt_to_its_first_copy():
    a = np.array([1, 2, 3])
    b = np.array([1, 2])
    distinct, index = unique_rows([a, b, a.copy(), b, np.array([4])])
    assert [d.tolist() for d in distinct] == [[1, 2, 3], [1, 2], [4]]
    assert index.tolist() == [0, 1, 0, 1, 2]


def test_the_learner_trains_the_same_with_and_without_shared_prefixes_and_group_micro_batches(
    tiny_path,
):
    cfg = compose_config(
        [
            "tracking=none",
            "trainer.prompts_per_step=3",
            "trainer.group_size=4",
            "engine.max_tokens=6",
        ]
    )
    OmegaConf.update(cfg, "run.id", "prefix")
    segments = RolloutWorker(cfg, tiny_path).rollout(Prompts(cfg).next_jobs(1)[0])
    # rewards that differ within each group, so every group has a gradient
    for segment in segments:
        segment.reward = float(segment.rollout_id % 2)
    batch = collate(segments)
    lengths = batch.attention_mask.sum(-1)
    split = plan(batch.token_ids, lengths, batch.group_ids)
    # a group's tokens, its prompt once: the budget holds one group, not two
    group_tokens = [
        int(split.prefix_len[g] + (lengths[split.group_of == g] - split.prefix_len[g]).sum())
        for g in range(3)
    ]
    budget = max(group_tokens) + 1
    assert budget < 2 * min(group_tokens)
    results = []
    for shared, microbatch in ((False, 0), (True, 0), (True, budget)):
        OmegaConf.update(cfg, "trainer.shared_prefix", shared)
        OmegaConf.update(cfg, "trainer.max_tokens_per_microbatch", microbatch)
        learner = Learner(cfg, tiny_path)
        metrics, rows = learner.train(segments)
        results.append((metrics, rows, {n: p.grad for n, p in learner.model.named_parameters()}))
    # with the budget: one micro-batch per group, each group's rows together
    groups = learner.microbatches(batch)
    assert sorted(sorted(batch.group_ids[rows].tolist()) for rows in groups) == [
        [g] * 4 for g in range(3)
    ]
    (full_metrics, full_rows, full_grads), *shared_runs = results
    for shared_metrics, shared_rows, shared_grads in shared_runs:
        assert shared_metrics["loss/grad_norm"] > 0
        for key in ("loss/policy", "loss/grad_norm", "mismatch/kl"):
            assert shared_metrics[key] == pytest.approx(full_metrics[key], rel=1e-4, abs=1e-6), key
        for column in ("train_logprob", "entropy"):
            for a, b in zip(shared_rows[column], full_rows[column], strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
        # (Adam's first step is sign(gradient): the weights themselves are no fair comparison)
        for name in full_grads:
            assert torch.allclose(shared_grads[name], full_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("packed", [True, False])
def test_shared_prefix_entropy_equals_the_full_forwards(model, packed):
    ids, mask, groups = batch(np.random.default_rng(2))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        _, reference = token_logprobs_entropy(logits, ids, 0.7)
        logprob, entropy = shared_prefix_logprobs(
            model, ids, mask, plan(ids, mask.sum(-1), groups), 0.7, packed, entropy=True
        )
    real = mask.bool()
    assert torch.allclose(entropy[real], reference[real], atol=1e-5)
    assert torch.allclose(logprob[real], full_logprobs(model, ids, mask, 0.7)[real], atol=1e-5)
