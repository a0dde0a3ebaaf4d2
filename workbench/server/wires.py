"""The two wires the loopback server speaks — OpenAI chat completions and Anthropic messages.

Each decodes a request body into one `ChatRequest` (messages in the chat template's own form:
role, content, tool_calls, tool_call_id) and encodes one `ChatReply` back, whole or as that wire's
server-sent events. A field the server does not support is refused in the wire's own error shape.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field


class WireError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    temperature: float | None
    stop: list[str]
    stream: bool
    include_usage: bool = False

    def __post_init__(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise WireError(400, "max_tokens must be at least 1.")
        if self.temperature is not None and not 0 <= self.temperature <= 100:
            raise WireError(400, "temperature must be a number from 0 to 100.")


@dataclass
class ChatReply:
    text: str
    tool_calls: list[dict]  # {"id", "name", "arguments": dict}
    finish: str  # stop | length | stop_sequence
    prompt_tokens: int
    completion_tokens: int
    model: str
    stop_sequence: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_assistant(text: str) -> tuple[str, list[dict]]:
    """Split generated text into its content and its well-formed <tool_call> blocks."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:12]}",
                    "name": str(call["name"]),
                    "arguments": dict(call.get("arguments") or {}),
                }
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return (
                text,
                [],
            )  # a malformed call stays text: the agent sees exactly what was generated
    return (text[: text.index("<tool_call>")] if calls else text), calls


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(p.get("text", "") for p in content)
    raise WireError(400, f"{where}: only text content is supported here.")


def _image(data: str, where: str) -> dict:
    """An inline image (`data:image/png;base64,...` or bare base64) as a content part; nothing is ever fetched."""
    import base64
    import binascii
    import io

    from PIL import Image

    header, _, payload = data.partition(",") if data.startswith("data:") else ("base64", "", data)
    try:
        if "base64" not in header:
            raise ValueError
        raw = base64.b64decode(payload, validate=True)
        Image.open(io.BytesIO(raw)).verify()
    except (ValueError, binascii.Error, OSError):
        raise WireError(
            400,
            f"{where}: an image must be inline base64 data of a PNG or JPEG "
            f"(data:image/png;base64,...); URLs are not fetched.",
        ) from None
    return {"type": "image", "image": raw}


def _content(content, where: str):
    """A user message's content: its text, or a list of text and image parts when it holds images."""
    if not isinstance(content, list):
        return _text(content, where)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":  # OpenAI
            parts.append(_image(str((part.get("image_url") or {}).get("url", "")), where))
        elif kind == "image" and isinstance(part.get("source"), dict):  # Anthropic
            parts.append(_image(str(part["source"].get("data", "")), where))
        else:
            raise WireError(
                400,
                f"{where}: content part type {kind!r} is not supported (text and inline images are).",
            )
    return parts if any(p["type"] == "image" for p in parts) else "".join(p["text"] for p in parts)


def _number(body: dict, key: str, kind=float):
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise WireError(400, f"'{key}' must be a number.")
    return None if value is None else kind(value)


def _strings(value, key: str) -> list[str]:
    values = [value] if isinstance(value, str) else (value or [])
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise WireError(400, f"'{key}' must be a string or a list of strings.")
    return values


def _objects(value, key: str) -> list[dict]:
    if value is not None and not (
        isinstance(value, list) and all(isinstance(v, dict) for v in value)
    ):
        raise WireError(400, f"'{key}' must be a list of objects.")
    return value or []


