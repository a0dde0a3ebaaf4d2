"""The OpenAI chat-completions wire: `POST /v1/chat/completions`, whole or streamed, in OpenAI's
shapes."""

import json
import time
from collections.abc import Iterator
from typing import Any

from workbench.server.wires.base import (
    ChatReply,
    ChatRequest,
    Wire,
    WireError,
    chat_message,
    field_of,
    number,
    objects,
    openai_forced_tool,
    refuse_top_p,
    refuse_unsupported,
    strings,
    text_of,
    tool_call,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
# a streamed delta's key for each part of the reply
DELTA_KEYS = {"reasoning": "reasoning_content", "content": "content"}


class OpenAIChat(Wire):
    name = "openai"
    path = "/v1/chat/completions"
    base_url_key = "openai_base_url"
    base_url_suffix = "/v1"
    fields = "openai_chat"

    def decode(self, body: dict) -> ChatRequest:
        refuse_unsupported(body, self.fields)
        if not isinstance(body.get("logprobs", False), bool):
            raise WireError("'logprobs' must be true or false.")
        if body.get("n", 1) != 1:
            raise WireError("Only n=1 is supported: send one request per sample.")
        refuse_top_p(body)
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise WireError("'messages' must be a non-empty list.")
        messages = [_message(index, message) for index, message in enumerate(raw)]
        tools = None
        if body.get("tool_choice") != "none":
            tools = objects(body.get("tools"), "tools")
        # a named function: {"type": "function", "function": {"name": ...}}
        forced = openai_forced_tool(
            body.get("tool_choice"),
            tools,
            lambda choice: (choice.get("function") or {}).get("name"),
        )
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise WireError("'stream_options' must be an object.")
        return ChatRequest(
            messages=messages,
            tools=tools or None,
            max_tokens=(
                number(body, "max_completion_tokens", int) or number(body, "max_tokens", int)
            ),
            temperature=number(body, "temperature"),
            stop=strings(body.get("stop"), "stop"),
            stream=bool(body.get("stream")),
            include_usage=bool(stream_options.get("include_usage")),
            logprobs=body.get("logprobs", False),
            forced_tool=forced,
        )

    def reply(self, reply: ChatReply) -> dict:
        message = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = _tool_calls(reply)
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": _finish_reason(reply),
            "logprobs": _logprobs(reply),
        }
        return {
            "id": f"chatcmpl-{reply.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.model,
            "choices": [choice],
            "usage": _usage(reply),
        }

    def events(self, request: ChatRequest, reply: ChatReply) -> Iterator[bytes]:
        """Chunks: role, one per generated piece of reasoning and of text, tool calls, finish,
        usage, [DONE]."""
        yield _delta(reply, {"role": "assistant", "content": ""})
        order = ["reasoning", "content"]
        if reply.live:
            order.reverse()
        for name in order:
            for piece in reply.pieces[name]:
                yield _delta(reply, {DELTA_KEYS[name]: piece})
        if reply.tool_calls:
            # numbered in a streamed delta
            calls = [{"index": index, **call} for index, call in enumerate(_tool_calls(reply))]
            yield _delta(reply, {"tool_calls": calls})
        finish = {"index": 0, "delta": {}, "finish_reason": _finish_reason(reply)}
        if request.logprobs:
            # every sampled token's log-prob, with the last chunk (pieces are not tokens)
            finish["logprobs"] = _logprobs(reply)
        yield _chunk(reply, [finish])
        if request.include_usage:
            yield _chunk(reply, [], usage=_usage(reply))
        yield b"data: [DONE]\n\n"


def _message(index: int, message: Any) -> dict:
    """One request message in the chat template's form (a developer message is a system one)."""
    role = field_of(message, "role")
    if role not in ROLES:
        raise WireError(
            f"messages[{index}].role must be system, developer, user, assistant or tool."
        )
    where = f"messages[{index}]"
    entry = chat_message(role, message.get("content"), where)
    # the policy's reasoning, for a template that renders it
    if role == "assistant" and message.get("reasoning_content"):
        entry["reasoning_content"] = text_of(message["reasoning_content"], where)
    if role == "assistant" and message.get("tool_calls"):
        entry["tool_calls"] = _decode_tool_calls(where, message["tool_calls"])
    if role == "tool":
        entry["tool_call_id"] = str(message.get("tool_call_id", ""))
    return entry


def _decode_tool_calls(where: str, tool_calls: Any) -> list[dict]:
    """An assistant message's function calls, their JSON arguments parsed."""
    try:
        return [
            tool_call(
                call["id"],
                call["function"]["name"],
                json.loads(call["function"]["arguments"] or "{}"),
                where,
            )
            for call in tool_calls
        ]
    except (KeyError, TypeError, ValueError, RecursionError):
        raise WireError(f"{where}.tool_calls must be function calls with JSON arguments.") from None


def _tool_calls(reply: ChatReply) -> list[dict]:
    """The reply's tool calls as OpenAI function calls."""
    calls = []
    for call in reply.tool_calls:
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"])}
        calls.append({"id": call["id"], "type": "function", "function": function})
    return calls


def _logprobs(reply: ChatReply) -> dict | None:
    """The behavior log-prob of each sampled token (None unless the request asked for them)."""
    if not reply.token_logprobs:
        return None
    content = [
        {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}
        for token, logprob in reply.token_logprobs
    ]
    return {"content": content, "refusal": None}


def _finish_reason(reply: ChatReply) -> str:
    if reply.tool_calls:
        return "tool_calls"
    if reply.finish == "length":
        return "length"
    return "stop"


def _usage(reply: ChatReply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _chunk(reply: ChatReply, choices: list[dict], **extra: Any) -> bytes:
    """One server-sent chunk of the streamed reply."""
    body = {
        "id": f"chatcmpl-{reply.id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": reply.model,
        "choices": choices,
        **extra,
    }
    return f"data: {json.dumps(body)}\n\n".encode()


def _delta(reply: ChatReply, delta: dict) -> bytes:
    return _chunk(reply, [{"index": 0, "delta": delta, "finish_reason": None}])
