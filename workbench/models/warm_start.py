"""Warm start: a short supervised fine-tune on a plugin's `warm_start` completions, cached on disk.

A tiny random model never earns a reward, so RL has nothing to compare; a recipe may name a
number of supervised steps on completions its plugin writes (deliberately imperfect ones), and
the RL run starts from the result. The checkpoint is keyed by everything that shapes it.
"""

import hashlib
import random
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from workbench.engines.torch_engine import load_causal_lm
from workbench.invariants.token_identity import TokenAccumulator
from workbench.models.multimodal import ImageCodec, forward_inputs, is_vision_language
from workbench.models.tiny import built_into
from workbench.progress import Task, stage
from workbench.rollout import opening_messages


def demonstration(
    tokenizer, codec, env, sample: dict, completion
) -> tuple[list[int], list[int], list[bytes]]:
    """(ids, trainable mask, images) of one demonstrated episode, built as a rollout builds it:
    `completion` is the assistant's text, or a list of turns
    `{"role": "assistant" | "tool" | "user", "content": ...}`."""
    episode = TokenAccumulator(tokenizer, opening_messages(env, sample), env.tools, codec)
    turns = completion
    if isinstance(completion, str):
        turns = [{"role": "assistant", "content": completion}]
    for turn in turns:
        if turn["role"] == "assistant":
            ids = tokenizer(turn["content"], add_special_tokens=False)["input_ids"]
            ids.append(tokenizer.eos_token_id)
            episode.add_sampled(ids, [0.0] * len(ids), 0, turn, "stop")
        else:
            episode.add_messages([turn])
    piece = episode.finish()[-1]
    return piece.token_ids, piece.loss_mask, piece.images


def warm_started_path(
    base: Path, plugin, plugin_source: str, steps: int, lr: float, seed: int, batch: int = 64
) -> Path:
    key = hashlib.sha256(
        f"{base.resolve()}|{plugin_source}|{steps}|{lr}|{seed}|{batch}".encode()
    ).hexdigest()[:12]
    target = base.parent / f"{base.name}-warm-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    codec = ImageCodec(str(base)) if is_vision_language(str(base)) else None
    model = load_causal_lm(str(base)).train()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    samples = plugin.make_dataset(4096, seed + 1)
    env = plugin.AgentRunner()
    # (sample index, completion) -> its demonstration
    cache = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    bar = Task(f"warm start {base.name}", steps)
    for step in range(steps):
        rows = []
        for index in rng.sample(range(len(samples)), batch):
            completion = plugin.warm_start(samples[index], rng)
            episode_key = (index, repr(completion))
            if episode_key not in cache:
                cache[episode_key] = demonstration(
                    tokenizer, codec, env, samples[index], completion
                )
            rows.append(cache[episode_key])
        ids = [torch.tensor(row_ids) for row_ids, _, _ in rows]
        # [batch, seq], right-padded; only the demonstrated turns are labels
        input_ids = pad_sequence(ids, batch_first=True, padding_value=tokenizer.pad_token_id)
        attention = pad_sequence([torch.ones_like(row) for row in ids], batch_first=True)
        masks = [torch.tensor(mask, dtype=torch.bool) for _, mask, _ in rows]
        trained = [row.where(mask, -100) for row, mask in zip(ids, masks, strict=True)]
        labels = pad_sequence(trained, batch_first=True, padding_value=-100)
        inputs = forward_inputs(
            model, input_ids, attention, [images for _, _, images in rows], codec
        )
        loss = model(**inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.update(step + 1, f"loss {loss.item():.3f}")
    bar.close()
    with built_into(target) as staging:
        with stage(f"saving {target.name}"):
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if codec is not None:
            codec.processor.save_pretrained(staging)
    return target
