"""The geo3k recipe: a vision-language policy whose images, placeholders and tool turns stay
token-exact.

Rollout (left-padded, KV cache) and learner (right-padded, one forward) must compute the same model
with images in the sequence; image placeholders are never trainable; images reach the engine from
both the Env path and the OpenAI wire; the Env's tool turn runs the sandbox; the recipe runs end to
end.
"""

import base64
import io
import json
import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from openai import BadRequestError, OpenAI
from PIL import Image
from transformers import AutoTokenizer

from workbench.algo.losses import token_logprobs
from workbench.api import geo3k_reward, load_plugin
from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.token_identity import TokenAccumulator
from workbench.models.multimodal import ImageCodec, forward_inputs, load_policy
from workbench.models.tiny import tiny_model_path
from workbench.rollout.worker import opening_messages
from workbench.run.data import Prompts
from workbench.run.sft import demonstration
from workbench.server.loopback import LoopbackServer
from workbench.store import nonfinite, open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

geo3k = load_plugin("geo3k")
geo3k_data = load_plugin("geo3k_data")


@pytest.fixture(scope="module")
def vl_path():
    return str(tiny_model_path("tiny-vl"))


@pytest.fixture(scope="module")
def engine(vl_path):
    return TorchEngine(vl_path, seed=3)


@pytest.fixture(scope="module")
def samples():
    return geo3k.make_dataset(10, 7)


def test_image_placeholders_expand_per_image_and_are_never_trainable(engine, samples):
    tokenizer = AutoTokenizer.from_pretrained(engine.model.name_or_path)
    messages = [{"role": "user", "content": geo3k.user_content(samples[0])}]
    episode = TokenAccumulator(tokenizer, messages, codec=engine.codec)
    ids = episode.token_ids
    placeholders = int((ids == engine.codec.placeholder_id).sum())
    # 112x112 pixels = 8x8 patches of 14, merged 2x2
    assert placeholders == 16
    assert episode.open.images == samples[0]["images"]
    assert not any(episode.open.loss_mask)
    with pytest.raises(ValueError, match="no vision tower"):
        # a text-only policy cannot take the image
        TokenAccumulator(tokenizer, messages)


def test_rollout_and_learner_compute_the_same_model_with_images(engine, samples):
    """Left-padded sampling with M-RoPE and a KV cache vs one right-padded forward: same
    log-probs."""
    tokenizer = AutoTokenizer.from_pretrained(engine.model.name_or_path)
    episodes = [
        TokenAccumulator(
            tokenizer,
            [
                {"role": "system", "content": geo3k.SYSTEM},
                {"role": "user", "content": geo3k.user_content(s)},
            ],
            codec=engine.codec,
        )
        for s in samples[:3]
    ]
    # unequal lengths
    episodes[1].add_messages([{"role": "user", "content": "Look again, carefully, at the figure."}])
    params = SamplingParams(max_tokens=10, stop_token_ids=(tokenizer.eos_token_id,))
    generations = engine.generate(
        [e.token_ids for e in episodes], params, [e.open.images for e in episodes]
    )
    for episode, generation in zip(episodes, generations, strict=True):
        episode.add_sampled(
            generation.token_ids,
            generation.logprobs,
            generation.versions,
            {"role": "assistant", "content": "x"},
            generation.finish_reason,
        )
    longest = max(len(e.open.token_ids) for e in episodes)
    ids = torch.zeros((3, longest), dtype=torch.long)
    attention = torch.zeros((3, longest), dtype=torch.long)
    for row, episode in enumerate(episodes):
        ids[row, : len(episode.open.token_ids)] = torch.tensor(episode.open.token_ids)
        attention[row, : len(episode.open.token_ids)] = 1
    with torch.no_grad():
        inputs = forward_inputs(
            engine.model, ids, attention, [e.open.images for e in episodes], engine.codec
        )
        learner = token_logprobs(engine.model(**inputs).logits, ids, 1.0)
    for row, episode in enumerate(episodes):
        mask = np.asarray(episode.open.loss_mask, dtype=bool)
        behavior = np.asarray(episode.open.behavior_logprob)[mask]
        assert mask.sum() >= 1
        np.testing.assert_allclose(learner[row, : len(mask)].numpy()[mask], behavior, atol=1e-4)
    # the image matters: the same ids with another image give other log-probs
    other = [samples[5]["images"], episodes[1].open.images, episodes[2].open.images]
    with torch.no_grad():
        changed = token_logprobs(
            engine.model(
                **forward_inputs(engine.model, ids, attention, other, engine.codec)
            ).logits,
            ids,
            1.0,
        )
    assert not torch.allclose(changed[0], learner[0])


