"""The loopback server: an agent's stock OpenAI or Anthropic SDK talks to the rollout engine.

One per rollout worker, on 127.0.0.1 and a free port, on its own event-loop thread. Every episode
gets a session (`/s/<session>/v1/...`) with its own key. Both wires decode into the session's
`TokenAccumulator`: a request that continues the conversation adds only the rendered delta and
generation continues from the exact accumulated ids; otherwise the segment is sealed and a new
one starts. A turn is committed only after generation succeeds; an identical retry gets the
cached reply and records nothing twice. Concurrent requests of all sessions are batched into one
engine call.

Hostile input (fuzzed in tests/server/test_fuzz.py) gets a 4xx in the wire's error shape and
changes nothing: bodies over MAX_BODY, prompt + max_tokens over the token limit, malformed or
deeply nested JSON, wrong types, unknown routes. Keys are compared in constant time; nothing a
request says is read from or written to a file.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace

from workbench.engines.base import SamplingParams
from workbench.invariants.token_identity import TokenAccumulator, reply_text
from workbench.server import wires

MAX_BODY = 4 * 2**20


@dataclass
class Session:
    session_id: str
    api_key: str
    rollout_id: int
    accumulator: TokenAccumulator | None = None
    last_request: str | None = None
    last_response: tuple | None = None
    requests: list[dict] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Batcher:
    """Requests waiting while the engine is busy go into its next call together."""

    def __init__(self, engine):
        self.engine, self.queue = engine, asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt_ids, params: SamplingParams, images: list[bytes]):
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((prompt_ids, params, future, images))
        return await future

    async def _run(self) -> None:
        while True:
            waiting = [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            by_params: dict[tuple, list] = {}
            for item in waiting:
                params = item[1]
                by_params.setdefault(
                    (params.max_tokens, params.temperature, params.stop_token_ids), []
                ).append(item)
            for items in by_params.values():
                try:
                    outputs = await asyncio.to_thread(
                        self.engine.generate,
                        [i[0] for i in items],
                        items[0][1],
                        [i[3] for i in items],
                    )
                    for (_, _, future, _), output in zip(items, outputs):
                        future.set_result(output)
                except (
                    Exception
                ) as error:  # the engine failed: every waiting request gets the error
                    for _, _, future, _ in items:
                        future.set_exception(error)


class LoopbackServer:
    def __init__(
        self,
        engine,
        tokenizer,
        params: SamplingParams,
        model_name: str = "policy",
        max_total_tokens: int | None = None,
    ):
        self.engine, self.tokenizer, self.params, self.model_name = (
            engine,
            tokenizer,
            params,
            model_name,
        )
        context = getattr(
            getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None
        )
        self.max_total_tokens = (
            max_total_tokens or context or 32768
        )  # prompt + max_tokens of one request
        self.codec = getattr(engine, "codec", None)  # a vision-language policy's image codec
        self.sessions: dict[str, Session] = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="loopback").start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY, middlewares=[web.middleware(_route_errors)])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/s/{session}/v1/models", self._models)
        app.router.add_post("/s/{session}/v1/chat/completions", lambda r: self._handle(r, "openai"))
        app.router.add_post("/s/{session}/v1/messages", lambda r: self._handle(r, "anthropic"))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.batcher = Batcher(self.engine)
        return site._server.sockets[0].getsockname()[1]

    # ---- sessions (called from the worker's thread)

    def open_session(self, rollout_id: int) -> dict:
        session = Session(secrets.token_hex(8), "sk-" + secrets.token_hex(16), rollout_id)
        asyncio.run_coroutine_threadsafe(self._add(session), self.loop).result()
        base = f"{self.url}/s/{session.session_id}"
        return {
            "session": session.session_id,
            "openai_base_url": f"{base}/v1",
            "anthropic_base_url": base,
            "api_key": session.api_key,
        }

    async def _add(self, session: Session) -> None:
        session.lock = asyncio.Lock()
        self.sessions[session.session_id] = session

    def close_session(self, session_id: str) -> tuple[list, list[dict]]:
        """End a session: its token-exact segments (none if it never generated) and its request rows."""
        session = self.sessions.pop(session_id)
        return (session.accumulator.finish() if session.accumulator else []), session.requests

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _stop(self) -> None:
        self.batcher.task.cancel()
        await self.runner.cleanup()

    # ---- HTTP

    async def _models(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model_name, "object": "model", "owned_by": "molt-wb", "created": 0}
                ],
            }
        )

    async def _handle(self, request, wire: str):
        from aiohttp import web

        started = time.perf_counter()
        decode = wires.openai_request if wire == "openai" else wires.anthropic_request
        error_body = wires.openai_error if wire == "openai" else wires.anthropic_error
        try:
            session = self.sessions.get(request.match_info["session"])
            if session is None:
                raise wires.WireError(
                    404,
                    "Unknown session: use the base URL handed to this episode.",
                    "not_found_error",
                )
            given = request.headers.get("x-api-key") or request.headers.get(
                "Authorization", ""
            ).removeprefix("Bearer ")
            if not hmac.compare_digest(
                given.encode("utf-8", "surrogateescape"), session.api_key.encode()
            ):
                raise wires.WireError(
                    401, "Invalid API key for this session.", "authentication_error"
                )
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise wires.WireError(
                    413,
                    f"Request body over {MAX_BODY} bytes: send a shorter conversation.",
                    "request_too_large",
                ) from None
            try:
                body = json.loads(raw)
                assert isinstance(body, dict)
            except (ValueError, AssertionError, RecursionError):
                raise wires.WireError(
                    400,
                    "Malformed JSON: the body must be one JSON object (UTF-8, not nested too deep).",
                ) from None
            try:
                chat = decode(body)
            except (
                TypeError,
                ValueError,
                AttributeError,
                KeyError,
                OverflowError,
            ) as error:  # a field of the wrong type
                raise wires.WireError(
                    400,
                    f"Malformed request ({type(error).__name__}: {error}): check the fields' types.",
                ) from None
            fingerprint = hashlib.sha256(
                wire.encode() + json.dumps(body, sort_keys=True).encode()
            ).hexdigest()
            async with session.lock:
                if fingerprint != session.last_request:
                    reply, ids = await self._turn(session, chat, wire, started)
                    session.last_request, session.last_response = fingerprint, (chat, reply, ids)
                chat, reply, ids = (
                    session.last_response
                )  # a retry gets the committed reply, nothing new
        except wires.WireError as error:
            return web.json_response(error_body(error), status=error.status)
        except Exception as error:  # the engine failed: nothing was committed, the client may retry
            failure = wires.WireError(
                500,
                f"Generation failed ({type(error).__name__}: {error}); nothing was recorded, "
                f"retry the request.",
                "api_error",
            )
            return web.json_response(error_body(failure), status=500)
        if not chat.stream:
            return web.json_response(
                wires.openai_reply(reply) if wire == "openai" else wires.anthropic_reply(reply)
            )
        pieces = self._pieces(ids, reply.text)
        events = (
            wires.openai_events(reply, chat.include_usage, pieces)
            if wire == "openai"
            else wires.anthropic_events(reply, pieces)
        )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def _turn(self, session: Session, chat: wires.ChatRequest, wire: str, started: float):
        """Extend or seal, generate, and only then commit the turn to the session."""
        episode = session.accumulator.fork() if session.accumulator else None
        reused = len(episode.open.token_ids) if episode else 0
        try:
            if episode is None:
                episode, action = (
                    TokenAccumulator(self.tokenizer, chat.messages, chat.tools, self.codec),
                    "open",
                )
            else:
                action = episode.continue_with(chat.messages, chat.tools)
                reused = reused if action == "extend" else 0
        except ValueError as error:  # e.g. an image sent to a text-only policy
            raise wires.WireError(400, str(error)) from None
        except (
            Exception
        ) as error:  # the chat template refused these messages (a role order, a tool call, ...)
            raise wires.WireError(
                400,
                f"The policy's chat template cannot render these messages "
                f"({type(error).__name__}: {error}).",
            ) from None
        prompt = episode.token_ids
        params = replace(
            self.params,
            max_tokens=chat.max_tokens or self.params.max_tokens,
            temperature=self.params.temperature if chat.temperature is None else chat.temperature,
        )
        if len(prompt) + params.max_tokens > self.max_total_tokens:
            raise wires.WireError(
                400,
                f"The prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds this "
                f"server's limit of {self.max_total_tokens} tokens: shorten the conversation or "
                f"lower max_tokens.",
            )
        generation = await self.batcher.generate(prompt, params, episode.open.images)
        ids, logprobs, versions, finish = (
            generation.token_ids,
            generation.logprobs,
            generation.versions,
            generation.finish_reason,
        )
        text = reply_text(self.tokenizer, ids, finish)
        hit = (
            min((text.index(s), s) for s in chat.stop if s in text)
            if any(s in text for s in chat.stop)
            else None
        )
        if (
            hit
        ):  # keep the ids up to the one that completed the stop sequence; its text is not returned
            end = next(
                k
                for k in range(1, len(ids) + 1)
                if hit[1] in reply_text(self.tokenizer, ids[:k], "length")
            )
            ids, logprobs, versions, finish, text = (
                ids[:end],
                logprobs[:end],
                versions[:end],
                "stop_sequence",
                text[: hit[0]],
            )
        content, calls = wires.parse_assistant(text)
        message = dict(
            {"role": "assistant", "content": content}, **({"tool_calls": calls} if calls else {})
        )
        routes = generation.extras.get("routed_experts")
        episode.add_sampled(
            ids,
            logprobs,
            versions,
            message,
            finish,
            None if routes is None else routes[: len(prompt) + len(ids)],
        )
        session.accumulator = episode  # committed: generation succeeded
        session.requests.append(
            {
                "session": session.session_id,
                "rollout_id": session.rollout_id,
                "wire": wire,
                "stream": chat.stream,
                "action": action,
                "prompt_tokens_reused": reused,
                "new_prompt_tokens": len(prompt) - reused,
                "generated_tokens": len(ids),
                "latency_s": time.perf_counter() - started,
                "time": time.time(),
            }
        )
        reply = wires.ChatReply(
            content,
            calls,
            "length" if finish == "length" else finish,
            len(prompt),
            len(ids),
            self.model_name,
            stop_sequence=hit[1] if hit else None,
        )
        return reply, ids

    def _pieces(self, ids, content: str) -> list[str]:
        """The reply's text as it was generated, one piece per token (for streaming)."""
        pieces, previous = [], ""
        for k in range(1, len(ids) + 1):
            text = reply_text(self.tokenizer, ids[:k], "length")[: len(content)]
            pieces.append(text[len(previous) :])
            previous = text
        return pieces


async def _route_errors(request, handler):
    """No such route or method: still the wire's error shape (Anthropic's under /v1/messages)."""
    from aiohttp import web

    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        shape = wires.anthropic_error if request.path.endswith("/messages") else wires.openai_error
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        return web.json_response(
            shape(
                wires.WireError(
                    error.status,
                    f"{error.reason}: {request.method} is not served at this path.",
                    kind,
                )
            ),
            status=error.status,
        )
