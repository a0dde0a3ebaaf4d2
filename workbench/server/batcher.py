"""How the loopback server's requests reach the engine: into its running batch as they arrive where
the engine keeps one (the vLLM engine's `submit`: continuous batching), else batched by call (the
requests that arrive while the engine is busy go into its next call together).

Either way a request gets its own Generation, and its sampled ids as they come where it listens
for them and the engine hands them out (a streamed reply goes out as it is sampled): the engine's
thread wakes the event loop with them at most once per STREAM_GAP, not at each step (at each of a
stream's first ids while it has sent no text yet, `live.HELD_IDS`).
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from workbench.engines.base import Engine, Generation, SamplingParams

# least seconds between two wakes of the event loop by a streaming engine's thread (the first ids
# wake it at once): each wake's work shares the GIL with the engine's thread; ids sampled meanwhile
# go out together. On the in-process vLLM engine, one session of 32-token turns: 258 tokens/s with
# a 5 ms gap, 301 with 20 ms, 295 with one wake per turn (bench/server_load.py)
STREAM_GAP = 0.02


@dataclass
class Waiting:
    """A request in the batcher's queue: what to generate from, and the future for its output."""

    prompt_ids: np.ndarray  # int32 [t]
    params: SamplingParams
    images: list[bytes]
    output: asyncio.Future[Generation]
    # called on the event loop with the request's new ids (None: no stream); returns True while the
    # stream holds all its text (its next ids wake the loop at once)
    listener: Callable[[list[int]], bool] | None


class Batcher:
    """The server's requests into the engine, and their outputs back to the event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Waiting] = asyncio.Queue()
        self.task = self.loop.create_task(self._run())

    async def generate(
        self,
        prompt_ids: np.ndarray,  # int32 [t]
        params: SamplingParams,
        images: list[bytes],
        listener: Callable[[list[int]], bool] | None,
    ) -> Generation:
        """The request's Generation; `listener(ids)`, unless None, gets its ids as they are sampled
        (on the event loop)."""
        if params.seed is not None:
            # the request samples from its own seed, whichever requests it shares a batch with
            params = replace(params, seed=None, row_seeds=(params.seed,))
        if hasattr(self.engine, "submit"):
            (done,) = self.engine.submit([prompt_ids], params, [images], **self._relay([listener]))
            return await asyncio.wrap_future(done)
        output = self.loop.create_future()
        await self.queue.put(Waiting(prompt_ids, params, images, output, listener))
        return await output

    def _relay(
        self, listeners: list[Callable[[list[int]], bool] | None]
    ) -> dict[str, Callable[[int, list[int]], None]]:
        """The engine's listener argument: each row's new ids to that row's listener, on the loop
        (none when no row listens)."""
        if not any(listeners):
            return {}
        # (row, ids) not yet handed to the loop: appended on the engine's thread, popped on the
        # loop's (each atomic)
        waiting: list[tuple[int, list[int]]] = []
        # when the engine's thread may next wake the loop
        wake_at = 0.0

        def relay(row: int, ids: list[int]) -> None:
            nonlocal wake_at
            waiting.append((row, ids))
            # at most one wake per STREAM_GAP: ids sampled meanwhile wait for the next one (ids the
            # last one leaves go out with the reply's last events)
            now = time.perf_counter()
            if now >= wake_at:
                wake_at = now + STREAM_GAP
                self.loop.call_soon_threadsafe(take)

        def take() -> None:
            nonlocal wake_at
            while waiting:
                row, ids = waiting.pop(0)
                # a stream that holds all it has (its text may still open a tool call, ...) wakes
                # the loop at its next ids: its first text goes out as soon as it is certain
                if listeners[row] and listeners[row](ids):
                    wake_at = 0.0

        return {"listener": relay}

    async def _run(self) -> None:
        while True:
            waiting = [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            by_params: dict[tuple, list[Waiting]] = {}
            for item in waiting:
                params = item.params
                key = (params.max_tokens, params.temperature, params.stop_token_ids)
                by_params.setdefault(key, []).append(item)
            for items in by_params.values():
                await self._generate(items)

    async def _generate(self, items: list[Waiting]) -> None:
        """One engine call for requests of the same sampling params; each gets its output."""
        seeds = [item.params.row_seeds for item in items]
        params = replace(items[0].params, row_seeds=())
        if all(seeds):
            # each request samples from its own seed, whichever requests it shares the call with
            params = replace(params, row_seeds=tuple(seed for (seed,) in seeds))
        try:
            outputs = await asyncio.to_thread(
                self.engine.generate,
                [item.prompt_ids for item in items],
                params,
                [item.images for item in items],
                **self._relay([item.listener for item in items]),
            )
            for item, output in zip(items, outputs, strict=True):
                item.output.set_result(output)
        # the engine failed: every waiting request gets the error
        except Exception as error:
            for item in items:
                if not item.output.done():
                    item.output.set_exception(error)
