"""The CPU rollout engine: batched sampling with a KV cache on a transformers causal LM.

Prompts are left-padded into one batch (position ids follow the attention mask, so padding changes
nothing a sequence sees); each step samples from softmax(logits / temperature) and records the
sampled id's log-prob under exactly that distribution (top-p truncated and renormalised when
top_p < 1), and beside it its raw log-prob, before the truncation (`extras["raw_logprobs"]`: the
off-policy gap's sampler part is raw less processed, models/gap.py). Temperature 0 is greedy
decoding, with log-probs of the untempered distribution.

Weights pushed while a batch is generating wait in a slot; with `partial=True` they are swapped
in between two token steps (pause, swap, resume: the KV cache of earlier tokens is kept), so one
sequence can hold tokens of several versions, each recorded.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from workbench.engines.base import Generation, Listener, SamplingParams
from workbench.invariants.routing_replay import capture_routes, find_routers
from workbench.models.lora import load_adapter, with_adapter
from workbench.models.multimodal import ImageCodec, forward_inputs, is_vision_language, load_policy
from workbench.models.prefix import cache_input, output_cache, unique_rows

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from workbench.config import LoraConfig


def set_threads(cfg: DictConfig, model: torch.nn.Module | None = None) -> None:
    """torch threads of this actor (Ray would give it one): `ray.torch_threads`; else one for a
    policy under 1M parameters (the built-in tiny ones: their matrices are too small to split, and
    waking a second thread costs more than it saves, bench/README.md); else every core when rollout
    and learner take turns (synchronous), else the cores split between them."""
    cores = os.cpu_count() or 1
    threads = cores
    if cfg.trainer.async_depth != 0:
        threads = max(1, cores // (cfg.ray.rollout_workers + 1))
    if model is not None and sum(p.numel() for p in model.parameters()) < 1_000_000:
        threads = 1
    torch.set_num_threads(cfg.ray.torch_threads or threads)


def nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs ([batch, vocab]) renormalised over the smallest set of tokens whose mass reaches
    top_p."""
    if top_p >= 1:
        return logprobs
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True)
    # the mass before this token already reaches top_p
    outside = sorted_logprobs.exp().cumsum(-1) - sorted_logprobs.exp() >= top_p
    sorted_logprobs = sorted_logprobs.masked_fill(outside, float("-inf"))
    truncated = torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_logprobs)
    return torch.log_softmax(truncated, dim=-1)


