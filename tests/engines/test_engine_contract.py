"""Every rollout engine keeps one contract: exact prompt ids in, sampled ids with the sampling
distribution's log-probs out (as a learner forward recomputes them), per-token weight versions,
weight pushes that change what is sampled (mid-generation with partial rollout), and the loopback
server on top. The same assertions run for each engine: torch always; vllm when importable.
`MOLT_WB_ENGINES=vllm` picks engines (comma-separated)."""

import importlib.util
import os

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.engines.vllm_engine import VllmEngine
from workbench.server.loopback import LoopbackServer

ENGINES = os.environ.get("MOLT_WB_ENGINES", "torch,vllm").split(",")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# |engine log-prob - learner log-prob| per token, float32
TOLERANCE = 2e-4


def engine_params():
    return [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name == "vllm" and not HAS_VLLM,
                reason="vLLM is not installed: pip install 'molt-wb[vllm]'",
            ),
        )
        for name in ENGINES
    ]


@pytest.fixture(scope="module", params=engine_params())
def engine(request, tiny_path):
    """One engine per kind for the module (a vLLM engine takes seconds to start); partial rollout
    on."""
    if request.param == "vllm":
        engine = VllmEngine(tiny_path, partial=True, check_weight_sync=True)
    else:
        engine = TorchEngine(tiny_path, partial=True)
    yield engine


@pytest.fixture(scope="module")
def learner(tiny_path):
    return AutoModelForCausalLM.from_pretrained(tiny_path).eval()


def learner_logprobs(model, prompt, sampled, temperature):
    """What the learner recomputes: one plain forward over prompt + sampled ids,
    log softmax(logits / T)."""
    ids = torch.tensor(np.concatenate([prompt, sampled]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / (temperature or 1.0)
    dist = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return dist.gather(-1, torch.tensor(sampled, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def perturbed(model, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=generator)
        for k, v in model.state_dict().items()
    }


RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(5, 400, size=n).astype(np.int32) for n in (3, 9, 5, 12)]  # ragged


def test_copies_of_a_prompt_in_one_seeded_call_sample_apart_and_repeat(engine):
    """A GRPO group: one prompt, several samples, one seeded call (the rollout seeds each call by
    its batch and turn). The samples differ from each other, and the same call gives the same
    samples."""
    group = [PROMPTS[1]] * 6
    first = engine.generate(group, SamplingParams(max_tokens=8, temperature=1.0, seed=11))
    again = engine.generate(group, SamplingParams(max_tokens=8, temperature=1.0, seed=11))
    assert len({g.token_ids.tobytes() for g in first}) > 1
    assert [g.token_ids.tolist() for g in first] == [g.token_ids.tolist() for g in again]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_of_exact_prompt_ids_match_a_learner_forward(engine, learner, temperature):
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=temperature, seed=1))
    assert len(out) == len(PROMPTS)
    for prompt, generation in zip(PROMPTS, out, strict=True):
        assert generation.token_ids.dtype == np.int32
        assert len(generation.token_ids) == len(generation.logprobs) == 10
        np.testing.assert_allclose(
            generation.logprobs,
            learner_logprobs(learner, prompt, generation.token_ids, temperature),
            atol=TOLERANCE,
        )
    # a different prompt id changes what the engine conditions on: greedy continuations differ
    changed = PROMPTS[1].copy()
    changed[-1] += 1
    a, b = engine.generate([PROMPTS[1], changed], SamplingParams(max_tokens=6, temperature=0))
    assert not np.allclose(a.logprobs, b.logprobs)


def test_stop_token_ends_a_sequence_and_is_kept(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert greedy.finish_reason == "length"
    stop = int(greedy.token_ids[2])
    first = int(np.flatnonzero(greedy.token_ids == stop)[0])
    stopped = engine.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,))
    )[0]
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.token_ids, greedy.token_ids[: first + 1])


def test_weight_push_changes_outputs_and_versions_even_mid_generation(engine, learner):
    params = SamplingParams(max_tokens=6, temperature=0)
    before = engine.generate(PROMPTS[:2], params)
    new = perturbed(learner)
    engine.load_weights(new, version=engine.version + 3)
    version = engine.version
    after = engine.generate(PROMPTS[:2], params)
    assert all(set(g.versions) == {version} for g in after)
    assert not np.allclose(before[0].logprobs, after[0].logprobs)
    moved = type(learner).from_pretrained(learner.name_or_path).eval()
    moved.load_state_dict(new)
    np.testing.assert_allclose(
        after[0].logprobs,
        learner_logprobs(moved, PROMPTS[0], after[0].token_ids, 0),
        atol=TOLERANCE,
    )
    # partial rollout: a push that arrives while a generation runs takes effect after its first
    # token
    with engine.hold():
        engine.load_weights(learner.state_dict(), version=version + 1)
        mixed = engine.generate(PROMPTS[:1], params)[0]
    assert list(mixed.versions) == [version] + [version + 1] * 5
    assert engine.version == version + 1


def test_loopback_server_on_the_engine_records_the_engine_ids_and_logprobs(
    engine, learner, tokenizer
):
    engine.load_weights(learner.state_dict(), version=engine.version + 1)
    server = LoopbackServer(
        engine,
        tokenizer,
        SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,)),
    )
    try:
        session = server.open_session(7)
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        for _ in range(2):
            text = (
                client.chat.completions.create(model="policy", messages=messages)
                .choices[0]
                .message.content
            )
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Again."},
            ]
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["action"] for r in requests] == ["open", "extend"]
    assert segment.identity_holds()
    arrays = segment.arrays()
    mask = arrays["loss_mask"].astype(bool)
    assert set(arrays["behavior_version"][mask]) == {engine.version}
    ids = arrays["token_ids"]
    with torch.no_grad():
        dist = torch.log_softmax(
            learner(input_ids=torch.tensor(ids, dtype=torch.long)[None]).logits[0, :-1], dim=-1
        )
    recomputed = (
        dist.gather(-1, torch.tensor(ids[1:], dtype=torch.long)[:, None]).squeeze(-1).numpy()
    )
    np.testing.assert_allclose(
        arrays["behavior_logprob"][mask], recomputed[mask[1:]], atol=TOLERANCE
    )
