"""The vLLM rollout engine: the engine protocol (engines/base.py) on vLLM, token-in / token-out.

Prompts go in as exact ids (`TokensPrompt`, never text); every sampled id comes back with its
log-prob under the distribution it was sampled from. vLLM runs with
`logprobs_mode="processed_logprobs"`: the log-softmax of the logits *after* temperature scaling
(and top-p truncation), i.e. log softmax(logits / T) — exactly what the learner recomputes for the
same ids (`token_logprobs(logits, ids, temperature)`), so their difference measures only the
numerical mismatch of two implementations. The default `raw_logprobs` would report the untempered
distribution and bias every importance ratio whenever T != 1. An engine takes one logprobs_mode,
so a vLLM generation carries no raw log-probs beside the processed ones (the torch engine's
`extras["raw_logprobs"]`): with top_p < 1 the off-policy gap's sampler part is then recomputed by
the learner on the `audit.gap_rows` drawn rows (models/gap.py), not taken from the engine.

The engine's own thread drives vLLM's `LLMEngine` one scheduler step at a time, so each token's
weight version is the version of the forward that produced it. It runs continuously: prompts of
every caller (a rollout batch, each loopback request) join the running batch between two steps as
they arrive and leave it as each finishes (continuous batching), and each step's new ids go to the
caller's listener (live streaming). A weight push waits in the slot shared with the torch engine
(hold/partial semantics identical: a push waits until no request runs); with `partial=True` it is
swapped in between two steps: in-flight requests pause, the weights are reloaded in place
(`collective_rpc` into the `WeightSync` worker extension, which works for an in-process engine and
for one in other processes alike), and generation resumes on the kept KV cache. Prefix caching is
on, each request salted (`cache_salt`) with the weights it starts on (version and push count; a
LoRA policy's version is its adapter's): a session's later turns reuse their own earlier blocks,
and no block computed by older weights serves a request started on newer ones.

MoE routed experts (`enable_return_routed_experts`) need vLLM's Model Runner V2; on the CPU backend
vLLM refuses them ("AuxOutput Connector requires Model Runner V2"), so there the engine asks for
none and a MoE generation carries no routes; on GPUs they are decoded into the Segment record.

Images (vision-language policies) go in as `multi_modal_data` beside ids whose placeholder runs
the rollout has already expanded with the checkpoint's own image processor, as vLLM would. vLLM's
vision models import torchvision, and no torchvision build for this machine's torch 2.13 CPU
exists, so this path is not exercised here (config validation refuses it where torchvision does
not import).
"""

from __future__ import annotations

import functools
import io
import itertools
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from PIL import Image
from transformers import AutoConfig

from workbench.engines.base import Generation, Listener, SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.routing_replay import decode_vllm_routed_experts
from workbench.models.multimodal import ImageCodec, is_vision_language
from workbench.models.tiny import is_moe

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput

    from workbench.config import LoraConfig

# what a function `_call` runs on the engine's thread returns
Returned = TypeVar("Returned")

CPU_DEFAULTS = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class WeightSync:
    """vLLM worker extension (runs in each vLLM worker): in-place reload with an optional check."""

    def load_policy_weights(
        self, weights: list[tuple[str, torch.Tensor]], check: bool
    ) -> list[str]:
        """Reload from (name, tensor) pairs in checkpoint format; with `check`, every parameter is
        first filled with NaN, and the names of those still holding NaN afterwards (not updated) are
        returned."""
        model = self.model_runner.get_model()
        if check:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.fill_(float("nan"))
        self.reload_weights(weights_iterator=iter(weights))
        # CPU MoE kernels read prepacked experts, packed only at the first load
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and module.w13_weight.device.type == "cpu":
                kernel.fused_experts.process_weights_after_loading(module)
        return [
            name for name, p in model.named_parameters() if check and bool(torch.isnan(p).any())
        ]


@dataclass
class Request:
    """A prompt in the running engine: what it has sampled so far, and who waits for it."""

    prompt_tokens: int
    done: Future[Generation]
    # called with each step's new ids (on the engine's thread)
    listener: Callable[[list[int]], None] | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _settle(
    result: Future[Returned], function: Callable[..., Returned], *args: Any, **kwargs: Any
) -> None:
    """`result` holds what `function(*args, **kwargs)` returns, or what it raises."""
    try:
        result.set_result(function(*args, **kwargs))
    except BaseException as error:
        result.set_exception(error)


