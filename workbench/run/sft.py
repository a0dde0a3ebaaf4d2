"""Supervised fine-tuning through the learner: conversations become token-exact demonstrations
and `Learner.sft` steps (the loss `sft`: minus the token mean of log π over assistant tokens).

`molt-wb sft DATA` trains on a file of conversations as a run (segments, the metrics `loss/*`,
checkpoints); the warm start of an RL recipe is the same steps on its plugin's `warm_start`
completions, cached on disk under a key of everything that shapes it.
"""

import hashlib
import math
import random
from pathlib import Path

from workbench.config import AlgoConfig, Config, TrainerConfig
from workbench.invariants.token_identity import TokenAccumulator
from workbench.learner.learner import Learner
from workbench.models.multimodal import ImageCodec, is_vision_language
from workbench.models.state import save_policy
from workbench.models.tiny import built_into, one_builder
from workbench.rollout.worker import opening_messages
from workbench.run import run_folder
from workbench.run.checkpoint import commit
from workbench.run.data import load_samples
from workbench.run.progress import Task, stage
from workbench.segment import Segment
from workbench.server.wires.base import WireError, user_content
from workbench.store.actor import StoreActor
from workbench.store.query import root_option

# what every `molt-wb sft` run is: one local learner, its loss at the model's own temperature
SETTINGS = ["algo.policy_loss=sft", "engine.temperature=1", "ray.learner_workers=1"]


def encoders(model_path):
    """The tokenizer and image codec (None for a text-only policy) of a checkpoint."""
    from transformers import AutoTokenizer

    codec = ImageCodec(model_path) if is_vision_language(model_path) else None
    return AutoTokenizer.from_pretrained(model_path), codec


def demonstration(tokenizer, codec, messages, tools=None, index=0):
    """The Segment records of one conversation, built as a rollout builds an episode: the messages
    before the first assistant turn open it, each assistant turn is appended as if sampled (its
    text's ids and the stop token: trainable), every other message as the template renders it."""
    first = next(k for k, message in enumerate(messages) if message["role"] == "assistant")
    episode = TokenAccumulator(tokenizer, messages[:first], tools, codec)
    for message in messages[first:]:
        if message["role"] != "assistant":
            episode.add_messages([message])
            continue
        ids = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        ids.append(tokenizer.eos_token_id)
        episode.add_sampled(ids, [0.0] * len(ids), 0, message, "stop")
    return [
        Segment(
            "",
            index,
            piece,
            index,
            **part.arrays(),
            turn_spans=part.turn_spans,
            seal_reason=part.seal_reason,
            images=part.images,
        )
        for piece, part in enumerate(episode.finish())
    ]


def conversations(path, model_path):
    """The demonstrations of a .jsonl or .parquet file whose `messages` column holds OpenAI chat
    conversations (content a string, or text and `image_url` parts of inline base64 images) and an
    optional `tools` column of OpenAI tool schemas; ValueError names a bad file or row."""
    if not Path(path).is_file() or not path.endswith((".jsonl", ".parquet")):
        raise ValueError(f"{path} is not a .jsonl or .parquet file: give a file of conversations.")
    tokenizer, codec = encoders(model_path)
    found = []
    for index, row in enumerate(load_samples(path)):
        where = f"Row {index + 1} of {path}"
        messages = row.get("messages") if isinstance(row, dict) else None
        # a structured tool call would be dropped: the text the model emits is what trains
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and not m.get("tool_calls") for m in messages
        ):
            raise ValueError(
                f"{where} has no `messages` column of chat messages (a tool call written into "
                f"its message's content): give each row one."
            )
        if not any(m.get("role") == "assistant" for m in messages):
            raise ValueError(f"{where} has no assistant message to train on: add one.")
        try:
            read = [
                {"role": m["role"], "content": user_content(m.get("content"), where)}
                for m in messages
            ]
        except WireError as error:
            raise ValueError(str(error)) from None
        # a `tools` column: the tools the template lists, as a rollout's
        found.append(demonstration(tokenizer, codec, read, row.get("tools"), index))
    if not found:
        raise ValueError(f"{path} holds no conversation: give one row per conversation.")
    return found


def epochs(demonstrations: list[list[Segment]], size, seed):
    """Each step's segments: `size` conversations, epoch after epoch, each in a seeded order."""
    rng = random.Random(seed)
    order = []
    while True:
        batch = []
        for _ in range(size):
            order = order or rng.sample(range(len(demonstrations)), len(demonstrations))
            batch += demonstrations[order.pop()]
        yield batch


