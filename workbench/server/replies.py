"""A policy's reply as the agent reads it, and a tool call forced in the policy's own format.

A reply is parsed by transformers' response parser (`tokenizer.parse_response`), driven by the
`response_template` its tokenizer config holds (the hermes `RESPONSE_TEMPLATE` when it holds none),
into content, reasoning and tool calls. A tool call that does not parse leaves the reply as text:
the agent sees exactly what was generated, and the call is counted as malformed. A forced tool
call opens as the policy's chat template renders one.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers.utils.chat_parsing.response_templates import (
    ResponseTemplate,
    load_response_template,
)

from workbench.models.tiny import RESPONSE_TEMPLATE
from workbench.server.wires.base import ChatRequest, WireError, field_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# two tool calls that differ first where the policy writes: in the name (tool_choice required) or,
# under one name, in the arguments (a named tool)
SENTINELS = ({"name": "x", "arguments": {}}, {"name": "y", "arguments": {"molt_wb_sentinel": 0}})


def response_template(tokenizer: PreTrainedTokenizerBase) -> dict:
    """The policy's response template: its tokenizer config's, else the hermes default."""
    return getattr(tokenizer, "response_template", None) or RESPONSE_TEMPLATE


@functools.lru_cache(8)
def compiled_template(tokenizer: PreTrainedTokenizerBase) -> ResponseTemplate:
    """The response template, compiled once (parsing a reply compiled it anew: 0.2 ms a time)."""
    return load_response_template(response_template(tokenizer))


def parse_reply(
    tokenizer: PreTrainedTokenizerBase, text: str, prefix: str | list[int], tools: list[dict] | None
) -> tuple[dict, int]:
    """The assistant message a turn's `text` (as generated, a forced opening included) says after
    the prompt `prefix` (its text or ids), and how many malformed tool calls it holds (its content
    is then its whole text)."""
    try:
        template = compiled_template(tokenizer)
        parsed = tokenizer.parse_response(text, template, prefix=prefix, tools=tools)
        calls = [_tool_call(call) for call in parsed.get("tool_calls") or []]
    # the parser's refusals: a call that is not JSON, a field the template requires
    except (ValueError, KeyError, TypeError):
        return {"role": "assistant", "content": text}, 1
    if None in calls:
        return {"role": "assistant", "content": text}, calls.count(None)
    message = {"role": "assistant", "content": parsed.get("content") or ""}
    if parsed.get("thinking"):
        message["reasoning_content"] = parsed["thinking"]
    if calls:
        message["tool_calls"] = calls
    return message, 0


def _tool_call(call: Any) -> dict | None:
    """A parsed call as the chat template's tool call; None for a malformed one (no name, or
    arguments that are not an object)."""
    function = field_of(call, "function")
    if not isinstance(function, dict):
        return None
    name = function.get("name")
    arguments = function.get("arguments", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:12]}", "name": name, "arguments": arguments}


def shown(message: dict, text: str, hidden: int, pieces: list[str]) -> dict[str, list[str]]:
    """The reply's reasoning and content as parts of `pieces` (the turn's `text` in the pieces it
    was generated in) past its first `hidden` characters (a prefill the reply continues); a field
    that is not a stretch of the text, once parsed, is one piece."""
    fields = {}
    after = 0
    for name, key in (("reasoning", "reasoning_content"), ("content", "content")):
        value = message.get(key) or ""
        start = text.find(value, after)
        fields[name] = [value] if value else []
        if value and start >= 0:
            after = start + len(value)
            fields[name] = pieces_in(pieces, max(start, hidden), after)
    return fields


def pieces_in(pieces: list[str], start: int, end: int) -> list[str]:
    """The parts of `pieces` (consecutive pieces of one text) that lie in [start, end)."""
    parts = []
    offset = 0
    for piece in pieces:
        part = piece[max(start - offset, 0) : max(end - offset, 0)]
        if part:
            parts.append(part)
        offset += len(piece)
    return parts


def forced_text(
    tokenizer: PreTrainedTokenizerBase,
    render: Callable[[list[dict], bool], str],
    messages: list[dict],
    chat: ChatRequest,
) -> str:
    """The text a turn is forced to start with: the prefill, or the opening of a tool call as the
    chat template (`render(messages, generation_prompt)`) renders one after `messages`: the turn up
    to the name (tool_choice required) or to the arguments (a named tool), cut back to where its
    ids are the render's; where the template renders none, the response template's literal
    opening."""
    if chat.prefill or chat.forced_tool is None:
        return chat.prefill
    prompt = render(messages, True)
    turns = []
    for sentinel in SENTINELS:
        call = dict(sentinel, id="call_0", name=chat.forced_tool or sentinel["name"])
        turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        try:
            rendered = render([*messages, turn], False)
        # the template renders no tool call
        except Exception:
            rendered = ""
        turns.append(rendered.removeprefix(prompt) if rendered.startswith(prompt) else "")
    # the turns differ where the policy writes: a template that ignores the call forces nothing
    opening = ""
    if turns[0] != turns[1]:
        opening = os.path.commonprefix(turns)
    encoded = [tokenizer.encode(turn, add_special_tokens=False) for turn in turns]
    for end in range(len(opening), 0, -1):
        ids = tokenizer.encode(opening[:end], add_special_tokens=False)
        if all(turn[: len(ids)] == ids for turn in encoded):
            return opening[:end]
    literal = response_template(tokenizer)["fields"].get("tool_calls", {}).get("open")
    if not isinstance(literal, str):
        raise WireError(
            "tool_choice cannot be forced: the policy's chat template renders no tool call and its "
            "response template opens none with a literal."
        )
    return literal