class VllmEngine(TorchEngine):
    """Same protocol, weight slot and hold/partial semantics as the torch engine; vLLM does the
    sampling."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        seed: int = 0,
        partial: bool = False,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        check_weight_sync: bool = False,
        routed_experts: bool = True,
        lora: LoraConfig | None = None,
    ):
        vision = is_vision_language(model_path)
        cpu = not torch.cuda.is_available()
        if cpu:
            for key, value in CPU_DEFAULTS.items():
                os.environ.setdefault(key, value)
        # vLLM loads after the CPU defaults are set (it reads them at import), and only here: it is
        # optional
        from vllm import LLM

        self.moe = is_moe(AutoConfig.from_pretrained(model_path).get_text_config())
        # vLLM serves them with Model Runner V2 only (GPU)
        self.routes = self.moe and routed_experts and not cpu
        # vLLM's CPU kernels keep the OpenMP settings of the thread that started them: every call
        # runs on the engine's own thread, queued between two steps
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # by request id, the requests in the running batch (the engine thread's alone)
        self.running: dict[str, Request] = {}
        self.driver = threading.Thread(target=self._drive, name="vllm", daemon=True)
        self.driver.start()
        options = {}
        # a LoRA policy: each pushed adapter version is a LoRARequest on the base
        self.lora = lora if lora and lora.rank else None
        self.lora_request: LoRARequest | None = None
        if self.lora:
            options.update(enable_lora=True, max_lora_rank=lora.rank)
        if vision:
            options["limit_mm_per_prompt"] = {"image": 8}
        if cpu:
            # a prompt prefilled in chunks rewinds its seeded generator between them, which a CPU
            # generator refuses ("CPU Generator does not use offset"): prefill each prompt whole
            options["enable_chunked_prefill"] = False
        self.llm = self._call(
            LLM,
            model=model_path,
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=cpu,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_logprobs=0,
            async_scheduling=False,
            worker_extension_cls=f"{__name__}.WeightSync",
            enable_return_routed_experts=self.routes,
            **options,
        )
        # the rollout expands placeholders as vLLM does
        self.codec = ImageCodec(model_path) if vision else None
        self.seed = seed
        self.check = check_weight_sync
        self._open_slot(partial)
        self.ids = itertools.count()
        # weight pushes adopted: with the version, the prefix cache's salt
        self.swaps = 0

    def _call(self, function: Callable[..., Returned], *args: Any, **kwargs: Any) -> Returned:
        """`function(*args, **kwargs)` on the engine's own thread, between two steps."""
        if threading.current_thread() is self.driver:
            return function(*args, **kwargs)
        result: Future[Returned] = Future()
        self.commands.put(functools.partial(_settle, result, function, *args, **kwargs))
        return result.result()

    def _drive(self) -> None:
        """The engine's thread: what callers queue (calls, new requests) runs between two steps, and
        the engine steps while any request runs."""
        while True:
            # idle: wait for work; running: take what came during the last step
            if not self.running:
                self.commands.get()()
            while not self.commands.empty():
                self.commands.get()()
            if self.running:
                self._step()

    # the weight slot and its count of holders are the engine thread's alone, so no caller waits on
    # that thread while holding the slot's lock
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._call(super().load_weights, state_dict, version)

    def _enter(self) -> None:
        self._call(super()._enter)

    def _leave(self) -> None:
        self._call(super()._leave)

    def _generate(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None,
        listener: Listener | None,
    ) -> list[Generation]:
        return [done.result() for done in self.submit(prompts, params, images, listener)]

    def submit(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None = None,
        listener: Listener | None = None,
    ) -> list[Future[Generation]]:
        """Start the prompts in the running batch, all on the same weights; each one's Generation
        when it ends."""
        futures: list[Future[Generation]] = [Future() for _ in prompts]
        self.commands.put(
            functools.partial(self._admit, prompts, params, images, listener, futures)
        )
        return futures

    def _swap(self) -> None:
        """Adopt pending weights, if any (the caller holds the lock); refuse a partial update when
        checking."""
        if self._pending is None:
            return
        state_dict, version = self._pending
        self._pending = None
        self.swaps += 1
        if self.lora:
            self.lora_request = self._adapter(state_dict, version)
        else:
            weights = [(name, tensor.detach().cpu()) for name, tensor in state_dict.items()]
            # on the engine's thread, as every swap
            stale = self.llm.collective_rpc("load_policy_weights", args=(weights, self.check))
            missed = sorted({name for worker in stale for name in worker})
            if missed:
                raise RuntimeError(
                    f"Weight sync to version {version} left {len(missed)} vLLM parameter(s) not "
                    f"updated (e.g. {missed[0]}): the pushed state dict does not cover the "
                    "engine's model."
                )
        self.version = version

    def _adapter(self, state_dict: dict[str, torch.Tensor], version: int) -> LoRARequest:
        """The LoRARequest of a pushed adapter version, written as a PEFT folder; the previous
        version's folder goes (no request runs on it: pushes wait until episodes end)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from workbench.models.lora import peft_config

        if self.lora_request is not None:
            shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        folder = tempfile.mkdtemp(prefix=f"molt-wb-adapter-{version}-")
        config = peft_config(self.lora)
        # the modules the adapter holds ("all-linear" resolved, as vLLM reads names)
        config.target_modules = sorted({name.split(".")[-3] for name in state_dict})
        config.save_pretrained(folder)
        tensors = {name: t.detach().cpu().contiguous() for name, t in state_dict.items()}
        save_file(tensors, f"{folder}/adapter_model.safetensors")
        return LoRARequest(f"v{version}", version + 1, folder)

    def _admit(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list[list[bytes]] | None,
        listener: Listener | None,
        futures: list[Future[Generation]],
    ) -> None:
        """Add the prompts to the running batch (on the engine's thread), each salted with the
        weights it starts on."""
        from vllm import SamplingParams as VllmParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = VllmParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            # greedy: the whole vocabulary
            top_p=1 if params.temperature <= 0 else params.top_p,
            logprobs=0,
            detokenize=False,
            ignore_eos=True,
            stop_token_ids=list(params.stop_token_ids),
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
        for row, prompt in enumerate(prompts):
            # a push waiting for an idle engine is adopted first
            self._enter()
            # a seed per request: the engine's own stream, or the call's seed and the row
            seeded = sampling.clone()
            if params.row_seeds:
                seeded.seed = params.row_seeds[row] % 2**63
            elif params.seed is None:
                seeded.seed = self.seed * 1_000_003 + next(self.ids)
            else:
                seeded.seed = (params.seed * 1_000_003 + row) % 2**63
            # placeholders already expanded
            inputs = TokensPrompt(
                prompt_token_ids=[int(t) for t in prompt],
                cache_salt=f"{self.version}.{self.swaps}",
            )
            request = Request(
                len(prompt), futures[row], listener and functools.partial(listener, row)
            )
            # outputs carry this id (add_request returns an internal one)
            request_id = f"r{next(self.ids)}"
            try:
                if images and images[row]:
                    inputs["multi_modal_data"] = {
                        "image": [Image.open(io.BytesIO(b)).convert("RGB") for b in images[row]]
                    }
                self.llm.llm_engine.add_request(
                    request_id, inputs, seeded, lora_request=self.lora_request
                )
            # a prompt the engine refuses fails alone
            except Exception as error:
                futures[row].set_exception(error)
                self._leave()
                continue
            self.running[request_id] = request

    def _step(self) -> None:
        """One scheduler step: each running request's new ids, their log-probs and the version of
        this forward; the finished ones leave the batch."""
        engine = self.llm.llm_engine
        version = self.version
        try:
            outputs = engine.step()
        # the engine failed: every running request fails with it
        except Exception as error:
            engine.abort_request(list(self.running))
            for request in self.running.values():
                request.done.set_exception(error)
                self._leave()
            self.running.clear()
            return
        for output in outputs:
            request = self.running[output.request_id]
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            request.ids += ids
            for entry, token in zip(completion.logprobs, ids, strict=True):
                request.logprobs.append(entry[token].logprob)
            request.versions += [version] * len(ids)
            if request.listener and ids:
                request.listener(ids)
            if output.finished:
                del self.running[output.request_id]
                request.done.set_result(self._generation(request, completion, output))
                self._leave()
        if self.partial and self._pending is not None:
            # pause (between steps), swap, resume on the kept KV cache
            with self._lock:
                self._swap()

    def _generation(
        self, request: Request, completion: CompletionOutput, output: RequestOutput
    ) -> Generation:
        """A finished request as the protocol's Generation; `cached_prompt_tokens`: its prompt
        tokens the prefix cache served."""
        generation = Generation(
            np.asarray(request.ids, dtype=np.int32),
            np.asarray(request.logprobs, dtype=np.float32),
            np.asarray(request.versions, dtype=np.int32),
            "stop" if completion.finish_reason == "stop" else "length",
            {"cached_prompt_tokens": output.num_cached_tokens or 0},
        )
        if completion.routed_experts is not None:
            generation.extras["routed_experts"] = decode_vllm_routed_experts(
                completion.routed_experts, request.prompt_tokens + len(request.ids)
            )
        return generation
