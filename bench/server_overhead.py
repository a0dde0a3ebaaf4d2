"""Loopback-server overhead: requests/s and added latency over a direct engine call, per wire.

    python bench/server_overhead.py [--quick] [--requests N]

One process, one tiny model, one engine. Every request is a fresh session (open_session and
close_session, and building the SDK client, are outside the timing) with the single user message
"What is 2 + 3?" and max_tokens 16; temperature 1 and no stop ids are the server's own params
(the installed anthropic SDK takes no temperature, so neither wire sends one). So every call
renders the same prompt and samples exactly 16 tokens, checked from the session's request rows.
Cases: the real `openai` and `anthropic` sync clients (max_retries=0), non-streaming and
streaming (live: the ids go out as the engine samples them), one request at a time. Each session's
client shares its wire's HTTP connection pool (`http_client=`), as an agent's client keeps its
connection over an episode's turns; "openai, new client" opens a client and connection per
request (what an episode's first request pays). "direct" is `engine.generate` on the same
rendered prompt ids, on a worker thread and one torch thread as the server's calls (the tiny
policy's, set_threads' choice). "sdk floor" is no generation at all: `models.list()` on a
kept connection (the SDK's own request, what any request pays before the server does anything);
its added figures are its own latency. The "bare HTTP" cases send the same requests as plain
HTTP/1.1 on one kept `http.client` connection and parse the JSON or events by hand: no SDK, so
their added latency is the server's own; "bare floor" is `GET /v1/models` on it. After a few
warm-up calls the cases are interleaved round by round (direct, then each case, then the floors),
so drift hits all alike, each after a collection of the young garbage (`untimed_garbage`).
requests/s is N over the summed request latencies; added = case percentile - direct percentile.

Last, 16 OpenAI requests in 16 threads (16 sessions) against the same 16 one after another: the
server batches concurrent requests into one engine call, so the wall-time ratio is its speed-up.
`--quick` (a smoke run of seconds; its figures mean little) takes 4 requests per case, one
warm-up and one round of 4 concurrent requests.
"""

import argparse
import gc
import http.client
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import numpy as np
import openai
import torch
from transformers import AutoTokenizer

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.models.tiny import tiny_model_path
from workbench.server.loopback import LoopbackServer

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
MAX_TOKENS = 16
WARMUP = 5
PARALLEL = 16
# the direct engine calls' thread
ENGINE_THREAD = ThreadPoolExecutor(1)


class CountingEngine:
    """The engine as the server sees it, recording each call's batch size."""

    def __init__(self, engine):
        self.engine = engine
        self.batches = []
        self.lock = threading.Lock()

    def generate(self, prompts, params, images=None, listener=None):
        with self.lock:
            self.batches.append(len(prompts))
        # a streamed request's ids go out as they are sampled, as on the engine itself
        return self.engine.generate(prompts, params, images, listener)


# each wire's HTTP connection pool, kept over the run (main)
POOLS = {}


def openai_call(session: dict, stream: bool, kept: bool = True):
    client = openai.OpenAI(
        base_url=session["openai_base_url"],
        api_key=session["api_key"],
        max_retries=0,
        http_client=POOLS["openai"] if kept else None,
    )

    def call() -> str:
        if stream:
            chunks = client.chat.completions.create(
                model="policy", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True
            )
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return (
            client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=MAX_TOKENS)
            .choices[0]
            .message.content
        )

    return client, call


def anthropic_call(session: dict, stream: bool):
    client = anthropic.Anthropic(
        base_url=session["anthropic_base_url"],
        api_key=session["api_key"],
        max_retries=0,
        http_client=POOLS["anthropic"],
    )

    def call() -> str:
        if stream:
            events = client.messages.create(
                model="policy", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True
            )
            return "".join(
                e.delta.text
                for e in events
                if e.type == "content_block_delta" and e.delta.type == "text_delta"
            )
        return "".join(
            b.text
            for b in client.messages.create(
                model="policy", messages=MESSAGES, max_tokens=MAX_TOKENS
            ).content
            if b.type == "text"
        )

    return client, call