def fine_tune(cfg, model_path, batches, label, store=None, run_dir=None):
    """`trainer.steps` supervised steps of a local learner, one per batch of `batches`; with a run
    `store`, each step's segments and metrics go to it and checkpoints to `run_dir` (every
    `trainer.checkpoint_every` steps and at the last)."""
    learner = Learner(cfg, model_path)
    bar = Task(label, cfg.trainer.steps, cfg.run.progress)
    every = cfg.trainer.checkpoint_every
    for step in range(cfg.trainer.steps):
        segments = next(batches)
        metrics, rows = learner.sft(segments)
        bar.update(step + 1, f"loss {metrics['loss/policy']:.3f}")
        if store is None:
            continue
        store.write_step(step, metrics, rows, segments)
        if every and ((step + 1) % every == 0 or step + 1 == cfg.trainer.steps):
            # laid out as a training run's checkpoint
            temporary = Path(run_dir, "checkpoints", f"step-{step:06d}.tmp")
            learner.save_checkpoint(str(temporary), {})
            commit(cfg, run_dir, temporary, learner.version, store.checkpoint())
    bar.close()
    return learner


def run(cfg, demonstrations: list[list[Segment]], model_path):
    """`molt-wb sft`: `trainer.steps` steps of `trainer.prompts_per_step` conversations, a run of
    the store (`molt-wb runs` lists it as recipe sft); the line that says where it is."""
    run_dir, row = run_folder.start_run(cfg)
    cfg = run_folder.plain(cfg)
    store = StoreActor(cfg, str(run_dir), row | {"recipe": "sft"})
    try:
        batches = epochs(demonstrations, cfg.trainer.prompts_per_step, cfg.seed)
        fine_tune(cfg, model_path, batches, "sft", store, run_dir)
    except BaseException:
        store.close("failed")
        raise
    store.close("finished")
    inspect = f"molt-wb inspect {cfg.run.id}{root_option(cfg.run.root)}"
    return f"run {cfg.run.id} finished: {run_dir}; {inspect}"


# ---- the warm start: a tiny random model never earns a reward, so RL would have nothing to compare


def teacher_batches(plugin, model_path, seed, size):
    """Each step's demonstrations of the plugin's `warm_start` teacher, `size` samples drawn anew
    (and the teacher's completions with them) from one seeded stream."""
    tokenizer, codec = encoders(model_path)
    rng = random.Random(seed)
    samples = plugin.make_dataset(4096, seed + 1)
    env = plugin.AgentRunner()
    # (sample index, completion) -> its demonstration
    cache = {}
    while True:
        batch = []
        for index in rng.sample(range(len(samples)), size):
            completion = plugin.warm_start(samples[index], rng)
            key = (index, repr(completion))
            if key not in cache:
                if isinstance(completion, str):
                    completion = [{"role": "assistant", "content": completion}]
                messages = opening_messages(env, samples[index]) + completion
                cache[key] = demonstration(tokenizer, codec, messages, env.tools, len(cache))
            batch += cache[key]
        yield batch


def warm_started_path(base: Path, plugin, plugin_source, steps, lr, seed, batch=64):
    """`base` after `steps` supervised steps on `batch` demonstrations each of the plugin's
    teacher, built once and kept beside it."""
    key = hashlib.sha256(
        f"learner sft|{base.resolve()}|{plugin_source}|{steps}|{lr}|{seed}|{batch}".encode()
    ).hexdigest()[:12]
    target = base.parent / f"{base.name}-warm-{key}"
    if (target / "config.json").exists():
        return target
    with one_builder(target):
        return _warm_start(target, base, plugin, steps, lr, seed, batch)


def _warm_start(target: Path, base: Path, plugin, steps, lr, seed, batch) -> Path:
    """Build the warm start into `target`, unless a builder before this one did."""
    if (target / "config.json").exists():
        return target
    # torch's AdamW defaults (weight decay 0.01) and no gradient clip: the optimizer the recipes'
    # warm starts were tuned and measured with
    trainer = TrainerConfig(steps=steps, lr=lr, weight_decay=0.01, max_grad_norm=math.inf)
    cfg = Config(seed=seed, algo=AlgoConfig(policy_loss="sft"), trainer=trainer)
    batches = teacher_batches(plugin, str(base), seed, batch)
    learner = fine_tune(cfg, str(base), batches, f"warm start {base.name}")
    with built_into(target) as staging, stage(f"saving {target.name}"):
        save_policy(learner, staging)
    return target
