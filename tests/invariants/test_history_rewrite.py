"""A chat template that rewrites the history: `seal` starts a segment per turn from the template's
render, `bridge` keeps the sampled ids and appends each new turn as the template renders it.

The fixture reproduces Qwen3's documented template (tests/fixtures/templates.py): ChatML whose
assistant turns before the last user message lose their `<think>` part, while the latest assistant
turn always carries one (empty when it has no reasoning)."""

import copy

import numpy as np
import openai
import pytest
from fixtures.templates import QWEN3

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.token_identity import TokenAccumulator
from workbench.server.loopback import LoopbackServer

USERS = ["What is 2 + 2?", "Sure?", "Really?"]
REPLIES = [
    "<think>\nadd them\n</think>\n\n4",
    "<think>\ncheck again\n</think>\n\nYes, 4",
    "<think>\nstill\n</think>\n\n4 it is",
]


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    """The tiny tokenizer with the Qwen3-style template (the shared fixture is untouched)."""
    rewriting = copy.deepcopy(tokenizer)
    rewriting.chat_template = QWEN3
    return rewriting


def trailing_turn(user: str) -> str:
    return f"\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def play(tokenizer, rewrite: str, finishes=("stop", "stop", "stop")):
    """Three turns whose replies think first; a turn that did not stop has no stop token."""
    episode = TokenAccumulator(tokenizer, [{"role": "user", "content": USERS[0]}], rewrite=rewrite)
    for turn, (reply, finish) in enumerate(zip(REPLIES, finishes, strict=True)):
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        if finish == "stop":
            ids = ids + [tokenizer.eos_token_id]
        message = {"role": "assistant", "content": reply}
        episode.add_sampled(np.array(ids), np.full(len(ids), -0.5), turn, message, finish)
        if turn + 1 < len(USERS):
            episode.add_messages([{"role": "user", "content": USERS[turn + 1]}])
    return episode.finish()


def test_the_fixture_drops_reasoning_before_the_last_user_message(qwen3):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": REPLIES[0]}]
    assert qwen3.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4"
        "<|im_end|>\n"
    )
    later = messages + [{"role": "user", "content": "Sure?"}]
    assert qwen3.apply_chat_template(later, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nSure?<|im_end|>\n"
    )


def test_seal_starts_a_segment_on_every_turn_of_a_rewriting_template(qwen3):
    segments = play(qwen3, "seal")
    assert [s.seal_reason for s in segments] == ["template_rewrite", "template_rewrite", "end"]
    assert [len(s.sampled_turns) for s in segments] == [1, 1, 1]
    assert all(s.identity_holds() for s in segments)
    # each segment re-renders the history without the old reasoning
    assert "add them" not in segments[1].prompt_text and "4<|im_end|>" in segments[1].prompt_text


def test_bridge_keeps_every_sampled_turn_in_one_segment_with_the_trailing_turns_between(qwen3):
    sealed = play(qwen3, "seal")
    (segment,) = play(qwen3, "bridge")
    assert segment.seal_reason == "end" and segment.identity_holds()
    ids = np.array(segment.token_ids)
    for (start, end), sampled in zip(segment.turn_spans, segment.sampled_turns, strict=True):
        np.testing.assert_array_equal(ids[start:end], sampled)
    opening = qwen3.apply_chat_template(
        [{"role": "user", "content": USERS[0]}], tokenize=False, add_generation_prompt=True
    )
    assert qwen3.decode(ids[: segment.turn_spans[0][0]]) == opening
    spans = segment.turn_spans
    for turn, user in enumerate(USERS[1:]):
        bridged = qwen3.decode(ids[spans[turn][1] : spans[turn + 1][0]])
        assert bridged == trailing_turn(user)
    # the trailing turn is what the template renders after the history for the new message
    history = [{"role": "user", "content": USERS[0]}, {"role": "assistant", "content": REPLIES[0]}]
    render = qwen3.apply_chat_template(
        history + [{"role": "user", "content": USERS[1]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert render.endswith(trailing_turn(USERS[1]))
    # one sequence, linear in the turns; sealing prefills the history again per segment
    sealed_tokens = sum(len(s.token_ids) for s in sealed)
    sealed_prefill = sum(s.loss_mask.count(0) for s in sealed)
    print(
        f"seal: {len(sealed)} segments, {sealed_tokens} tokens ({sealed_prefill} prefilled); "
        f"bridge: 1 segment, {len(ids)} tokens ({segment.loss_mask.count(0)} prefilled)"
    )
    assert len(ids) < sealed_tokens and segment.loss_mask.count(0) < sealed_prefill


def test_a_bridged_turn_that_ran_out_of_tokens_gets_its_stop_token_untrainable(qwen3):
    (segment,) = play(qwen3, "bridge", finishes=("stop", "length", "stop"))
    (_, end), (start, _) = segment.turn_spans[1:]
    assert qwen3.decode(segment.token_ids[end:start]) == "<|im_end|>" + trailing_turn(USERS[2])
    assert segment.loss_mask[end:start] == [0] * (start - end) and segment.identity_holds()


def test_bridge_changes_nothing_under_a_template_that_keeps_history(tokenizer):
    (kept,) = play(tokenizer, "seal")
    (bridged,) = play(tokenizer, "bridge")
    assert bridged.token_ids == kept.token_ids and bridged.loss_mask == kept.loss_mask


@pytest.mark.parametrize("rewrite", ["seal", "bridge"])
def test_the_openai_sdk_through_the_server_seals_or_bridges_as_set(tiny_path, qwen3, rewrite):
    # the tiny policy does not reason, but Qwen3's template still rewrites: the latest assistant
    # turn carries an empty think block that the next user message takes away; the echo is faithful
    params = SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=(qwen3.eos_token_id,))
    server = LoopbackServer(TorchEngine(tiny_path), qwen3, params, history_rewrite=rewrite)
    try:
        session = server.open_session(1)
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        messages = [{"role": "user", "content": USERS[0]}]
        finishes = []
        for user in USERS[1:] + ["Bye."]:
            choice = client.chat.completions.create(model="policy", messages=messages).choices[0]
            finishes.append(choice.finish_reason)
            messages += [
                {"role": "assistant", "content": choice.message.content},
                {"role": "user", "content": user},
            ]
        segments, requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert all(s.identity_holds() for s in segments)
    if rewrite == "seal":
        assert [r["action"] for r in requests] == ["open", "seal", "seal"]
        assert [s.seal_reason for s in segments] == ["template_rewrite", "template_rewrite", "end"]
        return
    assert [r["action"] for r in requests] == ["open", "extend", "extend"]
    (segment,) = segments
    spans = segment.turn_spans
    for turn, user in enumerate(USERS[1:]):
        closing = "" if finishes[turn] == "stop" else "<|im_end|>"
        bridged = qwen3.decode(segment.token_ids[spans[turn][1] : spans[turn + 1][0]])
        assert bridged == closing + trailing_turn(user)