class TorchEngine:
    # seconds spent generating, all calls (bench/step_cost.py: model compute vs overhead)
    compute_s = 0.0

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        partial: bool = False,
        lora: LoraConfig | None = None,
    ):
        self.model = load_policy(model_path, dtype).eval()
        # a LoRA policy: pushes carry the adapter alone
        self.lora = bool(lora and lora.rank)
        if self.lora:
            self.model = with_adapter(self.model, lora).eval()
        self.codec = ImageCodec(model_path) if is_vision_language(model_path) else None
        self.pad_token_id = self.model.config.get_text_config().pad_token_id or 0
        self.generator = torch.Generator().manual_seed(seed)
        # then every Generation carries its routed experts
        self.moe = bool(find_routers(self.model))
        self._open_slot(partial)

    def _open_slot(self, partial: bool) -> None:
        """The weight slot, empty: pushed weights wait in it while generations or holds are under
        way (with `partial`, only until the next token step)."""
        self.version = 0
        self.partial = partial
        self._lock = threading.Lock()
        # the weights pushed last and their version, until adopted
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        # generations and holds under way
        self._busy = 0

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._pending = (state_dict, version)
            if not self._busy:
                self._swap()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep one set of weights for a whole episode: pushes wait until the block ends."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    def _enter(self) -> None:
        with self._lock:
            if not self._busy:
                self._swap()
            self._busy += 1

    def _leave(self) -> None:
        with self._lock:
            self._busy -= 1
            if not self._busy:
                self._swap()

    def _swap(self) -> None:
        """Adopt pending weights, if any (the caller holds the lock)."""
        if self._pending is not None:
            state_dict, self.version = self._pending
            if self.lora:
                load_adapter(self.model, state_dict)
            else:
                self.model.load_state_dict(state_dict)
            self._pending = None

    def generate(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None = None,
        listener: Listener | None = None,
    ) -> list[Generation]:
        """`images[i]`: the images of prompt i, in the order of its placeholder runs
        (vision-language models); `listener(i, ids)` gets prompt i's ids as they are sampled."""
        # OpenMP's thread count is per thread: the calling thread (a Ray actor thread, a loopback
        # server request) starts at OMP_NUM_THREADS or every core, not at set_threads' choice (with
        # passive waits, two threads on the tiny policy's matmuls took 1.9x as long as one)
        torch.set_num_threads(torch.get_num_threads())
        with self.hold():
            start = time.perf_counter()
            try:
                return self._generate(prompts, params, images, listener)
            finally:
                self.compute_s += time.perf_counter() - start

    def _generate(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None,
        listener: Listener | None,
    ) -> list[Generation]:
        if not self.moe:
            return self._sample(prompts, params, images, listener)
        with capture_routes(self.model) as forwards:
            generations = self._sample(prompts, params, images, listener)
        longest = max(len(p) for p in prompts)
        # [batch, seq, layers, k]
        prefill = forwards[0].reshape(len(prompts), longest, *forwards[0].shape[1:])
        for row, (prompt, generation) in enumerate(zip(prompts, generations, strict=True)):
            # token j of the reply is fed (and routed) by forward j + 1; the last sampled token
            # never is
            fed = [forwards[j][row][None] for j in range(1, len(generation.token_ids))]
            unfed = np.full((1, *prefill.shape[2:]), -1, dtype=np.int16)
            routes = [prefill[row, longest - len(prompt) :], *fed, unfed]
            generation.extras["routed_experts"] = np.concatenate(routes)
        return generations

    @torch.no_grad()
    def _sample(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None,
        listener: Listener | None,
    ) -> list[Generation]:
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        # a group's samples share their prompt: prefill each distinct prompt once (text-only, dense
        # policies); the rollout passes each prompt's (empty) image list
        distinct = prompts
        if not any(images or []) and not self.moe:
            distinct, copy_of = unique_rows(prompts)
        # [distinct, seq]
        input_ids = torch.full((len(distinct), longest), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(distinct), longest), dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, longest - len(prompt) :] = torch.as_tensor(prompt)
            attention[row, longest - len(prompt) :] = 1
        inputs = forward_inputs(self.model, input_ids, attention, images, self.codec)
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        row_generators = [torch.Generator().manual_seed(seed) for seed in params.row_seeds]
        stop = torch.tensor(params.stop_token_ids, dtype=torch.long)

        out = self.model(**inputs, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        logits = out.logits[:, -1]
        # [batch, seq], or [3, batch, seq] (M-RoPE)
        positions = inputs["position_ids"]
        # each sample reads its prompt's cache from here on
        if len(distinct) < batch:
            copy_of = torch.from_numpy(copy_of)
            cache.batch_select_indices(copy_of)
            logits = logits[copy_of]
            attention = attention[copy_of]
            positions = positions[..., copy_of, :]
        forward_version = self.version
        cache_kw = cache_input(self.model, cache)
        sampled = []
        logprobs = []
        # the sampled ids' log-probs before top_p's truncation
        raws = []
        versions = []
        done = torch.zeros(batch, dtype=torch.bool)
        for step in range(params.max_tokens):
            # the weights whose forward produced these logits
            versions.append(forward_version)
            logits = logits.float()  # [batch, vocab]
            if params.temperature > 0:
                raw = torch.log_softmax(logits / params.temperature, dim=-1)
                dist = nucleus(raw, params.top_p)
                # Gumbel-max: an exact draw, far cheaper than multinomial; the uniform draws come
                # from the call's generator, or row by row from each row's own
                if row_generators:
                    draws = [torch.rand(dist.shape[-1:], generator=row) for row in row_generators]
                    noise = torch.stack(draws)
                else:
                    noise = torch.rand(dist.shape, generator=generator)
                token = (dist - (-noise.log()).log()).argmax(-1)
            else:
                dist = raw = torch.log_softmax(logits, dim=-1)
                token = dist.argmax(-1)
            token = torch.where(done, self.pad_token_id, token)
            if listener is not None:
                # as lists: a tensor op per row cost ~50 us a step
                finished = done.tolist()
                for row, sampled_id in enumerate(token.tolist()):
                    if not finished[row]:
                        listener(row, [sampled_id])
            sampled.append(token)
            logprobs.append(dist.gather(-1, token[:, None]).squeeze(-1))
            raws.append(raw.gather(-1, token[:, None]).squeeze(-1))
            done |= torch.isin(token, stop)
            # no forward whose logits nothing samples
            if bool(done.all()) or step + 1 == params.max_tokens:
                break
            if self.partial and self._pending is not None:
                # pause, swap, resume: the next token samples from the new weights
                with self._lock:
                    self._swap()
            forward_version = self.version
            # one more position every row sees
            attention = torch.nn.functional.pad(attention, (0, 1), value=1)
            positions = positions[..., -1:] + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=positions,
                use_cache=True,
                **cache_kw,
            )
            logits = out.logits[:, -1]

        tokens = torch.stack(sampled, dim=1).int().numpy()  # [batch, new]
        token_logprobs = torch.stack(logprobs, dim=1).numpy()  # [batch, new], float32
        raw_logprobs = torch.stack(raws, dim=1).numpy()  # [batch, new], float32
        stopped = np.isin(tokens, stop.numpy())  # [batch, new]
        # a row ends with its first stop token, else after the last step
        ends = np.where(stopped.any(1), stopped.argmax(1) + 1, tokens.shape[1])
        return [
            Generation(
                tokens[row, :end],
                token_logprobs[row, :end],
                np.asarray(versions[:end], dtype=np.int32),
                "stop" if stopped[row].any() else "length",
                {"raw_logprobs": raw_logprobs[row, :end]},
            )
            for row, end in enumerate(ends)
        ]
