"""Token identity: the sampled ids are the trajectory; trainer input cannot come from text."""

import copy
import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.invariants.token_identity import TokenAccumulator
from workbench.learner.batch import audit_identity, collate
from workbench.rollout.worker import Job, RolloutWorker
from workbench.segment import Batch, Segment

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_non_canonical_sampled_ids_survive_untouched(tokenizer):
    # " the" sampled one byte-token at a time: decoding and re-encoding would give the merged id
    pieces = tokenizer.convert_tokens_to_ids(list("Ġthe"))
    sampled = np.array(
        pieces[:2] + [tokenizer.convert_tokens_to_ids("he"), tokenizer.eos_token_id], dtype=np.int32
    )
    assert (
        tokenizer(tokenizer.decode(sampled), add_special_tokens=False)["input_ids"]
        != sampled.tolist()
    )
    episode = TokenAccumulator(tokenizer, [{"role": "user", "content": "What is 5 + 6?"}])
    prompt = episode.token_ids.copy()
    episode.add_sampled(
        sampled,
        np.array([-0.1, -0.2, -0.3, -0.4], np.float32),
        4,
        {"role": "assistant", "content": " the"},
        "stop",
    )
    episode.add_messages([{"role": "user", "content": "Sure?"}])
    (segment,) = episode.finish()
    arrays = segment.arrays()
    n = len(prompt) + len(sampled)
    np.testing.assert_array_equal(arrays["token_ids"][:n], np.r_[prompt, sampled])
    assert arrays["loss_mask"].tolist() == [0] * len(prompt) + [1] * 4 + [0] * (
        len(arrays["token_ids"]) - n
    )
    np.testing.assert_allclose(
        arrays["behavior_logprob"][len(prompt) : n], [-0.1, -0.2, -0.3, -0.4]
    )
    assert arrays["behavior_version"][len(prompt) : n].tolist() == [4] * 4
    assert set(arrays["behavior_version"][arrays["loss_mask"] == 0]) == {-1}


