"""The loopback server under load: concurrent multi-turn streamed sessions, on either engine, and
vLLM's own OpenAI-compatible server on the same model and load.

    python bench/server_load.py [--quick] [--engine torch|vllm] [--sessions 1,8,32,128]
        [--turns 3] [--max-tokens 32] [--vllm-server]

Each session is one chat: a system prompt (SYSTEM, shared by every session, as an agent's
instructions are), a user message naming the session, then `--turns` streamed Chat Completions
turns of exactly `--max-tokens` sampled tokens (temperature 1, no stop token: the loopback server
runs with no stop ids and vLLM's server with `ignore_eos`), each turn appending the reply and
"Go on." All sessions start at once. The client is the real `openai` SDK (AsyncOpenAI, streaming,
`stream_options.include_usage`) in a process of its own, the same for every server.

Per concurrency: requests/s and generated tokens/s over the wall time of the whole load; time to
first token (the first content delta) p50/p99; at one session, the added latency p50/p99 of a
whole request over the engine called directly (`engine.generate` on each request's own prompt ids,
as the session recorded them; vLLM's own servers' rows over the same direct calls). One session
is ONE_SESSION_RUNS sessions one after another (one session's few turns are too few requests for a
p50, let alone a p99). With `--vllm-server` (and
`--engine vllm`), vLLM's own server (`python -m vllm.entrypoints.openai.api_server`, float32, its
engine in a process of its own) runs the same loads with its defaults (prefix caching on) and with
`--no-enable-prefix-caching`; each load runs on every server in turn, so the machine's drift hits
all alike, and the vLLM servers not under load are paused (SIGSTOP): an idle one's worker polls.
The loopback's vLLM engine runs in process (the CPU default); `VLLM_ENABLE_V1_MULTIPROCESSING=1`
puts its engine core in processes of its own, as vLLM's own server does (one session: 215 tokens/s
against 334 in process, measured here). `--quick`: 1 and 4 sessions (one session: 2 runs), 2 turns
of 8 tokens, no vLLM server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
from transformers import AutoTokenizer

from workbench.engines.base import SamplingParams
from workbench.models.tiny import tiny_model_path
from workbench.server.loopback import LoopbackServer

SYSTEM = "You are a careful assistant. " * 30
# sessions run one after another for the one-session load
ONE_SESSION_RUNS = 10


def percentile(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


async def session_load(base_url, api_key, index, turns, max_tokens, extra) -> list[tuple]:
    """One session's turns: (start, first content delta, end, completion tokens) per request."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {index}: tell me a story."},
    ]
    rows = []
    for _ in range(turns):
        start = time.perf_counter()
        first = None
        text = []
        tokens = 0
        chunks = await client.chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        rows.append((start, first or time.perf_counter(), time.perf_counter(), tokens))
        messages += [
            {"role": "assistant", "content": "".join(text)},
            {"role": "user", "content": "Go on."},
        ]
    await client.close()
    return rows


def client_process(urls, turns, max_tokens, extra, results, one_by_one) -> None:
    """Every session at once (`one_by_one`: one after another), in this process; its rows and the
    load's wall seconds."""

    async def everything():
        loads = [
            session_load(url, key, k, turns, max_tokens, extra) for k, (url, key) in enumerate(urls)
        ]
        if one_by_one:
            return [await load for load in loads]
        return await asyncio.gather(*loads)

    start = time.perf_counter()
    sessions = asyncio.run(everything())
    results.put((sessions, time.perf_counter() - start))


