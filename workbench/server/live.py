"""A streamed turn as it is sampled: its content goes out as soon as no later token can change it,
the rest of the reply when the turn ends, and the streamed text is still exactly the reply's (#14).

What no later token can change: transformers' streaming parser (`ResponseParser`, which parses the
whole reply too), run on the policy's response template, holds back any text that may still open
a tool call or reasoning; the text from where a stop sequence may start is held too, and trailing
whitespace where the template strips content. Content goes out until anything else opens (or the
content closes); a reply that opens with reasoning, or with forced text (a prefill, a forced tool
call), goes out when it ends. A live reply's content comes first in its events, before its
reasoning and tool calls (`ChatReply.live`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import regex
from aiohttp import web

from workbench.invariants.token_identity import reply_text
from workbench.server.replies import compiled_template, pieces_in
from workbench.server.wires.base import ChatReply, ChatRequest, Wire

if TYPE_CHECKING:
    from workbench.server.loopback import LoopbackServer

# a stream that holds all its text wakes the event loop at each of its first HELD_IDS ids (each wake
# decodes all its ids so far), then once per STREAM_GAP
HELD_IDS = 16


class EventStream(web.StreamResponse):
    """A server-sent event stream whose headers go out with its first events, in one send (as
    aiohttp's own `Response` sends its headers with its body)."""

    _send_headers_immediately = False

    def __init__(self) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


class Live:
    """One streamed request's events, written as its content is sampled."""

    def __init__(self, request: web.Request, wire: Wire):
        self.request = request
        self.wire = wire
        # the content sent, in the pieces it went out in, and how many the events have taken
        self.pieces: list[str] = []
        self.taken = 0
        # opened with the first piece
        self.response: EventStream | None = None
        # events written
        self.written = 0
        # None once nothing more goes out live
        self.parser = None
        self.writer: asyncio.Task | None = None

    def begin(
        self,
        chat: ChatRequest,
        server: LoopbackServer,
        prefix: str,
        stop_ids: tuple[int, ...],
        prompt_tokens: int,
    ) -> None:
        """Follow the turn `server` samples after the prompt whose text is `prefix`."""
        self.tokenizer = server.tokenizer
        self.stop_ids = set(stop_ids)
        self.stops = regex.compile("|".join(regex.escape(stop) for stop in chat.stop) or r"\Z")
        template = compiled_template(self.tokenizer)
        content = template.fields.get("content")
        self.strip = content.content_args.get("strip", True) if content else True
        self.parser = self.tokenizer.get_response_parser(template, prefix=prefix, tools=chat.tools)
        self.ids: list[int] = []
        # ids looked at
        self.seen = 0
        self.fed = ""
        self.content = ""
        # the reply's events, drawn as its pieces go out
        self.reply = ChatReply(
            text="",
            tool_calls=[],
            finish="stop",
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            model=server.model_name,
            pieces={"reasoning": [], "content": self._taken()},
            live=True,
        )
        self.events = self.wire.events(chat, self.reply)

    def add(self, ids: list[int]) -> bool:
        """New sampled ids (on the event loop): what they make certain goes out. True while nothing
        has gone out yet (its first text may still open a tool call, ...), for its first HELD_IDS
        ids: its next ids should come at once."""
        self.ids += ids
        if self.parser is not None and (self.writer is None or self.writer.done()):
            try:
                piece = self._release()
            # the parser refused the text so far: the rest goes out when the turn ends
            except Exception:
                self.parser = None
                piece = ""
            if piece:
                self.writer = asyncio.get_running_loop().create_task(self._write(piece))
        return self.writer is None and self.parser is not None and len(self.ids) < HELD_IDS

    async def close(self) -> None:
        """The turn ended: nothing more goes out live once the last write is done."""
        self.parser = None
        if self.writer is not None:
            await asyncio.gather(self.writer, return_exceptions=True)

    def final(self, reply: ChatReply) -> ChatReply:
        """The turn's reply as it went out: the opening's id, and its content in the pieces sent,
        then the rest."""
        rest = pieces_in(reply.pieces["content"], len("".join(self.pieces)), len(reply.text))
        pieces = dict(reply.pieces, content=[*self.pieces, *rest])
        return replace(reply, id=self.reply.id, pieces=pieces, live=True)

    async def _write(self, piece: str) -> None:
        while piece:
            if self.response is None:
                response = EventStream()
                await response.prepare(self.request)
                self.response = response
            self.pieces.append(piece)
            # the reply's opening events (the first time), then the piece's: one write
            events = []
            while self.taken < len(self.pieces):
                events.append(next(self.events))
            self.written += len(events)
            await self.response.write(b"".join(events))
            piece = self._release()

    def _taken(self) -> Iterator[str]:
        """The pieces sent, as the events take them: one more each time one goes out."""
        while self.taken < len(self.pieces):
            self.taken += 1
            yield self.pieces[self.taken - 1]

    def _release(self) -> str:
        """The content the ids sampled so far make certain, past what was sent ("" for none)."""
        # nothing new since the last look
        if self.parser is None or self.seen == len(self.ids):
            return ""
        self.seen = len(self.ids)
        stop = next((k for k, token in enumerate(self.ids) if token in self.stop_ids), None)
        # a character whose bytes are not all sampled yet waits, and the text from where a stop
        # sequence may start
        text = reply_text(self.tokenizer, self.ids[:stop], "length").rstrip("\ufffd")
        text = text[: self.stops.search(text, partial=True).start()]
        if not text.startswith(self.fed):
            self.parser = None
            return ""
        new = text[len(self.fed) :]
        self.fed = text
        for event in self.parser.feed(new):
            # reasoning or a tool call opened, or the content closed: the rest waits for the end
            if event["field"] != "content" or event["type"] == "region_close":
                self.parser = None
                break
            if event["type"] == "region_chunk":
                self.content += event["text"]
        content = self.content
        if self.strip:
            # the template strips content: whitespace at its end may be its last
            content = content.strip()
        sent = "".join(self.pieces)
        if not content.startswith(sent):
            return ""
        return content[len(sent) :]
