"""The loopback server: an agent's stock OpenAI or Anthropic SDK talks to the rollout engine.

One per rollout worker, on 127.0.0.1 and a free port, on its own event-loop thread. Every episode
gets a session (`/s/<session>/v1/...`) with its own key. Every wire (workbench/server/wires/, one
object each; the server never asks which it serves) decodes into the session's
`TokenAccumulator`: a request that continues the conversation adds only the rendered delta and
generation continues from the exact accumulated ids; otherwise the segment is sealed and a new
one starts. A reply goes back as the policy's response template parses it (`replies`). A turn is
committed only after generation succeeds; an identical retry gets the cached reply and records
nothing twice. Requests of all sessions reach the engine together (`batcher`: the vLLM engine's
running batch, or one call per batch), and a streamed reply goes out as it is sampled (`live`).

Hostile input (fuzzed in tests/server/test_fuzz.py) gets a 4xx in the wire's error shape and
changes nothing: bodies over MAX_BODY, prompt + max_tokens over the token limit, malformed or
deeply nested JSON, wrong types, unknown routes. Keys are compared in constant time; nothing a
request says is read from or written to a file.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web
from aiohttp.typedefs import Handler

from workbench.engines.base import Engine, SamplingParams, derived_seed
from workbench.invariants.token_identity import (
    SegmentTokens,
    TokenAccumulator,
    reply_text,
    stream_pieces,
)
from workbench.server.batcher import Batcher
from workbench.server.live import EventStream, Live
from workbench.server.replies import forced_text, parse_reply, shown
from workbench.server.wires import WIRES, wire_at
from workbench.server.wires.base import ChatReply, ChatRequest, Wire, WireError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_BODY = 4 * 2**20
# what a wire's decoder raises on a field of the wrong type (a list where a string belongs, ...)
MALFORMED = (TypeError, ValueError, AttributeError, KeyError, OverflowError)


@dataclass
class Session:
    session_id: str
    api_key: str
    rollout_id: int
    # which of its rollout's sessions this is (the episode's 0, its judge's 1): seeds its requests
    stream: int = 0
    accumulator: TokenAccumulator | None = None
    last_request: str | None = None
    # the last request's (ChatRequest, ChatReply), handed again to its retry
    last_response: tuple[ChatRequest, ChatReply] | None = None
    requests: list[dict] = field(default_factory=list)
    # made on the worker's thread, bound to the server's event loop when first used
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # by reply id, the conversation a reply ended, for a request that continues it by naming the
    # reply (the Responses wire's previous_response_id)
    conversations: dict[str, list[dict]] = field(default_factory=dict)


class LoopbackServer:
    """One rollout worker's server: its sessions, its engine's batcher, and a route per wire."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        model_name: str = "policy",
        max_total_tokens: int | None = None,
        wires: tuple[Wire, ...] = WIRES,
        seed: int | None = None,
        history_rewrite: str = "seal",
    ):
        """`seed`: each request samples from a seed of (seed, rollout id, session stream, turn), so
        a run's chat episodes sample the same after a resume; None: the engine's own stream.
        `history_rewrite`: seal | bridge, when the chat template rewrites an episode's history
        (`TokenAccumulator`'s `rewrite`)."""
        self.engine = engine
        self.seed = seed
        self.history_rewrite = history_rewrite
        self.tokenizer = tokenizer
        self.params = params
        self.model_name = model_name
        self.wires = wires
        model_config = getattr(getattr(engine, "model", None), "config", None)
        context = getattr(model_config, "max_position_embeddings", None)
        # prompt + max_tokens of one request
        self.max_total_tokens = max_total_tokens or context or 32768
        # a vision-language policy's image codec
        self.codec = getattr(engine, "codec", None)
        self.sessions: dict[str, Session] = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="loopback").start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._route_errors])
        for prefix in ("", "/s/{session}"):
            app.router.add_get(f"{prefix}/v1/models", self._models)
            app.router.add_get(f"{prefix}/v1/models/{{model}}", self._model)
        app.router.add_post("/s/{session}/v1/messages/count_tokens", self._count_tokens)
        for wire in self.wires:
            app.router.add_post(
                f"/s/{{session}}{wire.path}", functools.partial(self._handle, wire=wire)
            )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.batcher = Batcher(self.engine)
        return site._server.sockets[0].getsockname()[1]

    # ---- sessions (called from the worker's thread)

    def open_session(self, rollout_id: int, stream: int = 0) -> dict[str, str]:
        session = Session(
            session_id=secrets.token_hex(8),
            api_key="sk-" + secrets.token_hex(16),
            rollout_id=rollout_id,
            stream=stream,
        )
        self.sessions[session.session_id] = session
        base = f"{self.url}/s/{session.session_id}"
        # each wire's SDK appends its own path to its base URL
        base_urls = {wire.base_url_key: base + wire.base_url_suffix for wire in self.wires}
        return {"session": session.session_id, **base_urls, "api_key": session.api_key}

    def close_session(self, session_id: str) -> tuple[list[SegmentTokens], list[dict]]:
        """End a session: its token-exact segments (none if it never generated) and its request
        rows."""
        session = self.sessions.pop(session_id)
        segments = []
        if session.accumulator:
            segments = session.accumulator.finish()
        return segments, session.requests

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _stop(self) -> None:
        self.batcher.task.cancel()
        await self.runner.cleanup()

    # ---- HTTP

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_name:
            missing = WireError(
                f"No model {request.match_info['model']!r}: this server serves "
                f"{self.model_name!r}.",
                404,
                "not_found_error",
            )
            return _error_response(self.wires[0], missing)
        return web.json_response(self._model_card())

    def _model_card(self) -> dict[str, str | int]:
        return {"id": self.model_name, "object": "model", "owned_by": "molt-wb", "created": 0}

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count_tokens: the prompt's tokens as the chat template renders them."""
        wire = next(wire for wire in self.wires if wire.name == "anthropic")
        try:
            self._session(request)
            body = await _json_body(request)
            # count_tokens takes no max_tokens
            chat = _decode(wire, dict(body, max_tokens=1))
            # rendered as a new episode's first request
            episode, _, _ = self._episode(Session("", "", 0), chat)
        except WireError as error:
            return _error_response(wire, error)
        return web.json_response({"input_tokens": len(episode.token_ids)})

    async def _handle(self, request: web.Request, wire: Wire) -> web.StreamResponse:
        started = time.perf_counter()
        # a streamed turn's events, written as it is sampled
        live = Live(request, wire)
        try:
            session = self._session(request)
            body = await _json_body(request)
            chat = _decode(wire, body)
            request_bytes = wire.name.encode() + json.dumps(body, sort_keys=True).encode()
            fingerprint = hashlib.sha256(request_bytes).hexdigest()
            async with session.lock:
                if fingerprint != session.last_request:
                    # a request that can name an earlier reply (a Responses request) continues the
                    # conversation that reply ended, and keeps the one it ends
                    continued = getattr(chat, "continued", None)
                    if continued:
                        chat = continued(session.conversations)
                    reply = await self._turn(session, chat, wire, started, live)
                    if continued:
                        ended = chat.history(session.accumulator.messages)
                        session.conversations[reply.id] = ended
                    session.last_request = fingerprint
                    session.last_response = (chat, reply)
                # a retry gets the committed reply, nothing new
                chat, reply = session.last_response
        except WireError as error:
            return await _refuse(wire, error, live)
        # the engine failed: nothing was committed, the client may retry
        except Exception as error:
            failure = WireError(
                f"Generation failed ({type(error).__name__}: {error}); nothing was recorded, "
                f"retry the request.",
                500,
                "api_error",
            )
            return await _refuse(wire, failure, live)
        if not chat.stream:
            return web.json_response(wire.reply(reply))
        response = live.response
        if response is None:
            response = EventStream()
            await response.prepare(request)
        # the events that did not go out as the reply was sampled, in one write
        rest = itertools.islice(wire.events(chat, reply), live.written, None)
        await response.write_eof(b"".join(rest))
        return response

    @web.middleware
    async def _route_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """No such route or method: still a wire's error shape (that of the wire the path
        names)."""
        try:
            return await handler(request)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            kind = "invalid_request_error"
            if error.status == 404:
                kind = "not_found_error"
            message = f"{error.reason}: {request.method} is not served at this path."
            refused = WireError(message, error.status, kind)
            return _error_response(wire_at(self.wires, request.path), refused)

    def _session(self, request: web.Request) -> Session:
        """The session the request's path names, if the request holds that session's key."""
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            raise WireError(
                "Unknown session: use the base URL handed to this episode.", 404, "not_found_error"
            )
        bearer = request.headers.get("Authorization", "").removeprefix("Bearer ")
        given = request.headers.get("x-api-key") or bearer
        if not hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), session.api_key.encode()
        ):
            raise WireError("Invalid API key for this session.", 401, "authentication_error")
        return session

    async def _turn(
        self, session: Session, chat: ChatRequest, wire: Wire, started: float, live: Live
    ) -> ChatReply:
        """Extend or seal, generate, and only then commit the turn to the session."""
        episode, action, reused = self._episode(session, chat)
        forced = forced_text(self.tokenizer, episode.render, episode.messages, chat)
        forced_ids = self.tokenizer(forced, add_special_tokens=False)["input_ids"] if forced else []
        prompt = np.concatenate([episode.token_ids, np.asarray(forced_ids, dtype=np.int32)])
        # the prompt's text, which the response parsers start from
        prefix = self.tokenizer.decode(episode.token_ids)
        params = self._sampling(chat, len(prompt))
        if self.seed is not None:
            # committed turns so far: a refused or failed request draws the same seed again
            seed = derived_seed(
                self.seed, session.rollout_id, session.stream, len(session.requests)
            )
            params = replace(params, seed=seed)
        listener = None
        if chat.stream and not forced:
            live.begin(chat, self, prefix, params.stop_token_ids, len(prompt))
            listener = live.add
        generation = await self.batcher.generate(prompt, params, episode.open.images, listener)
        await live.close()
        ids = generation.token_ids
        logprobs = generation.logprobs
        versions = generation.versions
        finish = generation.finish_reason
        text = reply_text(self.tokenizer, ids, finish)
        stop_sequence = None
        stop = _first_stop(text, chat.stop)
        if stop is not None:
            # keep the ids up to the one that completed the stop sequence; its text is not returned
            start, stop_sequence = stop
            end = self._ids_holding(ids, stop_sequence)
            ids = ids[:end]
            logprobs = logprobs[:end]
            versions = versions[:end]
            finish = "stop_sequence"
            text = text[:start]
        message, malformed = parse_reply(self.tokenizer, forced + text, prefix, chat.tools)
        routes = generation.extras.get("routed_experts")
        if routes is not None:
            routes = routes[: len(prompt) + len(ids)]
        episode.add_forced(forced_ids)
        raw = generation.extras.get("raw_logprobs")
        raw = None if raw is None else raw[: len(ids)]
        episode.add_sampled(ids, logprobs, versions, message, finish, routes, stop_sequence, raw)
        # committed: generation succeeded
        session.accumulator = episode
        session.requests.append(
            {
                "session": session.session_id,
                "rollout_id": session.rollout_id,
                "wire": wire.name,
                "stream": chat.stream,
                "action": action,
                "prompt_tokens_reused": reused,
                "new_prompt_tokens": len(prompt) - reused,
                "generated_tokens": len(ids),
                # calls that did not parse, the reply left as text (identity/malformed_tool_calls)
                "malformed_tool_calls": malformed,
                "latency_s": time.perf_counter() - started,
                "time": time.time(),
            }
        )
        # a streamed reply goes out in the pieces it was generated in (past what went out live: one)
        pieces = [forced + text]
        if chat.stream and not live.pieces:
            pieces = [forced, *stream_pieces(self.tokenizer, ids, text)]
        # a prefilled turn's reply continues the prefill
        fields = shown(message, forced + text, len(chat.prefill), pieces)
        reply = ChatReply(
            text="".join(fields["content"]),
            reasoning="".join(fields["reasoning"]),
            pieces=fields,
            tool_calls=message.get("tool_calls", []),
            finish=finish,
            prompt_tokens=len(prompt),
            completion_tokens=len(ids),
            model=self.model_name,
            stop_sequence=stop_sequence,
        )
        if live.pieces:
            reply = live.final(reply)
        if chat.logprobs:
            tokens = [self.tokenizer.decode([token]) for token in ids]
            reply.token_logprobs = list(zip(tokens, map(float, logprobs), strict=True))
        return reply

    def _episode(self, session: Session, chat: ChatRequest) -> tuple[TokenAccumulator, str, int]:
        """A copy of the session's episode with the request's messages (extended by their rendered
        delta, or sealed and started anew), or a new episode; the action taken; and how many of
        the prompt's ids were already there."""
        episode = None
        reused = 0
        if session.accumulator:
            episode = session.accumulator.fork()
            reused = len(episode.open.token_ids)
        try:
            if episode is None:
                episode = TokenAccumulator(
                    self.tokenizer, chat.messages, chat.tools, self.codec, self.history_rewrite
                )
                action = "open"
            else:
                action = episode.continue_with(chat.messages, chat.tools)
        # e.g. an image sent to a text-only policy
        except ValueError as error:
            raise WireError(str(error)) from None
        # the chat template refused these messages (a role order, a tool call, ...)
        except Exception as error:
            raise WireError(
                f"The policy's chat template cannot render these messages "
                f"({type(error).__name__}: {error})."
            ) from None
        if action != "extend":
            reused = 0
        return episode, action, reused

    def _sampling(self, chat: ChatRequest, prompt_tokens: int) -> SamplingParams:
        """The server's sampling params with the request's max_tokens and temperature, if within
        the server's token limit."""
        temperature = self.params.temperature
        if chat.temperature is not None:
            temperature = chat.temperature
        max_tokens = chat.max_tokens or self.params.max_tokens
        params = replace(self.params, max_tokens=max_tokens, temperature=temperature)
        if prompt_tokens + params.max_tokens > self.max_total_tokens:
            raise WireError(
                f"The prompt ({prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds this server's limit of {self.max_total_tokens} tokens: shorten the "
                f"conversation or lower max_tokens."
            )
        return params

    def _ids_holding(self, ids: np.ndarray, text: str) -> int:
        """How many of the sampled ids it takes for their text to hold `text`."""
        for count in range(1, len(ids) + 1):
            if text in reply_text(self.tokenizer, ids[:count], "length"):
                return count
        return len(ids)


