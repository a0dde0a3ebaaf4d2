"""The CPU rollout engine: batched sampling with a KV cache on a transformers causal LM.

Prompts are left-padded into one batch (position ids follow the attention mask, so padding changes
nothing a sequence sees); each step samples from softmax(logits / temperature) and records the
sampled id's log-prob under exactly that distribution. Temperature 0 is greedy decoding, with
log-probs of the untempered distribution.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from workbench.engines.base import Generation, SamplingParams


def set_threads(count: int) -> None:
    """torch threads of this process (0 = one per core); Ray actors otherwise get one."""
    torch.set_num_threads(count or os.cpu_count() or 1)


def load_causal_lm(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))


class TorchEngine:
    def __init__(self, model_path: str, dtype: str = "float32", seed: int = 0):
        self.model = load_causal_lm(model_path, dtype).eval()
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0

    def load_weights(self, state_dict: dict, version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[np.ndarray], params: SamplingParams) -> list[Generation]:
        batch, longest = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, longest), self.pad_token_id, dtype=torch.long)  # [batch, seq]
        attention = torch.zeros((batch, longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            attention[row, longest - len(prompt):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        generator = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long)

        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        sampled, logprobs = [], []
        done = torch.zeros(batch, dtype=torch.bool)
        for _ in range(params.max_tokens):
            logits = out.logits[:, -1].float()  # [batch, vocab]
            if params.temperature > 0:
                dist = torch.log_softmax(logits / params.temperature, dim=-1)
                token = torch.multinomial(dist.exp(), 1, generator=generator).squeeze(-1)
            else:
                dist = torch.log_softmax(logits, dim=-1)
                token = dist.argmax(-1)
            token = torch.where(done, self.pad_token_id, token)
            sampled.append(token)
            logprobs.append(dist.gather(-1, token[:, None]).squeeze(-1))
            done |= torch.isin(token, stop)
            if bool(done.all()):
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long)], dim=-1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                             cache=out.cache, use_cache=True)

        tokens = torch.stack(sampled, dim=1).numpy()  # [batch, new]
        token_logprobs = torch.stack(logprobs, dim=1).numpy()
        results = []
        for row in range(batch):
            hits = np.flatnonzero(np.isin(tokens[row], stop.numpy()))
            end = int(hits[0]) + 1 if len(hits) else tokens.shape[1]
            results.append(Generation(tokens[row, :end].astype(np.int32), token_logprobs[row, :end].astype(np.float32),
                                      self.version, "stop" if len(hits) else "length"))
        return results