def bare_call(session: dict, stream: bool, wire: str = "openai"):
    """A request as plain HTTP/1.1 on the kept connection, its JSON or events parsed by hand: no
    SDK, so the added latency is the server's own (and the standard library's few lines)."""
    key = session["api_key"]
    if wire == "openai":
        path = session["openai_base_url"].split("/s/", 1)[1]
        path = f"/s/{path}/chat/completions"
        headers = {"Authorization": f"Bearer {key}"}
    else:
        path = session["anthropic_base_url"].split("/s/", 1)[1]
        path = f"/s/{path}/v1/messages"
        headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "stream": stream}
    body = json.dumps(body).encode()
    headers["Content-Type"] = "application/json"

    def text_of(data: bytes) -> str:
        if not stream:
            reply = json.loads(data)
            if wire == "openai":
                return reply["choices"][0]["message"]["content"]
            return "".join(block["text"] for block in reply["content"] if block["type"] == "text")
        events = [
            json.loads(line[6:])
            for line in data.decode().splitlines()
            if line[:6] == "data: " and line != "data: [DONE]"
        ]
        if wire == "openai":
            return "".join(
                e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
            )
        return "".join(
            e["delta"]["text"]
            for e in events
            if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
        )

    def call() -> str:
        connection = POOLS["bare"]
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        data = response.read()
        assert response.status == 200, data
        return text_of(data)

    return None, call


CASES = {
    "openai": (openai_call, False),
    "openai stream": (openai_call, True),
    "anthropic": (anthropic_call, False),
    "anthropic stream": (anthropic_call, True),
    "openai, new client": (lambda session, stream: openai_call(session, stream, False), False),
    "openai, bare HTTP": (bare_call, False),
    "openai stream, bare HTTP": (bare_call, True),
    "anthropic, bare HTTP": (
        lambda session, stream: bare_call(session, stream, "anthropic"),
        False,
    ),
    "anthropic stream, bare HTTP": (
        lambda session, stream: bare_call(session, stream, "anthropic"),
        True,
    ),
}


def checked_close(server: LoopbackServer, session: dict, prompt_len: int) -> None:
    _, requests = server.close_session(session["session"])
    (row,) = requests
    assert row["new_prompt_tokens"] == prompt_len and row["generated_tokens"] == MAX_TOKENS, row


def untimed_garbage() -> None:
    """Collect the young garbage before a timed call: building an SDK client leaves thousands of
    young objects, and the collection they set off (~5 ms, more under load) otherwise fell inside
    the first timed request of each round (the OpenAI case: 12 ms added at p50 with it, 4 ms
    without)."""
    gc.collect(1)


def one_request(server: LoopbackServer, case: str, prompt_len: int) -> float:
    """Seconds for one request on a fresh session (session and client set-up not timed)."""
    make, stream = CASES[case]
    session = server.open_session(0)
    client, call = make(session, stream)
    untimed_garbage()
    start = time.perf_counter()
    call()
    elapsed = time.perf_counter() - start
    # a kept pool stays open
    if client is not None and client._client not in POOLS.values():
        client.close()
    checked_close(server, session, prompt_len)
    return elapsed


def one_floor(server: LoopbackServer) -> float:
    """Seconds of an OpenAI request that generates nothing (`models.list`), on the kept
    connection."""
    session = server.open_session(0)
    client, _ = openai_call(session, False)
    untimed_garbage()
    start = time.perf_counter()
    client.models.list()
    elapsed = time.perf_counter() - start
    server.close_session(session["session"])
    return elapsed


def one_bare_floor(server: LoopbackServer) -> float:
    """Seconds of a plain HTTP `GET /v1/models` on the kept connection: the bare client's floor."""
    untimed_garbage()
    start = time.perf_counter()
    POOLS["bare"].request("GET", "/v1/models")
    POOLS["bare"].getresponse().read()
    return time.perf_counter() - start


def one_direct(engine: TorchEngine, prompt: np.ndarray, params: SamplingParams) -> float:
    untimed_garbage()
    start = time.perf_counter()
    # on a worker thread, as the server calls the engine (the main thread's calls ran 2-3 ms slower
    # at p50 than the server's whole requests in one run)
    (generation,) = ENGINE_THREAD.submit(engine.generate, [prompt], params).result()
    elapsed = time.perf_counter() - start
    assert len(generation.token_ids) == MAX_TOKENS
    return elapsed


