"""The CPU engine samples from exact ids and reports the sampling distribution's log-probs."""

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from workbench.engines.base import SamplingParams, from_wire, to_wire
from workbench.engines.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def engine(tiny_path):
    return TorchEngine(tiny_path)


def plain_logprobs(model, prompt, sampled, temperature):
    """Reference: one un-batched, un-cached forward over prompt + sampled ids."""
    ids = torch.tensor(np.concatenate([prompt, sampled]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    dist = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return dist.gather(-1, torch.tensor(sampled, dtype=torch.long)[:, None]).squeeze(-1).numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_of_the_same_model(engine, temperature):
    rng = np.random.default_rng(0)
    # ragged: left padding
    prompts = [rng.integers(5, 400, size=n).astype(np.int32) for n in (3, 9, 5, 12)]
    out = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=1))
    for prompt, generation in zip(prompts, out, strict=True):
        assert generation.token_ids.dtype == np.int32
        assert len(generation.token_ids) == len(generation.logprobs)
        reference = plain_logprobs(engine.model, prompt, generation.token_ids, temperature)
        np.testing.assert_allclose(generation.logprobs, reference, atol=2e-4)


def test_a_group_sharing_one_prompt_is_prefilled_once_and_sampled_apart(engine):
    """GRPO groups: copies of a prompt share one prefill (models/prefix.py); each copy still samples
    its own reply, and every log-prob is still that of a plain forward."""
    rng = np.random.default_rng(3)
    heads = [rng.integers(5, 400, size=n).astype(np.int32) for n in (6, 11)]
    prompts = [heads[i % 2].copy() for i in range(8)]
    # batch size of each forward: the prefill is the first
    rows = []
    hook = engine.model.register_forward_hook(
        lambda module, args, kwargs, out: rows.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    try:
        out = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=1.0, seed=2))
        # as the rollout calls it
        engine.generate(prompts, SamplingParams(max_tokens=1, seed=2), [[] for _ in prompts])
    finally:
        hook.remove()
    # two distinct prompts prefilled; 8 rows decode
    assert rows[0] == 2 and rows[-1] == 2 and set(rows[1:-1]) == {8}
    # the copies did not collapse into one sample
    assert len({g.token_ids.tobytes() for g in out}) > 2
    for prompt, generation in zip(prompts, out, strict=True):
        np.testing.assert_allclose(
            generation.logprobs,
            plain_logprobs(engine.model, prompt, generation.token_ids, 1.0),
            atol=2e-4,
        )


def test_generation_stops_after_a_stop_token_and_keeps_it(engine):
    prompt = np.arange(3, 10, dtype=np.int32)
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stop = int(greedy.token_ids[2])
    first = int(np.flatnonzero(greedy.token_ids == stop)[0])
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,))
    )[0]
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.token_ids, greedy.token_ids[: first + 1])


def test_same_seed_same_samples(engine):
    prompts = [np.arange(3, 10, dtype=np.int32)] * 3
    a = engine.generate(prompts, SamplingParams(max_tokens=6, seed=7))
    b = engine.generate(prompts, SamplingParams(max_tokens=6, seed=7))
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))


def test_new_weights_carry_their_version(tiny_path):
    engine = TorchEngine(tiny_path)
    prompt = [np.arange(3, 10, dtype=np.int32)]
    before = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0]
    assert set(before.versions) == {0}
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.load_weights(state, version=3)
    after = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0]
    assert set(after.versions) == {3}
    assert not np.allclose(before.logprobs, after.logprobs)
    torch.testing.assert_close(engine.model.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_weights_cross_the_wire_bit_for_bit_in_every_dtype():
    state = {
        "w": torch.randn(3, 4),
        "half": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "ids": torch.arange(6).reshape(2, 3),
        "strided": torch.randn(4, 3).t(),
    }
    wire = pickle.loads(pickle.dumps(to_wire(state)))  # as Ray moves it
    # one buffer for Ray to put
    assert isinstance(wire["raw"], np.ndarray) and wire["raw"].ndim == 1
    # 10 bf16 bytes, then a float32: aligned
    assert all(offset % 64 == 0 for _, _, _, offset, _ in wire["layout"])
    back = from_wire(wire)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor), name


def test_a_tensor_off_the_wire_pickles_as_its_own_bytes():
    state = {f"w{i}": torch.randn(10_000) for i in range(8)}  # 40 KB each, 320 KB on the wire
    back = from_wire(pickle.loads(pickle.dumps(to_wire(state))))
    # not the whole buffer (vLLM's RPC pickles what it is given)
    assert len(pickle.dumps(back["w3"])) < 41_000
    assert torch.equal(back["w3"], state["w3"])
    assert from_wire(to_wire({"empty": torch.zeros(0, 3)}))["empty"].shape == (0, 3)


def test_a_row_seeded_prompt_samples_the_same_whatever_it_shares_the_call_with(engine):
    rng = np.random.default_rng(5)
    mine, other, third = (rng.integers(5, 400, size=n).astype(np.int32) for n in (7, 4, 10))
    params = SamplingParams(max_tokens=10, temperature=1.0)
    [alone] = engine.generate([mine], replace(params, row_seeds=(11,)))
    shared = engine.generate([other, mine, third], replace(params, row_seeds=(3, 11, 4)))
    np.testing.assert_array_equal(shared[1].token_ids, alone.token_ids)
    np.testing.assert_allclose(shared[1].logprobs, alone.logprobs, atol=2e-4)
    # another seed, another sample
    [reseeded] = engine.generate([mine], replace(params, row_seeds=(12,)))
    assert reseeded.token_ids.tobytes() != alone.token_ids.tobytes()
