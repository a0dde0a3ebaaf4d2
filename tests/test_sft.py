"""`molt-wb sft`: supervised fine-tuning on conversations through the RL learner, as a run.

A conversation becomes a token-exact demonstration (its assistant turns, each with its stop
token, are the only trainable tokens); `Learner.sft` steps it with the loss `sft` (minus the token
mean of log π over them); the run is in the store like an RL run: segments, tokens, metrics and
checkpoints that `eval` and `export` read.
"""

import base64
import io
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from workbench import cli
from workbench.algo.losses import masked_mean, token_logprobs
from workbench.api import load_plugin
from workbench.learner.batch import collate
from workbench.models.multimodal import ImageCodec, forward_inputs, load_policy
from workbench.models.tiny import tiny_model_path
from workbench.run.checkpoint import saved
from workbench.run.sft import conversations, demonstration, teacher_batches, warm_started_path
from workbench.store import list_runs, open_run


def addition(a: int, b: int) -> dict:
    """A row of a conversations file: a one-digit answer."""
    question = {"role": "user", "content": f"What is {a} + {b}?"}
    answer = {"role": "assistant", "content": str(a + b)}
    return {"messages": [{"role": "system", "content": "Add."}, question, answer]}


def jsonl(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sft(*args: str):
    """`molt-wb sft ARGS`, in this process."""
    return CliRunner().invoke(cli.app, ["sft", *args, "tracking=none", "run.progress=false"])


def test_only_assistant_turns_are_trainable_each_with_its_stop_token(tokenizer):
    messages = addition(1, 3)["messages"]
    messages += [{"role": "user", "content": "And 2 + 3?"}, {"role": "assistant", "content": "5"}]
    [segment] = demonstration(tokenizer, None, messages)
    four = tokenizer("4", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    five = tokenizer("5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # by hand: the template's render of the first two messages, the answer as the policy would
    # sample it, the follow-up question as the template renders it after the answer, the answer
    render = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(render, add_special_tokens=False)["input_ids"]
    whole = tokenizer.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True)
    context = tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert segment.token_ids.tolist() == context + five
    assert context[: len(prompt) + 2] == prompt + four
    between = len(context) - len(prompt) - 2
    assert segment.loss_mask.tolist() == [0] * len(prompt) + [1, 1] + [0] * between + [1, 1]
    trained = tokenizer.decode(segment.token_ids[segment.loss_mask == 1])
    assert trained == f"4{tokenizer.eos_token}5{tokenizer.eos_token}"


def test_sft_lowers_the_loss_of_the_answers_in_a_run_with_a_checkpoint_that_loads(
    tmp_path, tiny_path
):
    data = jsonl(tmp_path / "add.jsonl", [addition(a, b) for a in range(3) for b in range(3)])
    root = tmp_path / "runs"
    settings = ["trainer.steps=8", "trainer.prompts_per_step=4", "trainer.checkpoint_every=4"]
    result = sft(data, f"run.root={root}", "run.id=add", "trainer.lr=3e-3", *settings)
    assert result.exit_code == 0, result.output
    assert "run add finished" in result.output
    db = open_run("add", str(root))
    losses = db.execute(
        "select value from metrics where key = 'loss/policy' order by step"
    ).fetchall()
    assert len(losses) == 8 and losses[-1][0] < 0.6 * losses[0][0], losses
    # each answer is one digit and the stop token: 2 trainable tokens a conversation, 8 a step
    tokens = db.execute("select distinct value from metrics where key = 'loss/tokens'").fetchall()
    assert tokens == [(8.0,)]
    assert db.execute("select count(*), sum(num_sampled) from segments").fetchone() == (32, 64)
    assert db.execute("select sum(loss_mask) from tokens").fetchone() == (64,)
    [run] = list_runs(str(root))
    assert (run["recipe"], run["status"], run["steps_done"]) == ("sft", "finished", 8)
    assert [folder.name for folder in saved(root / "add")] == ["step-000004", "step-000008"]
    # the last checkpoint loads, and puts the answers of the data above where the base had them
    batch = collate([s for conversation in conversations(data, tiny_path) for s in conversation])
    inputs = {"input_ids": batch.token_ids, "attention_mask": batch.attention_mask}

    def answer_loss(path) -> float:
        with torch.no_grad():
            logits = load_policy(str(path))(**inputs).logits
        return -float(masked_mean(token_logprobs(logits, batch.token_ids), batch.loss_mask))

    trained = answer_loss(root / "add" / "checkpoints" / "step-000008" / "policy")
    assert trained < 0.6 * answer_loss(tiny_path)
    assert trained == pytest.approx(losses[-1][0], rel=0.3)


def test_parquet_conversations_with_an_image_train_the_vision_language_policy(tmp_path):
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (56, 56), "red").save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    # Parquet columns have one type: every content is a list of parts
    question = [
        {"type": "image_url", "image_url": {"url": url}, "text": None},
        {"type": "text", "text": "What colour is it?", "image_url": None},
    ]
    answer = [{"type": "text", "text": "Red.", "image_url": None}]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    pq.write_table(pa.Table.from_pylist([{"messages": messages}] * 2), tmp_path / "red.parquet")
    root = tmp_path / "runs"
    settings = ["trainer.steps=2", "trainer.prompts_per_step=2", "model=tiny-vl"]
    result = sft(str(tmp_path / "red.parquet"), f"run.root={root}", "run.id=red", *settings)
    assert result.exit_code == 0, result.output
    db = open_run("red", str(root))
    images = db.execute("select images from segments").fetchall()
    assert len(images) == 4 and all(len(row[0]) == 1 for row in images)
    assert (root / "red" / "images" / images[0][0][0]).exists()
    # the image's run of placeholders: resized up to the processor's least 112 x 112 pixels, it is
    # 8 x 8 patches of 14, merged 2 x 2
    codec = ImageCodec(str(tiny_model_path("tiny-vl")))
    placeholders = db.execute(
        "select count(*) from tokens where token_id = ? and step = 0 and rollout_id = 0",
        [codec.placeholder_id],
    ).fetchone()
    assert placeholders == (codec.placeholders(png.getvalue()),) == (16,)


picture = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
answer = {"role": "assistant", "content": "A square."}


def test_the_warm_start_matches_a_plain_adamw_loop_on_the_transformers_loss(tmp_path, tiny_path):
    """The warm start before it went through the learner: transformers' mean loss over the labels,
    torch's AdamW defaults (weight decay 0.01), no gradient clip. Measured: the weights agree to
    6.5e-6 after 2 steps (float rounding); with weight decay 0 they would differ by 6.2e-5."""
    arith = load_plugin("arith")
    base = tmp_path / "tiny"
    shutil.copytree(tiny_path, base)
    path = warm_started_path(base, arith, "source", steps=2, lr=3e-3, seed=0, batch=8)
    model = load_policy(str(base)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = teacher_batches(arith, str(base), 0, 8)
    for _ in range(2):
        batch = collate(next(batches))
        labels = batch.token_ids.masked_fill(~batch.loss_mask, -100)
        inputs = forward_inputs(model, batch.token_ids, batch.attention_mask)
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    warm = load_policy(str(path)).state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(warm[name], value, atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ('{"text": "hi"}\n', "Row 1 of {path} has no `messages` column of chat messages"),
        ("not json\n", "Data set {path} is not JSON lines"),
        (
            json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n",
            "Row 1 of {path} has no assistant message to train on: add one.",
        ),
        ("\n", "{path} holds no conversation: give one row per conversation."),
        (
            json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"id": "1"}]}]}) + "\n",
            "Row 1 of {path} has no `messages` column of chat messages (a tool call written into",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": [picture]}, answer]}) + "\n",
            "Row 1 of {path}: an image must be inline base64 data of a PNG or JPEG",
        ),
    ],
)
def test_a_bad_conversations_file_is_refused_with_one_sentence(tmp_path, content, error):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    result = sft(str(path), f"run.root={tmp_path / 'runs'}")
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {error.format(path=path)}")
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()
