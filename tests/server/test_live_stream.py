"""Streamed replies go out as they are sampled (#26), on every wire, and still concatenate to
exactly the whole reply (#14): a real engine's first deltas reach the SDK before its generation
returns, and scripted replies that open reasoning or a tool call midway, hold a stop sequence,
multi-byte characters or trailing spaces stream exactly the text the same reply gives whole; an
engine that samples faster than STREAM_GAP wakes the event loop at most once per gap."""

import asyncio
import threading
import time

import anthropic
import numpy as np
import openai
import pytest
import torch

from workbench.engines.base import Generation, SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.server.batcher import STREAM_GAP, Batcher
from workbench.server.loopback import LoopbackServer

WIRES = ("openai", "anthropic", "responses")


class Timed(TorchEngine):
    """A real engine that notes when its last call returned."""

    returned = 0.0

    def generate(self, prompts, params, images=None, listener=None):
        generations = super().generate(prompts, params, images, listener)
        self.returned = time.perf_counter()
        return generations


class Scripted:
    """An engine that 'samples' the given texts' ids, handing them out one at a time."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.replies: list[str] = []

    def generate(self, prompts, params, images=None, listener=None):
        generations = []
        for row, _ in enumerate(prompts):
            ids = self.tokenizer(self.replies.pop(0), add_special_tokens=False)["input_ids"]
            for token in ids:
                # a step's time, as an engine takes: the server streams meanwhile
                time.sleep(0.002)
                if listener:
                    listener(row, [token])
            zeros = np.zeros(len(ids), np.float32)
            generations.append(
                Generation(np.asarray(ids, np.int32), zeros, zeros.astype(np.int32), "length")
            )
        return generations


def turn(server, wire: str, stream: bool, **request) -> tuple[list[str], list[float], str]:
    """One turn on `wire` of a new session: the text deltas streamed, when each arrived, and the
    reply's text (the whole reply's; streamed: as the SDK holds it at the end)."""
    session = server.open_session(0)
    key = session["api_key"]
    prompt = "Say something long."
    deltas = []
    times = []
    if wire == "anthropic":
        client = anthropic.Anthropic(
            base_url=session["anthropic_base_url"], api_key=key, max_retries=0
        )
        request = dict(
            model="policy",
            max_tokens=200,
            messages=[{"role": "user", "content": prompt}],
            **request,
        )
        if not stream:
            message = client.messages.create(**request)
        else:
            with client.messages.stream(**request) as events:
                for text in events.text_stream:
                    deltas.append(text)
                    times.append(time.perf_counter())
                message = events.get_final_message()
        text = "".join(block.text for block in message.content if block.type == "text")
    elif wire == "openai":
        client = openai.OpenAI(base_url=session["openai_base_url"], api_key=key, max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        request = dict(model="policy", max_tokens=200, messages=messages, **request)
        if not stream:
            text = client.chat.completions.create(**request).choices[0].message.content
        else:
            for chunk in client.chat.completions.create(stream=True, **request):
                if chunk.choices and chunk.choices[0].delta.content:
                    deltas.append(chunk.choices[0].delta.content)
                    times.append(time.perf_counter())
            text = "".join(deltas)
    else:
        client = openai.OpenAI(base_url=session["openai_base_url"], api_key=key, max_retries=0)
        request = dict(model="policy", max_output_tokens=200, input=prompt, **request)
        if not stream:
            text = client.responses.create(**request).output_text
        else:
            for event in client.responses.create(stream=True, **request):
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                    times.append(time.perf_counter())
                if event.type in ("response.completed", "response.incomplete"):
                    text = event.response.output_text
    server.close_session(session["session"])
    return deltas, times, text


@pytest.fixture(scope="module")
def timed_server(tiny_path, tokenizer):
    # no stop id: every reply runs to max_tokens
    engine = Timed(tiny_path)
    loopback = LoopbackServer(engine, tokenizer, SamplingParams(max_tokens=200), seed=0)
    # one thread: the tiny model's matrices are too small to split (set_threads' choice for it)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield loopback
    torch.set_num_threads(threads)
    loopback.stop()


@pytest.mark.parametrize("wire", WIRES)
def test_streamed_text_reaches_the_client_before_generation_ends(timed_server, wire):
    deltas, times, text = turn(timed_server, wire, stream=True)
    returned = timed_server.engine.returned
    # several deltas arrived while the engine was still sampling the rest
    assert sum(t < returned for t in times) > 1
    assert "".join(deltas) == text and len(text) > 20


SCRIPTS = {
    "plain, multi-byte and trailing spaces": "Café naïve ✓ and more text   ",
    "a tool call after text": (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    ),
    "reasoning first": "<think>Two and three.</think>It is 5.",
    "reasoning midway": "It is <think>hmm</think>5, surely.",
    "a stop sequence": "One, two, STOP three, four.",
    "a marker cut short": "Almost a tag: <tool_ca",
}


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS)
def test_a_streamed_reply_is_exactly_the_whole_one(tokenizer, wire, script):
    engine = Scripted(tokenizer)
    server = LoopbackServer(engine, tokenizer, SamplingParams(max_tokens=200))
    try:
        request = {}
        if "STOP" in script:
            key = "stop_sequences" if wire == "anthropic" else "stop"
            request = {key: ["STOP"]}
        if wire == "responses" and request:
            pytest.skip("the Responses wire takes no stop sequences")
        engine.replies = [script, script]
        _, _, whole = turn(server, wire, stream=False, **request)
        deltas, _, streamed = turn(server, wire, stream=True, **request)
    finally:
        server.stop()
    assert "".join(deltas) == streamed == whole


def test_a_fast_stream_wakes_the_loop_at_most_once_per_gap_and_keeps_the_ids_in_order():
    async def stream():
        loop = asyncio.get_running_loop()
        batcher = Batcher(engine=None)
        wakes = []
        wake = loop.call_soon_threadsafe
        # every wake of the loop from another thread, counted
        loop.call_soon_threadsafe = lambda *call: wakes.append(1) or wake(*call)
        taken = []
        relay = batcher._relay([taken.extend])["listener"]

        def engine_thread():
            # 300 steps of 0.1 ms each, one id a step, far faster than STREAM_GAP
            for token in range(300):
                relay(0, [token])
                time.sleep(0.0001)

        start = time.perf_counter()
        await asyncio.to_thread(engine_thread)
        elapsed = time.perf_counter() - start
        # the wakes queued before the engine returned are taken
        await asyncio.sleep(0.05)
        batcher.task.cancel()
        return taken, len(wakes), elapsed

    taken, wakes, elapsed = asyncio.run(stream())
    # in order, from the first: the ids after the last wake go out with the reply's last events
    assert taken == list(range(len(taken))) and len(taken) > 1
    # one wake per gap at most, and the one that hands back the engine's result
    assert wakes <= elapsed / STREAM_GAP + 2 < 300


def test_a_stream_that_holds_all_it_has_wakes_the_loop_at_each_id_until_text_goes_out():
    """Its first text may still open a tool call: each id wakes the loop until the listener has
    text out (the gap would hold the next ids for STREAM_GAP)."""
    held = 5

    async def stream():
        batcher = Batcher(engine=None)
        taken = []
        handed = threading.Semaphore(0)

        def listener(ids):
            taken.extend(ids)
            handed.release()
            # True: nothing went out yet
            return len(taken) < held

        relay = batcher._relay([listener])["listener"]

        def engine_thread():
            # whether each held id reached the listener before the next was sampled
            at_once = []
            for token in range(held + 3):
                relay(0, [token])
                if token < held:
                    at_once.append(handed.acquire(timeout=1.0))
            return at_once

        at_once = await asyncio.to_thread(engine_thread)
        await asyncio.sleep(0.05)
        batcher.task.cancel()
        return at_once, taken

    at_once, taken = asyncio.run(stream())
    assert at_once == [True] * held
    # in order; ids after the last wake go out with the reply's last events
    assert taken[:held] == list(range(held)) and taken == list(range(len(taken)))