def test_env_runs_the_tool_in_the_sandbox_and_grades_the_answer(samples):
    env = geo3k.AgentRunner()
    sample = next(s for s in samples if s["kind"] == "triangle_angle")
    env.reset(sample)
    code = f"print({geo3k.expression(sample)})"
    call = json.dumps({"name": "python_executor", "arguments": {"code": code}})
    turn = env.step(f"Let me compute. <tool_call>{call}</tool_call>")
    assert (turn.terminated, turn.role) == (False, "tool")
    assert turn.observation.strip() == sample["answer"]
    assert (
        "Error: ZeroDivisionError"
        in env.step(
            '<tool_call>{"name": "python_executor", "arguments": {"code": "1/0"}}</tool_call>'
        ).observation
    )
    assert (
        "Error: call python_executor" in env.step("<tool_call>{not json}</tool_call>").observation
    )
    final = env.step(f"The third angle is <answer>{sample['answer']}°</answer>")
    assert final.terminated and final.reward == pytest.approx(1.0)
    wrong = next(c for c in sample["choices"] if c != sample["answer"])
    assert env.step(f"So <answer>{wrong}</answer>").reward == pytest.approx(0.1)  # format only
    assert env.step("no idea").reward == 0.0


@pytest.mark.parametrize("submitted, reward", [("right", 1.0), ("wrong", 0.1)])
def test_a_program_that_calls_final_answer_ends_the_episode_graded(samples, submitted, reward):
    env = geo3k.AgentRunner()
    sample = next(s for s in samples if s["kind"] == "circle")
    env.reset(sample)
    value = geo3k.expression(sample)
    if submitted == "wrong":
        value = f"{value} + 1"
    call = json.dumps({"name": "python_executor", "arguments": {"code": f"final_answer({value})"}})
    final = env.step(f"<tool_call>{call}</tool_call>")
    assert final.terminated and final.reward == pytest.approx(reward)
    assert final.info["tool_calls"] == 1


def test_each_kinds_one_expression_answers_every_problem_from_the_stated_values_alone():
    """Run in the sandbox after the prelude, a kind's one expression answers every problem of the
    kind: the question's numbers come in `values`, the code copies none of them."""
    samples = geo3k.make_dataset(20, 11)
    assert {s["kind"] for s in samples} == set(geo3k_data.KINDS)
    for sample in samples:
        code = f"final_answer({geo3k.expression(sample)})"
        assert not any(str(v) in code for v in geo3k.stated_values(sample) if v > 2)
        submitted = geo3k.run_program(code, sample)
        assert submitted == geo3k.printed(code, sample) + "\n"
        assert geo3k.grade(code, submitted, sample)[0] == pytest.approx(1.0)


def test_values_are_the_numbers_the_question_states():
    for sample in geo3k.make_dataset(10, 2):
        drawn = [v for v in sample["values"].values() if isinstance(v, int)]
        assert geo3k.stated_values(sample) == drawn


def test_the_teacher_submits_with_the_tool_always_rightly_and_else_answers_wrongly():
    samples = geo3k.make_dataset(50, 5)
    rng = random.Random(0)
    tool_episodes = 0
    for sample in samples * 4:
        episode = geo3k.warm_start(sample, rng)
        if isinstance(episode, list):
            tool_episodes += 1
            # looks at the value, then submits it
            env = geo3k.AgentRunner()
            env.reset(sample)
            looked = env.step(episode[0]["content"])
            assert looked.observation == episode[1]["content"]
            assert env.step(episode[2]["content"]).reward == pytest.approx(1.0)
        else:
            reward, _ = geo3k_reward(episode, sample["answer"], sample["choices"])
            assert reward == pytest.approx(0.1)  # the format only
    assert tool_episodes / 200 == pytest.approx(geo3k.TOOL_SHARE, abs=0.05)


def test_warm_start_demonstrates_tool_episodes_token_exactly(vl_path, samples):
    tokenizer = AutoTokenizer.from_pretrained(vl_path)
    codec = ImageCodec(vl_path)
    rng = random.Random(0)
    episodes = [geo3k.warm_start(samples[k % 5], rng) for k in range(40)]
    tool_episode = next(e for e in episodes if isinstance(e, list))
    env = geo3k.AgentRunner()
    opening = opening_messages(env, samples[episodes.index(tool_episode) % 5])
    [segment] = demonstration(tokenizer, codec, opening + tool_episode, env.tools)
    ids = segment.token_ids.tolist()
    images = segment.images
    trained = tokenizer.decode(segment.token_ids[segment.loss_mask == 1])
    # both calls, the look and the submission, are targets
    assert trained.count("<tool_call>") == 2 and "final_answer(" in trained
    # the tool's output is context, not a target
    assert "<tool_response>" not in trained
    assert len(images) == 1 and sum(1 for i in ids if i == codec.placeholder_id) == 16