def _arguments(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise WireError(400, f"{where}: tool call arguments must be a JSON object.")
    return value


def _refuse_unknown(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise WireError(
            400,
            f"Unsupported field(s) {', '.join(unknown)}: this server samples exact token ids and supports only "
            f"{', '.join(sorted(allowed))}.",
        )


# ---- OpenAI chat completions

OPENAI_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "n",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "user",
    "seed",
    "metadata",
    "parallel_tool_calls",
}


def openai_request(body: dict) -> ChatRequest:
    _refuse_unknown(body, OPENAI_FIELDS)
    if body.get("n", 1) != 1:
        raise WireError(400, "Only n=1 is supported: send one request per sample.")
    if body.get("top_p", 1) != 1:
        raise WireError(
            400, "Only top_p=1 is supported: the learner must be able to recompute every log-prob."
        )
    if body.get("tool_choice", "auto") not in ("auto", "none"):
        raise WireError(400, "Only tool_choice 'auto' or 'none' is supported.")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "'messages' must be a non-empty list.")
    messages = []
    for index, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise WireError(
                400, f"messages[{index}].role must be system, developer, user, assistant or tool."
            )
        read = _content if role == "user" else _text
        entry = {
            "role": "system" if role == "developer" else role,
            "content": read(message.get("content"), f"messages[{index}]"),
        }
        if role == "assistant" and message.get("tool_calls"):
            try:
                entry["tool_calls"] = [
                    {
                        "id": str(c["id"]),
                        "name": str(c["function"]["name"]),
                        "arguments": _arguments(
                            json.loads(c["function"]["arguments"] or "{}"), f"messages[{index}]"
                        ),
                    }
                    for c in message["tool_calls"]
                ]
            except (KeyError, TypeError, ValueError, RecursionError):
                raise WireError(
                    400, f"messages[{index}].tool_calls must be function calls with JSON arguments."
                ) from None
        if role == "tool":
            entry["tool_call_id"] = str(message.get("tool_call_id", ""))
        messages.append(entry)
    tools = None if body.get("tool_choice") == "none" else _objects(body.get("tools"), "tools")
    if not isinstance(body.get("stream_options") or {}, dict):
        raise WireError(400, "'stream_options' must be an object.")
    return ChatRequest(
        messages,
        tools or None,
        _number(body, "max_completion_tokens", int) or _number(body, "max_tokens", int),
        _number(body, "temperature"),
        _strings(body.get("stop"), "stop"),
        bool(body.get("stream")),
        bool((body.get("stream_options") or {}).get("include_usage")),
    )


def _openai_tool_calls(reply: ChatReply, with_index: bool = False) -> list[dict]:
    return [
        dict(
            {"index": i} if with_index else {},
            id=c["id"],
            type="function",
            function={"name": c["name"], "arguments": json.dumps(c["arguments"])},
        )
        for i, c in enumerate(reply.tool_calls)
    ]


def _openai_finish(reply: ChatReply) -> str:
    return "tool_calls" if reply.tool_calls else ("length" if reply.finish == "length" else "stop")


def _usage(reply: ChatReply) -> dict:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def openai_reply(reply: ChatReply) -> dict:
    message = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["tool_calls"] = _openai_tool_calls(reply)
    return {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _openai_finish(reply),
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def openai_events(reply: ChatReply, include_usage: bool, pieces: list[str]) -> list[bytes]:
    """SSE chunks: role, one chunk per generated text piece, tool calls, finish, usage, [DONE]."""

    def chunk(delta: dict, finish=None, usage=None) -> bytes:
        body = {
            "id": f"chatcmpl-{reply.id}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": reply.model,
            "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    events = [chunk({"role": "assistant", "content": ""})] + [
        chunk({"content": piece}) for piece in pieces if piece
    ]
    if reply.tool_calls:
        events.append(chunk({"tool_calls": _openai_tool_calls(reply, with_index=True)}))
    events.append(chunk({}, finish=_openai_finish(reply)))
    if include_usage:
        events.append(chunk({}, usage=_usage(reply)))
    return events + [b"data: [DONE]\n\n"]


def openai_error(error: WireError) -> dict:
    return {"error": {"message": error.message, "type": error.kind, "param": None, "code": None}}


# ---- Anthropic messages

ANTHROPIC_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "system",
    "temperature",
    "top_p",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
}