def run_load(urls, turns, max_tokens, extra=None, one_by_one=False) -> dict:
    """One load from a client process of its own: requests/s, tokens/s, time to first token."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(
        target=client_process, args=(urls, turns, max_tokens, extra or {}, results, one_by_one)
    )
    process.start()
    while True:
        try:
            sessions, wall = results.get(timeout=5)
            break
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError("the client process failed (its traceback is above)") from None
    process.join()
    rows = [row for session in sessions for row in session]
    first = [row[1] - row[0] for row in rows]
    latency = [row[2] - row[0] for row in rows]
    tokens = sum(row[3] for row in rows)
    return {
        "requests/s": len(rows) / wall,
        "tokens/s": tokens / wall,
        "ttft p50": percentile(first, 50),
        "ttft p99": percentile(first, 99),
        "latency": latency,
        "tokens": tokens,
    }


def direct_latency(engine, server: LoopbackServer, sessions: list[str], max_tokens: int):
    """Seconds of a direct engine call on each request's prompt ids, as `sessions` recorded them
    (closed here)."""
    prompts = []
    for session in sessions:
        segments, _ = server.close_session(session)
        for segment in segments:
            for start, _ in segment.turn_spans:
                prompts.append(np.asarray(segment.token_ids[:start], dtype=np.int32))
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    seconds = []
    for prompt in prompts:
        start = time.perf_counter()
        engine.generate([prompt], params)
        seconds.append(time.perf_counter() - start)
    return seconds


def session_urls(server: LoopbackServer, count: int, opened: list) -> list[tuple[str, str]]:
    """The URLs of `count` new sessions, whose ids go in `opened`."""
    sessions = [server.open_session(k) for k in range(count)]
    opened[:] = [session["session"] for session in sessions]
    return [(session["openai_base_url"], session["api_key"]) for session in sessions]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def vllm_server(path: str, prefix_caching: bool):
    """vLLM's own OpenAI-compatible server on the model (its own process group): its URL."""
    from workbench.engines.vllm_engine import CPU_DEFAULTS

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={path}",
        "--served-model-name=policy",
        f"--port={port}",
        "--host=127.0.0.1",
        "--dtype=float32",
        "--seed=0",
        # the tiny model's chat template joins string contents
        "--chat-template-content-format=string",
    ]
    if not prefix_caching:
        command.append("--no-enable-prefix-caching")
    # its defaults otherwise: the engine in a process of its own
    environment = {**os.environ, **{k: v for k, v in CPU_DEFAULTS.items() if "MULTI" not in k}}
    server = subprocess.Popen(
        command,
        env=environment,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError as error:
                if time.time() > deadline or server.poll() is not None:
                    raise RuntimeError(
                        f"vLLM's server did not start: {' '.join(command)}"
                    ) from error
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1", server.pid
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def pause_all_but(groups: dict, name: str) -> None:
    """Pause every server's vLLM processes but `name`'s (SIGSTOP) and resume `name`'s: an idle vLLM
    engine in processes of its own is not idle, its worker polls for work (~20 % of a core measured
    here, beside OpenMP threads pinned to the cores the load runs on)."""
    for each, send in groups.items():
        send(signal.SIGCONT if each == name else signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 sessions")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"])
    parser.add_argument("--sessions", default="1,8,32,128", help="concurrent sessions per load")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vllm-server", action="store_true", help="vLLM's own server as well")
    args = parser.parse_args()
    counts = [int(c) for c in args.sessions.split(",")]
    turns = args.turns
    max_tokens = args.max_tokens
    if args.quick:
        counts = [1, 4]
        turns = 2
        max_tokens = 8
    path = str(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.engine == "vllm":
        import psutil

        from workbench.engines.vllm_engine import VllmEngine

        engine = VllmEngine(path, gpu_memory_utilization=0.1)
        # the engine's processes (with VLLM_ENABLE_V1_MULTIPROCESSING=1), paused while another
        # server is under load
        engine_pids = [child.pid for child in psutil.Process().children(recursive=True)]
    else:
        import torch

        from workbench.engines.torch_engine import TorchEngine

        engine = TorchEngine(path)
        # the tiny policy runs on one thread (set_threads' choice for it)
        torch.set_num_threads(1)
    # a SIGTERM (a timeout) still stops vLLM's servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    print(
        f"engine={args.engine}; {turns} turns x {max_tokens} tokens per session, system prompt "
        f"{len(tokenizer(SYSTEM)['input_ids'])} tokens; streamed Chat Completions"
    )
    print(
        "| server | sessions | requests/s | generated tokens/s | time to first token p50 | p99 "
        "| added latency p50 | p99 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    loopback = LoopbackServer(
        engine, tokenizer, SamplingParams(max_tokens=max_tokens, temperature=1.0), seed=0
    )
    # the loopback sessions of the last load
    opened = []
    # name: (the session URLs of a load of `count` sessions, extra request fields)
    servers = {"molt-wb loopback": (lambda count: session_urls(loopback, count, opened), {})}
    # by server, what sends a signal to its engine's processes
    groups = {}
    if args.engine == "vllm":
        groups["molt-wb loopback"] = lambda sig: [os.kill(pid, sig) for pid in engine_pids]
    with contextlib.ExitStack() as stack:
        if args.vllm_server and not args.quick:
            for prefix_caching in (True, False):
                url, group = stack.enter_context(vllm_server(path, prefix_caching))
                name = "vLLM's own server, " + ("defaults" if prefix_caching else "no prefix cache")
                groups[name] = lambda sig, group=group: os.killpg(group, sig)
                # every reply runs to max_tokens, as on the loopback server (no stop id)
                servers[name] = (
                    lambda count, url=url: [(url, "none")] * count,
                    {"ignore_eos": True},
                )
        # at the end (first of the stack's exits), the loopback's engine resumes and the vLLM
        # servers resume as they stop
        stack.callback(pause_all_but, groups, "molt-wb loopback")
        # warm-up: each engine's first calls pay one-off costs
        for name, (urls, extra) in servers.items():
            pause_all_but(groups, name)
            run_load(urls(2), 1, max_tokens, extra)
        # each load on every server in turn: the machine's drift hits all alike
        for count in counts:
            for name, (urls, extra) in servers.items():
                pause_all_but(groups, name)
                if count == 1:
                    runs = ONE_SESSION_RUNS
                    if args.quick:
                        runs = 2
                    result = run_load(urls(runs), turns, max_tokens, extra, one_by_one=True)
                else:
                    result = run_load(urls(count), turns, max_tokens, extra)
                if count == 1 and name == "molt-wb loopback":
                    direct = direct_latency(engine, loopback, opened, max_tokens)
                # vLLM's own servers' requests over the same direct calls: what a server and the
                # streaming client add there
                if count == 1:
                    result["direct"] = direct
                print_row(name, count, result)
    loopback.stop()


def print_row(name: str, count: int, result: dict) -> None:
    """One table row, printed at once."""
    added = " | "
    if "direct" in result:
        latency = result["latency"]
        direct = result["direct"]
        p50 = (percentile(latency, 50) - percentile(direct, 50)) * 1e3
        p99 = (percentile(latency, 99) - percentile(direct, 99)) * 1e3
        added = f"{p50:.1f} ms | {p99:.1f} ms"
    print(
        f"| {name} | {count} | {result['requests/s']:.1f} | {result['tokens/s']:,.0f} "
        f"| {result['ttft p50'] * 1e3:.0f} ms | {result['ttft p99'] * 1e3:.0f} ms | {added} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