async def _json_body(request: web.Request) -> dict:
    """The request's body, which must be one JSON object of at most MAX_BODY bytes."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise WireError(
            f"Request body over {MAX_BODY} bytes: send a shorter conversation.",
            413,
            "request_too_large",
        ) from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    if not isinstance(body, dict):
        raise WireError(
            "Malformed JSON: the body must be one JSON object (UTF-8, not nested too deep)."
        )
    return body


def _decode(wire: Wire, body: dict) -> ChatRequest:
    """The wire's request; a field of the wrong type is a 400 that names the error."""
    try:
        return wire.decode(body)
    except MALFORMED as error:
        raise WireError(
            f"Malformed request ({type(error).__name__}: {error}): check the fields' types."
        ) from None


def _error_response(wire: Wire, error: WireError) -> web.Response:
    return web.json_response(wire.error(error), status=error.status)


async def _refuse(wire: Wire, error: WireError, live: Live) -> web.StreamResponse:
    """A refusal in the wire's shape; in a stream already under way, its last event."""
    await live.close()
    if live.response is None:
        return _error_response(wire, error)
    event = f"event: error\ndata: {json.dumps(wire.error(error))}\n\n"
    await live.response.write_eof(event.encode())
    return live.response


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the earliest stop sequence in `text` starts, and which it is; None if none is there."""
    found = [(text.index(stop), stop) for stop in stops if stop in text]
    return min(found, default=None)