def anthropic_request(body: dict) -> ChatRequest:
    _refuse_unknown(body, ANTHROPIC_FIELDS)
    if body.get("top_p", 1) != 1:
        raise WireError(
            400, "Only top_p=1 is supported: the learner must be able to recompute every log-prob."
        )
    if not isinstance(body.get("max_tokens"), int):
        raise WireError(400, "max_tokens: Field required (an integer).")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise WireError(400, "messages: must be a non-empty list.")
    system = body.get("system")
    messages = [{"role": "system", "content": _text(system, "system")}] if system else []
    for index, message in enumerate(raw):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise WireError(400, f"messages.{index}.role: must be user or assistant.")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise WireError(400, f"messages.{index}.content: must be a string or a list of blocks.")
        text, calls, parts = [], [], []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(block.get("text", ""))
                parts.append(block)
            elif kind == "image" and role == "user":
                parts.append(block)
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    {
                        "id": str(block.get("id", "")),
                        "name": str(block.get("name", "")),
                        "arguments": _arguments(
                            block.get("input") or {}, f"messages.{index}.content"
                        ),
                    }
                )
            elif kind == "tool_result" and role == "user":
                messages.append(
                    {
                        "role": "tool",
                        "content": _text(block.get("content"), f"messages.{index}.tool_result"),
                        "tool_call_id": str(block.get("tool_use_id", "")),
                    }
                )
            else:
                raise WireError(
                    400,
                    f"messages.{index}.content: block type {kind!r} is not supported for role {role}.",
                )
        if role == "assistant":
            messages.append(
                dict(
                    {"role": "assistant", "content": "".join(text)},
                    **({"tool_calls": calls} if calls else {}),
                )
            )
        elif parts:
            messages.append(
                {"role": "user", "content": _content(parts, f"messages.{index}.content")}
            )
    tools = [
        {
            "type": "function",
            "function": {
                "name": str(t.get("name")),
                "description": str(t.get("description", "")),
                "parameters": _arguments(t.get("input_schema", {}), "tools"),
            },
        }
        for t in _objects(body.get("tools"), "tools")
    ]
    if not isinstance(body.get("tool_choice") or {}, dict):
        raise WireError(400, 'tool_choice: must be an object such as {"type": "auto"}.')
    if (body.get("tool_choice") or {}).get("type", "auto") not in ("auto", "none"):
        raise WireError(400, "tool_choice: only auto or none is supported.")
    if (body.get("tool_choice") or {}).get("type") == "none":
        tools = []
    return ChatRequest(
        messages,
        tools or None,
        body["max_tokens"],
        _number(body, "temperature"),
        _strings(body.get("stop_sequences"), "stop_sequences"),
        bool(body.get("stream")),
    )


def _anthropic_stop(reply: ChatReply) -> str:
    return (
        "tool_use"
        if reply.tool_calls
        else "max_tokens"
        if reply.finish == "length"
        else "stop_sequence"
        if reply.finish == "stop_sequence"
        else "end_turn"
    )


def anthropic_reply(reply: ChatReply) -> dict:
    content = [{"type": "text", "text": reply.text}] if reply.text or not reply.tool_calls else []
    content += [
        {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
        for c in reply.tool_calls
    ]
    return {
        "id": f"msg_{reply.id}",
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": _anthropic_stop(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
    }


def anthropic_events(reply: ChatReply, pieces: list[str]) -> list[bytes]:
    """message_start, per block start / deltas / stop, message_delta, message_stop."""

    def event(name: str, data: dict) -> bytes:
        return f"event: {name}\ndata: {json.dumps(dict(type=name, **data))}\n\n".encode()

    whole = anthropic_reply(reply)
    start = dict(
        whole,
        content=[],
        stop_reason=None,
        usage={"input_tokens": reply.prompt_tokens, "output_tokens": 0},
    )
    events = [event("message_start", {"message": start})]
    for index, block in enumerate(whole["content"]):
        if block["type"] == "text":
            events.append(
                event(
                    "content_block_start",
                    {"index": index, "content_block": {"type": "text", "text": ""}},
                )
            )
            events += [
                event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "text_delta", "text": piece}},
                )
                for piece in pieces
                if piece
            ]
        else:
            events.append(
                event(
                    "content_block_start", {"index": index, "content_block": dict(block, input={})}
                )
            )
            events.append(
                event(
                    "content_block_delta",
                    {
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(block["input"]),
                        },
                    },
                )
            )
        events.append(event("content_block_stop", {"index": index}))
    events.append(
        event(
            "message_delta",
            {
                "delta": {
                    "stop_reason": whole["stop_reason"],
                    "stop_sequence": reply.stop_sequence,
                },
                "usage": {"output_tokens": reply.completion_tokens},
            },
        )
    )
    return events + [event("message_stop", {})]


def anthropic_error(error: WireError) -> dict:
    return {"type": "error", "error": {"type": error.kind, "message": error.message}}