def test_extending_a_conversation_adds_only_the_rendered_delta(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    episode = TokenAccumulator(tokenizer, messages)
    reply = tokenizer("Hello", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    episode.add_sampled(
        np.array(reply, np.int32),
        np.zeros(len(reply), np.float32),
        0,
        {"role": "assistant", "content": "Hello"},
        "stop",
    )
    assert episode.add_messages([{"role": "user", "content": "Bye"}])
    whole = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    # ChatML: delta tokenisation equals the whole render
    assert episode.token_ids.tolist() == list(whole)


def test_a_truncated_turn_gets_its_stop_token_untrainable(tokenizer):
    episode = TokenAccumulator(tokenizer, [{"role": "user", "content": "Hi"}])
    cut = tokenizer("Hel", add_special_tokens=False)["input_ids"]
    episode.add_sampled(
        np.array(cut, np.int32),
        np.zeros(len(cut), np.float32),
        0,
        {"role": "assistant", "content": "Hel"},
        "length",
    )
    episode.add_messages([{"role": "user", "content": "Go on"}])
    (segment,) = episode.finish()
    end = segment.turn_spans[0][1]
    assert segment.token_ids[end] == tokenizer.eos_token_id and segment.loss_mask[end] == 0


# Like reasoning models' templates: earlier assistant turns are rendered without their content.
HIDING_TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
    "{{- '<|im_start|>assistant\\n(hidden)<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rewrites_history_seals_the_segment(tokenizer):
    hiding = copy.deepcopy(tokenizer)
    hiding.chat_template = HIDING_TEMPLATE
    episode = TokenAccumulator(hiding, [{"role": "user", "content": "Hi"}])
    reply = hiding("Hello", add_special_tokens=False)["input_ids"] + [hiding.eos_token_id]
    episode.add_sampled(
        np.array(reply, np.int32),
        np.zeros(len(reply), np.float32),
        0,
        {"role": "assistant", "content": "Hello"},
        "stop",
    )
    assert not episode.add_messages([{"role": "user", "content": "next"}])
    first, second = episode.finish()
    assert (first.seal_reason, second.seal_reason) == ("template_rewrite", "end")
    assert first.token_ids[-len(reply) :] == reply  # the sealed segment keeps what was sampled
    assert sum(second.loss_mask) == 0 and "(hidden)" in hiding.decode(second.token_ids)


def test_trainer_input_cannot_be_built_from_text():
    ones = np.ones(3, np.uint8)
    with pytest.raises(TypeError, match="token ids"):
        Segment("r", 0, 0, 0, "the text", ones, np.zeros(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="token ids"):
        Segment("r", 0, 0, 0, [1, 2, 3], ones, np.zeros(3, np.float32), np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="never on text"):
        collate(["What is 2 + 2? 4"])


def test_multi_turn_env_episodes_are_token_exact_segments(tiny_path):
    cfg = compose_config(
        [f"agent.plugin={FIXTURES / 'two_turn.py'}", "agent.max_turns=3", "engine.max_tokens=5"]
    )
    OmegaConf.update(cfg, "run.id", "t")
    worker = RolloutWorker(cfg, tiny_path)
    segments = worker.rollout([Job({"problem": "Say 1."}, 0, 0), Job({"problem": "Say 2."}, 0, 1)])
    assert [s.rollout_id for s in segments] == [0, 1]
    for segment in segments:
        assert segment.reward == 0.5 and len(segment.turn_spans) == 2  # terminated after two turns
        sampled = np.zeros(len(segment.token_ids), bool)
        for start, end in segment.turn_spans:
            sampled[start:end] = True
            assert (segment.behavior_version[start:end] == 0).all()
        np.testing.assert_array_equal(segment.loss_mask.astype(bool), sampled)
        assert (
            "Be brief." in segment.display["prompt"]
            and (segment.behavior_logprob[~sampled] == 0).all()
        )
    batch = collate(segments)
    np.testing.assert_array_equal(
        batch.token_ids[0, : len(segments[0].token_ids)].numpy(), segments[0].token_ids
    )
    # the next epoch's episode opens from the kept render
    again = worker.rollout([Job({"problem": "Say 1."}, 0, 2)])
    assert (
        len(worker.openings) == 2
        and again[0].token_ids[: again[0].turn_spans[0][0]].tolist()
        == segments[0].token_ids[: segments[0].turn_spans[0][0]].tolist()
    )


def test_a_workers_segments_cross_processes_as_one_blob(tiny_path):
    cfg = compose_config([f"agent.plugin={FIXTURES / 'two_turn.py'}", "engine.max_tokens=4"])
    OmegaConf.update(cfg, "run.id", "t")
    batch, failures = RolloutWorker(cfg, tiny_path).rollout_with_failures(
        [Job({"problem": "Say 1."}, 0, k) for k in range(3)]
    )
    assert isinstance(batch, Batch) and failures == []
    buffers = []
    # as Ray serialises a return value
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    # one in-band blob, not a buffer per array
    assert buffers == []
    back = pickle.loads(data)
    assert [s.rollout_id for s in back] == [0, 1, 2]
    for ours, theirs in zip(batch, back, strict=True):
        for field in ("token_ids", "loss_mask", "behavior_logprob", "behavior_version"):
            np.testing.assert_array_equal(getattr(theirs, field), getattr(ours, field))
            assert getattr(theirs, field).dtype == getattr(ours, field).dtype
        assert theirs.audit == ours.audit and theirs.display == ours.display
    # a plugin's info: plain pickle refuses it
    batch[0].display["info"] = {"grader": lambda answer: answer == "2"}
    assert pickle.loads(pickle.dumps(batch, protocol=5))[0].display["info"]["grader"]("2")


def test_an_identity_violation_stops_training(tiny_path):
    ones = np.ones(3, np.uint8)
    good = Segment(
        "r",
        0,
        0,
        0,
        np.arange(3, dtype=np.int32),
        ones,
        np.zeros(3, np.float32),
        np.zeros(3, np.int32),
        audit={"identity": True, "retokenize_drift": True},
    )
    bad = Segment(
        "r",
        1,
        0,
        0,
        np.arange(3, dtype=np.int32),
        ones,
        np.zeros(3, np.float32),
        np.zeros(3, np.int32),
        audit={"identity": False, "retokenize_drift": False},
    )
    resealed = dataclasses.replace(good, seal_reason="template_rewrite")
    assert audit_identity([good, resealed], collate([good, resealed])) == {
        "identity/violations": 0.0,
        "identity/retokenize_drift": 1.0,
        "identity/seals_compaction": 0.0,
        "identity/seals_tools_changed": 0.0,
        "identity/seals_template_rewrite": 1.0,
        "identity/segments_per_episode": 2.0,
        "identity/prefilled_again_tokens": 0.0,
        "identity/malformed_tool_calls": 0.0,
    }
    with pytest.raises(RuntimeError, match="Token identity violated in 1 segment"):
        audit_identity([good, bad], collate([good, bad]))


def test_segments_per_episode_prefilled_again_and_malformed_calls_are_counted_per_step():
    def segment(rollout_id, index, prompt, requests=()):
        # `prompt` prompt tokens, then 2 sampled
        mask = np.array([0] * prompt + [1, 1], np.uint8)
        return Segment(
            "r",
            rollout_id,
            index,
            0,
            np.arange(prompt + 2, dtype=np.int32),
            mask,
            np.zeros(prompt + 2, np.float32),
            np.zeros(prompt + 2, np.int32),
            turn_spans=[(prompt, prompt + 2)],
            requests=list(requests),
        )

    rows = [{"malformed_tool_calls": 1}, {"malformed_tool_calls": 0}, {"malformed_tool_calls": 2}]
    # episode 7 sealed twice (prompts of 4, 6 and 8 tokens), episode 8 is one segment
    segments = [segment(7, 0, 4, rows), segment(7, 1, 6), segment(7, 2, 8), segment(8, 0, 5)]
    metrics = audit_identity(segments, collate(segments))
    # 4 segments of 2 episodes; the later segments' prompts, 6 + 8, over 2 episodes
    assert metrics["identity/segments_per_episode"] == 2.0
    assert metrics["identity/prefilled_again_tokens"] == 7.0
    assert metrics["identity/malformed_tool_calls"] == 3.0


def test_misaligned_logprobs_are_a_hard_error(tokenizer):
    episode = TokenAccumulator(tokenizer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="2 log-probs for 3 sampled tokens"):
        episode.add_sampled(
            np.array([5, 6, 7], np.int32),
            np.zeros(2, np.float32),
            0,
            {"role": "assistant", "content": ""},
            "stop",
        )
    assert sum(episode.open.loss_mask) == 0  # nothing was appended


def byte_fallback_tokenizer():
    """A Llama-style tokenizer (Metaspace pieces, bytes as <0xNN> tokens), unlike the byte-level
    tiny one: a character outside its vocabulary is several byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    bpe.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", *byte_tokens], initial_alphabet=["▁"]
    )
    bpe.train_from_iterator(["Hi there, how are you today?", "the cat sat on the mat"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")


@pytest.mark.parametrize("which", ["tiny", "byte_fallback"])
def test_streamed_pieces_are_exactly_the_reply_for_any_ids(tokenizer, which):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from workbench.invariants.token_identity import reply_text, stream_pieces

    vocab = tokenizer if which == "tiny" else byte_fallback_tokenizer()
    # multi-byte characters split across tokens, and ids drawn at random
    texts = ["Hi é!", "数学 ≥ 3 🙂", "naïve café ✓"]
    split = [vocab(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert any(len(ids) > len(text) for ids, text in zip(split, texts, strict=True))
    ids = st.lists(st.integers(0, len(vocab) - 1), max_size=24)

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.one_of(ids, st.sampled_from(split)), st.integers(0, 30))
    def check(token_ids, cut):
        content = reply_text(vocab, token_ids, "length")
        for shown in (content, content[:cut]):
            pieces = stream_pieces(vocab, token_ids, shown)
            assert "".join(pieces) == shown
            assert all(piece for piece in pieces)

    check()
    # a character split across tokens goes out whole, never as U+FFFD and an empty piece
    for text, token_ids in zip(texts, split, strict=True):
        pieces = stream_pieces(vocab, token_ids, text)
        assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)


def sampled_turn(tokenizer, episode, text, message, stop_sequence=None, finish="stop"):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    zeros = np.zeros(len(ids), np.float32)
    episode.add_sampled(np.array(ids, np.int32), zeros, 0, message, finish, None, stop_sequence)


def test_faithful_echoes_extend_and_a_rewrite_still_seals(tokenizer):
    user = {"role": "user", "content": "Write code."}
    more = {"role": "user", "content": "More."}
    # (what was sampled, the message stored, the stop string, what the client echoes)
    cases = [
        ("print(1)</code>", "print(1)", "</code>", "print(1)</code>"),
        ("  print(2)\n", "  print(2)\n", None, "print(2)"),
        ("print(3)", "print(3)", None, "print(3)"),
    ]
    for sampled, content, stop, echoed in cases:
        episode = TokenAccumulator(tokenizer, [user])
        stored = {"role": "assistant", "content": content}
        sampled_turn(tokenizer, episode, sampled, stored, stop)
        echo = {"role": "assistant", "content": echoed}
        assert episode.continue_with([user, echo, more]) == "extend", echoed
        # the turn stays as sampled: the echo's spelling is not rendered in its place
        assert episode.messages[1] == stored
        assert len(episode.finish()) == 1
    # tool calls equal by name and arguments, whatever ids the client gives them
    episode = TokenAccumulator(tokenizer, [user])
    call = {"id": "call_1", "name": "add", "arguments": {"a": 1}}
    stored = {"role": "assistant", "content": "", "tool_calls": [call]}
    sampled_turn(tokenizer, episode, '<tool_call>{"name": "add"}</tool_call>', stored)
    renumbered = dict(stored, tool_calls=[dict(call, id="call_x")])
    result = {"role": "tool", "tool_call_id": "call_x", "content": "2"}
    assert episode.continue_with([user, renumbered, result]) == "extend"
    # anything else is a rewritten history: sealed, and counted by reason
    for rewritten in ("print(9)", "print(1)</code>!", " print(3) x"):
        episode = TokenAccumulator(tokenizer, [user])
        sampled_turn(
            tokenizer,
            episode,
            "print(1)</code>",
            {"role": "assistant", "content": "print(1)"},
            "</code>",
        )
        echo = {"role": "assistant", "content": rewritten}
        assert episode.continue_with([user, echo, more]) == "seal"
        assert [s.seal_reason for s in episode.finish()] == ["compaction", "end"]
    wrong_call = dict(stored, tool_calls=[dict(call, arguments={"a": 2})])
    episode = TokenAccumulator(tokenizer, [user])
    sampled_turn(tokenizer, episode, '<tool_call>{"name": "add"}</tool_call>', stored)
    assert episode.continue_with([user, wrong_call, result]) == "seal"
