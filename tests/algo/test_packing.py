"""Packed micro-batches give the padded forward's log-probs and gradients, on the real tiny models
(dense, Qwen3-MoE, Mixtral), routing replay included."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from workbench.algo.losses import token_logprobs, token_logprobs_entropy
from workbench.config import ConfigError, compose_config
from workbench.invariants.routing_replay import find_routers, replay_routes
from workbench.models.multimodal import load_policy
from workbench.models.packing import microbatches, pack_like, packed_logprobs, unpack
from workbench.models.prefix import plan, shared_prefix_logprobs
from workbench.models.tiny import tiny_model_path

# very uneven rows, a one-token row among them (two sequence starts side by side)
LENGTHS = [3, 37, 1, 9, 2, 21, 5]


def padded_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids [batch, seq] and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(10, 500, mask.shape, generator=generator) * mask
    return ids, mask


def padded_logprobs(model, ids, mask, temperature=1.0):
    """The reference: one padded forward of every row."""
    return token_logprobs(model(input_ids=ids, attention_mask=mask).logits, ids, temperature)


def gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d parameter (parameters no token reached left out), the model's grads cleared."""
    model.zero_grad()
    loss.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


def assert_same_gradients(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    # to float rounding, on each gradient's own scale
    for name, grad in expected.items():
        assert (got[name] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-8, name


@pytest.fixture(scope="module", params=["tiny", "tiny-eager", "tiny-moe", "tiny-mixtral"])
def model(request):
    torch.manual_seed(0)
    if request.param == "tiny-eager":
        path = tiny_model_path("tiny")
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").train()
    return load_policy(str(tiny_model_path(request.param))).train()


@pytest.mark.parametrize(
    "lengths,max_tokens,expected",
    [
        # 8 opens a group (room 2), 5 a second (room 5), 3 joins it, 2 fills the first
        ([5, 3, 8, 2], 10, [[2, 3], [0, 1]]),
        # 12 is over the budget: alone; 4 and 3 share the next group
        ([12, 3, 4], 10, [[0], [1, 2]]),
        # equal lengths: first-fit in index order
        ([4, 4, 4], 8, [[0, 1], [2]]),
        # no budget: one group of every row
        ([12, 3, 4], 0, [[0, 1, 2]]),
        ([], 10, []),
    ],
)
def test_microbatches_pack_first_fit_decreasing(lengths, max_tokens, expected):
    assert microbatches(lengths, max_tokens) == expected


@pytest.mark.parametrize("seed", range(5))
def test_microbatches_hold_every_row_once_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=40).tolist()
    groups = microbatches(lengths, 64)
    assert sorted(row for group in groups for row in group) == list(range(40))
    for group in groups:
        assert sum(lengths[r] for r in group) <= 64 or len(group) == 1
    # first-fit decreasing is within 11/9 OPT + 1 groups; the tokens' lower bound is looser still
    assert len(groups) <= 11 / 9 * np.ceil(sum(lengths) / 64) + 1


def test_a_negative_microbatch_budget_is_refused_at_start_up():
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_microbatch must be 0"):
        compose_config(["trainer.max_tokens_per_microbatch=-1"])


def test_pack_like_and_unpack_move_per_token_values_between_layouts():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    values = torch.tensor([[1, 2, -9], [3, -9, -9], [4, 5, 6]])
    assert pack_like(values, mask).tolist() == [[1, 2, 3, 4, 5, 6]]
    assert unpack(pack_like(values, mask), mask, fill=-1).tolist() == [
        [1, 2, -1],
        [3, -1, -1],
        [4, 5, 6],
    ]
    # trailing dimensions travel along: [batch, seq, layers, k]
    routes = torch.arange(3 * 3 * 2 * 2).view(3, 3, 2, 2)
    packed = pack_like(routes, mask)
    assert packed.shape == (1, 6, 2, 2) and torch.equal(packed[0, 2], routes[1, 0])
    assert torch.equal(unpack(packed, mask)[mask.bool()], routes[mask.bool()])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_and_gradients_equal_the_padded_forward(model, temperature):
    ids, mask = padded_batch(LENGTHS)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))
    reference = padded_logprobs(model, ids, mask, temperature)
    expected = gradients(model, (reference * weights * mask).sum())
    packed = packed_logprobs(model, ids, mask, temperature)
    real = mask.bool()
    assert packed.shape == ids.shape
    assert torch.allclose(packed[real], reference[real], atol=1e-5)
    assert (packed[:, 0] == 0).all()
    assert_same_gradients(gradients(model, (packed * weights * mask).sum()), expected)


