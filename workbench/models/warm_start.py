"""Warm start: a short supervised fine-tune on a plugin's `warm_start` completions, cached on disk.

A tiny random model never earns a reward, so RL has nothing to compare; a recipe may name a
number of supervised steps on completions its plugin writes (deliberately imperfect ones), and
the RL run starts from the result. The checkpoint is keyed by everything that shapes it.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch


def chat_prompt_ids(tokenizer, env, sample: dict) -> list[int]:
    """Token ids of the rendered first turn of `env` on `sample`, ending in the generation prompt."""
    messages = ([{"role": "system", "content": env.system_prompt}] if env.system_prompt else [])
    messages.append({"role": "user", "content": env.reset(sample)})
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def warm_started_path(base: Path, plugin, plugin_source: str, steps: int, lr: float, seed: int) -> Path:
    key = hashlib.sha256(f"{base.resolve()}|{plugin_source}|{steps}|{lr}|{seed}".encode()).hexdigest()[:12]
    target = base.parent / f"{base.name}-warm-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoTokenizer

    from workbench.engines.torch_engine import load_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = load_causal_lm(str(base)).train()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    samples = plugin.make_dataset(4096, seed + 1)
    env = plugin.AgentRunner()
    prompt_cache: dict[str, list[int]] = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        batch = rng.sample(samples, 64)
        rows = []
        for sample in batch:
            key = repr(sorted(sample.items()))
            if key not in prompt_cache:
                prompt_cache[key] = chat_prompt_ids(tokenizer, env, sample)
            prompt = prompt_cache[key]
            completion = tokenizer(plugin.warm_start(sample, rng))["input_ids"] + [tokenizer.eos_token_id]
            rows.append((prompt + completion, len(prompt)))
        longest = max(len(ids) for ids, _ in rows)
        input_ids = torch.full((len(rows), longest), tokenizer.pad_token_id)  # [batch, seq]
        labels = torch.full((len(rows), longest), -100)
        for row, (ids, prompt_len) in enumerate(rows):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, prompt_len:len(ids)] = torch.tensor(ids[prompt_len:])
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target
