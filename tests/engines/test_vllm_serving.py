"""The vLLM engine at serving speed (#26): prefix caching salted with the weights, so a later turn
reuses its session's blocks within a version and never a block of older weights; requests that
join the running batch mid-way (continuous batching) with exact ids, log-probs and versions; and
tokens handed out as they are sampled, through the loopback server's streams. Hits are vLLM's own
count (`num_cached_tokens` of the request's output). Own module: one vLLM engine per process."""

import importlib.util
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from workbench.engines.base import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed: pip install 'molt-wb[vllm]'",
)
# |engine log-prob - learner log-prob| per token, float32
TOLERANCE = 2e-4
# vLLM's CPU backend caches whole blocks of 128 tokens
BLOCK = 128


@pytest.fixture(scope="module")
def engine(tiny_path):
    from workbench.engines.vllm_engine import VllmEngine

    return VllmEngine(tiny_path, partial=True)


@pytest.fixture(scope="module")
def learner(tiny_path):
    return AutoModelForCausalLM.from_pretrained(tiny_path).eval()


def learner_logprobs(model, prompt, sampled, temperature=1.0):
    """log softmax(logits / T) of each sampled id under one plain forward."""
    ids = torch.tensor(np.concatenate([prompt, sampled]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    dist = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return dist.gather(-1, torch.tensor(sampled, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def test_a_later_turn_reuses_its_blocks_within_a_version_and_none_after_a_weight_push(
    engine, learner
):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
    # turn one: a prompt of two whole blocks and a bit
    first = np.random.default_rng(1).integers(5, 400, size=2 * BLOCK + 20).astype(np.int32)
    (reply,) = engine.generate([first], params)
    assert reply.extras["cached_prompt_tokens"] == 0
    # turn two: the session's history, its reply and a new message
    second = np.concatenate([first, reply.token_ids, np.arange(50, 80, dtype=np.int32)])
    (again,) = engine.generate([second], params)
    assert again.extras["cached_prompt_tokens"] == 2 * BLOCK
    # the cached blocks give what a learner forward recomputes
    np.testing.assert_allclose(
        again.logprobs, learner_logprobs(learner, second, again.token_ids), atol=TOLERANCE
    )
    # new weights: nothing the old ones computed serves the same prompt
    moved = {k: v + 0.05 * torch.randn_like(v) for k, v in learner.state_dict().items()}
    engine.load_weights(moved, engine.version + 1)
    (pushed,) = engine.generate([second], params)
    assert pushed.extras["cached_prompt_tokens"] == 0
    assert set(pushed.versions) == {engine.version}
    # within the new version, the session's blocks serve again
    (later,) = engine.generate([second], params)
    assert later.extras["cached_prompt_tokens"] >= 2 * BLOCK
    # the same weights pushed again are a new version: still no block of the old push
    engine.load_weights(learner.state_dict(), engine.version + 1)
    (back,) = engine.generate([second], params)
    assert back.extras["cached_prompt_tokens"] == 0
    np.testing.assert_allclose(
        back.logprobs, learner_logprobs(learner, second, back.token_ids), atol=TOLERANCE
    )


def test_a_request_joins_the_running_batch_and_leaves_when_it_ends(engine, learner):
    engine.load_weights(learner.state_dict(), engine.version + 1)
    long_prompt = np.arange(3, 40, dtype=np.int32)
    short_prompt = np.arange(100, 109, dtype=np.int32)
    long_params = SamplingParams(max_tokens=96, temperature=1.0, row_seeds=(7,))
    short_params = SamplingParams(max_tokens=6, temperature=0.7, row_seeds=(8,))
    # alone, each samples this (per-request seeds: what it shares a batch with changes nothing)
    (short_alone,) = engine.generate([short_prompt], short_params)
    sampled = []
    started = threading.Event()

    def listener(row, ids):
        sampled.extend(ids)
        if len(sampled) >= 8:
            started.set()

    results = {}
    long_call = threading.Thread(
        target=lambda: results.update(
            long=engine.generate([long_prompt], long_params, None, listener)
        )
    )
    long_call.start()
    assert started.wait(60)
    (short,) = engine.generate([short_prompt], short_params)
    joined_after = len(sampled)
    long_call.join()
    (long,) = results["long"]
    # the short request entered while the long one ran and left before it ended
    assert 8 <= joined_after < 96
    assert len(long.token_ids) == 96 and list(long.token_ids) == sampled
    np.testing.assert_array_equal(short.token_ids, short_alone.token_ids)
    np.testing.assert_allclose(short.logprobs, short_alone.logprobs, atol=TOLERANCE)
    for prompt, generation, temperature in ((long_prompt, long, 1.0), (short_prompt, short, 0.7)):
        assert set(generation.versions) == {engine.version}
        np.testing.assert_allclose(
            generation.logprobs,
            learner_logprobs(learner, prompt, generation.token_ids, temperature),
            atol=TOLERANCE,
        )


def test_a_push_mid_batch_swaps_every_running_request_at_the_same_step(engine, learner):
    version = engine.version
    prompts = [np.arange(3, 12, dtype=np.int32), np.arange(20, 33, dtype=np.int32)]
    counts = [0, 0]
    pushed = threading.Event()

    def listener(row, ids):
        counts[row] += len(ids)
        if min(counts) >= 3 and not pushed.is_set():
            pushed.set()

    def push():
        pushed.wait(60)
        engine.load_weights(learner.state_dict(), version + 1)

    pusher = threading.Thread(target=push)
    pusher.start()
    out = engine.generate(
        prompts, SamplingParams(max_tokens=64, temperature=1.0, seed=2), None, listener
    )
    pusher.join()
    # each sequence: tokens of the old version, then of the new one, split at one step for both
    splits = [int(np.argmax(g.versions == version + 1)) for g in out]
    for generation in out:
        assert set(generation.versions) == {version, version + 1}
        assert np.all(np.diff(generation.versions) >= 0)
    assert splits[0] == splits[1] >= 3


def test_loopback_sessions_stream_as_sampled_and_join_the_running_batch_exactly(
    engine, learner, tokenizer
):
    from workbench.server.loopback import LoopbackServer

    engine.load_weights(learner.state_dict(), engine.version + 1)
    # by prompt text, when each request's generation ended, from the engine's side
    ended = {}
    submit = engine.submit

    def timed_submit(prompts, *args, **kwargs):
        futures = submit(prompts, *args, **kwargs)
        prompt = tokenizer.decode(prompts[0])
        futures[0].add_done_callback(lambda _: ended.update({prompt: time.perf_counter()}))
        return futures

    engine.submit = timed_submit
    server = LoopbackServer(engine, tokenizer, SamplingParams(max_tokens=120), seed=0)

    def episode(index: int) -> tuple[list[float], tuple]:
        # staggered: later sessions join a batch that is already running
        time.sleep(0.3 * index)
        session = server.open_session(index)
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        times = []
        messages = [{"role": "user", "content": f"Session {index}: go."}]
        for chunk in client.chat.completions.create(model="policy", messages=messages, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
        return times, server.close_session(session["session"])

    try:
        with ThreadPoolExecutor(4) as pool:
            episodes = list(pool.map(episode, range(4)))
    finally:
        server.stop()
        del engine.submit
    # each session's deltas began well before its generation ended
    assert len(ended) == 4
    for index, (times, _) in enumerate(episodes):
        (end,) = [t for prompt, t in ended.items() if f"Session {index}:" in prompt]
        assert sum(t < end for t in times) > 1
    for _, ((segment,), _) in episodes:
        arrays = segment.arrays()
        mask = arrays["loss_mask"].astype(bool)
        assert mask.sum() == 120
        assert set(arrays["behavior_version"][mask]) == {engine.version}
        ids = arrays["token_ids"]
        start = int(np.argmax(mask))
        np.testing.assert_allclose(
            arrays["behavior_logprob"][mask],
            learner_logprobs(learner, ids[:start], ids[start:]),
            atol=TOLERANCE,
        )


def test_a_burst_of_long_prompts_over_one_step_budget_samples_seeded(engine):
    # 16 x 300 prompt tokens: over the 4,096 tokens of one step, so prompts wait or were chunked
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 400, size=300).astype(np.int32) for _ in range(16)]
    out = engine.generate(prompts, SamplingParams(max_tokens=4, temperature=1.0, seed=9))
    assert [len(generation.token_ids) for generation in out] == [4] * 16