def test_rows_pick_a_micro_batch_of_the_batch(model):
    ids, mask = padded_batch(LENGTHS)
    rows = [5, 0, 2]
    reference = padded_logprobs(model, ids, mask)[rows]
    packed = packed_logprobs(model, ids, mask, rows=rows)
    real = mask[rows].bool()
    assert packed.shape == (3, ids.shape[1])
    assert torch.allclose(packed[real], reference[real], atol=1e-5)


def test_micro_batch_gradients_of_a_batch_normalised_loss_sum_to_the_whole_batch_gradient(model):
    ids, mask = padded_batch(LENGTHS, seed=2)
    advantages = torch.randn(len(LENGTHS), 1, generator=torch.Generator().manual_seed(3))
    # the replies: every token after the first 2 (the first never has a log-prob)
    loss_mask = mask.bool() & (torch.arange(ids.shape[1])[None] >= 2)
    # a token-mean over the whole batch: each micro-batch's loss keeps the batch's denominator
    tokens = loss_mask.sum()
    groups = microbatches(LENGTHS, 30)
    assert len(groups) >= 3
    whole = padded_logprobs(model, ids, mask)
    expected = gradients(model, -(whole * advantages * loss_mask).sum() / tokens)
    for rows in groups:
        logprob = packed_logprobs(model, ids, mask, rows=rows)
        (-(logprob * advantages[rows] * loss_mask[rows]).sum() / tokens).backward()
    accumulated = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert_same_gradients(accumulated, expected)


@pytest.mark.parametrize("packed", [True, False])
def test_group_prefix_sharing_agrees_with_packing(packed):
    model = load_policy(str(tiny_model_path("tiny"))).train()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 500, size=n) for n in (6, 8)]
    rows = [
        np.concatenate([p, rng.integers(10, 500, size=int(rng.integers(1, 7)))]) for p in prompts
    ]
    rows = rows + [np.concatenate([p, rng.integers(10, 500, size=3)]) for p in prompts]
    ids, mask = padded_batch([len(r) for r in rows])
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.from_numpy(row)
    split = plan(ids, mask.sum(-1), torch.tensor([0, 1, 0, 1]))
    assert split is not None
    shared = shared_prefix_logprobs(model, ids, mask, split, packed=packed)
    real = mask.bool()
    assert torch.allclose(shared[real], packed_logprobs(model, ids, mask)[real], atol=1e-5)


def test_recorded_routes_replay_on_packed_rows_as_on_padded_ones(model):
    routers = find_routers(model)
    if not routers:
        pytest.skip("a dense model has no routes")
    ids, mask = padded_batch(LENGTHS, seed=5)
    top_k = routers[0].top_k
    generator = torch.Generator().manual_seed(6)
    # [batch, seq, layers, k]: distinct random experts per token and layer, a third unknown (-1)
    draws = torch.rand(*ids.shape, len(routers), routers[0].num_experts, generator=generator)
    recorded = draws.argsort(-1)[..., :top_k]
    unknown = torch.rand(ids.shape, generator=generator) < 1 / 3
    recorded[unknown] = -1
    weights = torch.randn(ids.shape, generator=generator)
    real = mask.bool()
    with replay_routes(model, recorded) as padded_stats:
        reference = padded_logprobs(model, ids, mask)
    expected = gradients(model, (reference * weights * mask).sum())
    with replay_routes(model, pack_like(recorded, mask)) as packed_stats:
        packed = packed_logprobs(model, ids, mask)
    assert torch.allclose(packed[real], reference[real], atol=1e-5)
    assert_same_gradients(gradients(model, (packed * weights * mask).sum()), expected)
    for name in ("mismatch", "known", "live"):
        assert torch.equal(unpack(packed_stats[name], mask)[real], padded_stats[name][real]), name
    # the replayed routes did change the forward: live routing gives other log-probs
    live = packed_logprobs(model, ids, mask)
    assert (live[real] - packed[real]).abs().max() > 1e-3


def test_packed_entropy_equals_the_padded_forwards(model):
    ids, mask = padded_batch(LENGTHS)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        _, reference = token_logprobs_entropy(logits, ids, 0.7)
        logprob, entropy = packed_logprobs(model, ids, mask, 0.7, entropy=True)
    real = mask.bool()
    assert torch.allclose(entropy[real], reference[real], atol=1e-5)
    assert (entropy[:, 0] == 0).all()
    assert torch.allclose(logprob[real], padded_logprobs(model, ids, mask, 0.7)[real], atol=1e-5)