def _data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def test_openai_image_blocks_reach_the_engine_and_bad_images_are_refused(
    engine, samples, tiny_path
):
    tokenizer = AutoTokenizer.from_pretrained(engine.model.name_or_path)
    server = LoopbackServer(
        engine, tokenizer, SamplingParams(max_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    )
    text_server = LoopbackServer(
        TorchEngine(tiny_path),
        AutoTokenizer.from_pretrained(tiny_path),
        SamplingParams(max_tokens=4),
    )
    try:
        session = server.open_session(0)
        client = OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        content = [
            {"type": "image_url", "image_url": {"url": _data_url(samples[0]["images"][0])}},
            {"type": "text", "text": "Find x."},
        ]
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": content}], max_tokens=6
        )
        (segment,), requests = server.close_session(session["session"])
        assert segment.images == samples[0]["images"]
        assert segment.token_ids.count(engine.codec.placeholder_id) == 16
        bad = server.open_session(1)
        client = OpenAI(base_url=bad["openai_base_url"], api_key=bad["api_key"], max_retries=0)
        for url in ("https://example.com/x.png", "data:image/png;base64,bm90IGFuIGltYWdl"):
            with pytest.raises(BadRequestError, match="inline base64"):
                client.chat.completions.create(
                    model="policy",
                    max_tokens=4,
                    messages=[
                        {
                            "role": "user",
                            "content": [{"type": "image_url", "image_url": {"url": url}}],
                        }
                    ],
                )
        assert server.close_session(bad["session"])[0] == []  # nothing recorded
        text = text_server.open_session(2)
        client = OpenAI(base_url=text["openai_base_url"], api_key=text["api_key"], max_retries=0)
        with pytest.raises(BadRequestError, match="no vision tower"):
            client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": content}], max_tokens=4
            )
    finally:
        server.stop()
        text_server.stop()


def test_real_shape_file_trains_through_the_plugin_reader(tmp_path, samples):
    """data.path goes through the plugin's own reader: hiyouga-shaped Parquet with {"bytes": ...}
    images."""
    rows = [
        {
            "images": [{"bytes": s["images"][0], "path": None}],
            "problem": s["problem"],
            "answer": s["answer"],
        }
        for s in samples[:4]
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    cfg = compose_config(["+recipe=geo3k", f"data.path={tmp_path / 'train.parquet'}"])
    prompts = Prompts(cfg)
    assert [s["images"] for s in prompts.samples] == [s["images"] for s in samples[:4]]
    Image.open(io.BytesIO(prompts.samples[0]["images"][0])).verify()


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["geo3k", "chat_geo3k"])
def test_geo3k_recipe_runs_end_to_end(tmp_path, plugin):
    """Both agent forms, a few steps from the recipe's warm-started tiny VL policy (the one
    tests/test_geo3k_learning.py trains on: built once for both): segments hold images, tool turns,
    rewards."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "train",
            "+recipe=geo3k",
            f"agent.plugin={plugin}",
            "trainer.steps=2",
            "trainer.prompts_per_step=2",
            "trainer.group_size=4",
            f"run.root={tmp_path}",
            "run.id=geo",
            "tracking.wandb.mode=disabled",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "molt-wb inspect geo" in run.stdout + run.stderr
    db = open_run("geo", root=str(tmp_path))
    rows = db.execute("select images, turn_spans, reward, num_sampled from segments").fetchall()
    assert len(rows) == 16
    assert all(
        len(images) == 1 and (tmp_path / "geo" / "images" / images[0]).exists()
        for images, *_ in rows
    )
    # some episode called the tool and answered after it
    assert max(len(spans) for _, spans, _, _ in rows) >= 2
    assert all(0.0 <= reward <= 1.0 for *_, reward, _ in rows)
    assert db.execute("select max(reward) from segments").fetchone()[0] > 0
    # every stored metric and per-token float is finite (entropy and the mismatch were NaN)
    assert nonfinite.scan(db) == {}


def test_vision_markers_get_no_probability_in_any_forward(tmp_path):
    """A sampled image placeholder would have no image behind it: the policy's logits for the
    vision markers are -inf in every forward (engine, learner, warm start), so they are never
    sampled or trained."""
    model = load_policy(str(tiny_model_path("tiny-vl")))
    config = model.config
    ids = torch.tensor([[config.vision_start_token_id, config.image_token_id, 9, 10, 11]])
    logits = model(input_ids=ids[:, 2:]).logits  # text only
    banned = [config.image_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert torch.isneginf(logits[..., banned]).all() and torch.isfinite(logits[..., 12]).all()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 3:])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