def after(gate: threading.Barrier, call):
    """Wait at the gate, then make the call: every thread starts its request at once."""
    gate.wait()
    return call()


def concurrency(
    server: LoopbackServer, counting: CountingEngine, prompt_len: int, parallel: int
) -> tuple[float, float, list[int]]:
    """Wall seconds of `parallel` OpenAI requests one after another, and in `parallel` threads;
    the engine batch sizes of the threaded run."""
    walls = []
    for threaded in (False, True):
        sessions = [server.open_session(k) for k in range(parallel)]
        calls = [openai_call(s, False) for s in sessions]
        with ThreadPoolExecutor(parallel) as pool:
            gate = threading.Barrier(parallel + 1)
            counting.batches.clear()
            if threaded:
                futures = [pool.submit(after, gate, call) for _, call in calls]
                gate.wait()
                start = time.perf_counter()
                for future in futures:
                    future.result()
            else:
                start = time.perf_counter()
                for _, call in calls:
                    call()
            walls.append(time.perf_counter() - start)
        batches = list(counting.batches)
        for session in sessions:
            checked_close(server, session, prompt_len)
    return walls[0], walls[1], batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a CI smoke run: 4 requests per case, one warm-up, one round of 4 concurrent",
    )
    parser.add_argument("--requests", type=int, default=200, help="timed requests per case")
    args = parser.parse_args()
    n = 4 if args.quick else args.requests
    rounds = 1 if args.quick else 5
    warmup = 1 if args.quick else WARMUP
    parallel = 4 if args.quick else PARALLEL

    path = str(tiny_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=())
    engine = TorchEngine(path)
    # the tiny policy runs on one thread (set_threads' choice for it), whichever thread calls it
    torch.set_num_threads(1)
    counting = CountingEngine(engine)
    POOLS.update(openai=openai.DefaultHttpxClient(), anthropic=anthropic.DefaultHttpxClient())
    server = LoopbackServer(counting, tokenizer, params)
    POOLS["bare"] = http.client.HTTPConnection("127.0.0.1", server.port)
    prompt = np.asarray(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ],
        dtype=np.int32,
    )
    try:
        for _ in range(warmup):
            one_direct(engine, prompt, params)
            for case in CASES:
                one_request(server, case, len(prompt))
            one_floor(server)
            one_bare_floor(server)
        times = {"direct": [], **{case: [] for case in CASES}, "sdk floor": [], "bare floor": []}
        for _ in range(n):
            times["direct"].append(one_direct(engine, prompt, params))
            for case in CASES:
                times[case].append(one_request(server, case, len(prompt)))
            times["sdk floor"].append(one_floor(server))
            times["bare floor"].append(one_bare_floor(server))
        runs = [concurrency(server, counting, len(prompt), parallel) for _ in range(rounds)]
    finally:
        for pool in POOLS.values():
            pool.close()
        server.stop()

    ms = {case: np.asarray(t) * 1e3 for case, t in times.items()}
    base50, base99 = np.percentile(ms["direct"], [50, 99])
    print(
        f"prompt {len(prompt)} tokens, {MAX_TOKENS} sampled per request, "
        f"{n} sequential requests per case"
    )
    print(
        f"{'case':<28}{'requests/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'added p50':>11}{'added p99':>11}"
    )
    for case, values in ms.items():
        p50, p99 = np.percentile(values, [50, 99])
        rate = len(values) / (values.sum() / 1e3)
        added = f"{p50 - base50:>11.2f}{p99 - base99:>11.2f}"
        if case == "direct":
            added = ""
        if case.endswith("floor"):
            added = f"{p50:>11.2f}{p99:>11.2f}"
        print(f"{case:<28}{rate:>11.1f}{p50:>9.2f}{p99:>9.2f}{added}")
    sequential = statistics.median(r[0] for r in runs)
    threaded = statistics.median(r[1] for r in runs)
    batches = " ".join(str(r[2]) for r in runs)
    print(
        f"concurrency  {parallel} openai requests: sequential {sequential * 1e3:.1f} ms, "
        f"{parallel} threads {threaded * 1e3:.1f} ms, ratio {sequential / threaded:.2f}x  "
        f"(median of {rounds})"
    )
    print(f"concurrency  engine batch sizes of the threaded runs: {batches}")


if __name__ == "__main__":
    main()
