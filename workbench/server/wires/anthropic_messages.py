"""The Anthropic messages wire: `POST /v1/messages`, whole or streamed, in Anthropic's shapes.

Its content blocks become chat-template messages: a `tool_result` block is a `tool` message, a
`tool_use` block an assistant tool call, a `thinking` block the assistant's reasoning_content, and
the system prompt a leading system message.
"""

import json
from collections.abc import Iterator
from typing import Any

from workbench.server.wires.base import (
    ChatReply,
    ChatRequest,
    Wire,
    WireError,
    chat_message,
    field_of,
    forced_tool,
    number,
    objects,
    refuse_top_p,
    refuse_unsupported,
    strings,
    text_of,
    tool_arguments,
    tool_call,
    tool_message,
)

STOP_REASONS = {"length": "max_tokens", "stop_sequence": "stop_sequence"}
# a block streamed as generated: the reply's pieces it takes, and its delta type
STREAMED = {"thinking": ("reasoning", "thinking_delta"), "text": ("content", "text_delta")}


class AnthropicMessages(Wire):
    name = "anthropic"
    path = "/v1/messages"
    base_url_key = "anthropic_base_url"
    base_url_suffix = ""
    fields = "anthropic_messages"

    def decode(self, body: dict) -> ChatRequest:
        refuse_unsupported(body, self.fields)
        refuse_top_p(body)
        if not isinstance(body.get("max_tokens"), int):
            raise WireError("max_tokens: Field required (an integer).")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise WireError("messages: must be a non-empty list.")
        system = body.get("system")
        messages = []
        if system:
            messages.append(chat_message("system", system, "system"))
        for index, message in enumerate(raw):
            messages += _messages(index, message)
        prefill = ""
        # a last assistant message is a prefill: the reply continues it
        if messages and messages[-1]["role"] == "assistant":
            if messages[-1].get("tool_calls"):
                raise WireError("messages: a prefilled assistant turn holds text only.")
            prefill = messages.pop()["content"]
        tools, forced = _tools(body)
        return ChatRequest(
            messages=messages,
            tools=tools or None,
            forced_tool=forced,
            prefill=prefill,
            max_tokens=body["max_tokens"],
            temperature=number(body, "temperature"),
            stop=strings(body.get("stop_sequences"), "stop_sequences"),
            stream=bool(body.get("stream")),
        )

    def reply(self, reply: ChatReply) -> dict:
        content = []
        if reply.reasoning:
            # no signature: the reasoning is the policy's own text, echoed back as it is
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.text or not reply.tool_calls:
            # a live reply's text went out first
            content.insert(0 if reply.live else len(content), {"type": "text", "text": reply.text})
        for call in reply.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["name"],
                    "input": call["arguments"],
                }
            )
        stop_reason = STOP_REASONS.get(reply.finish, "end_turn")
        if reply.tool_calls:
            stop_reason = "tool_use"
        return {
            "id": f"msg_{reply.id}",
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": reply.stop_sequence,
            "usage": {
                "input_tokens": reply.prompt_tokens,
                "output_tokens": reply.completion_tokens,
            },
        }

    def events(self, request: ChatRequest, reply: ChatReply) -> Iterator[bytes]:
        """message_start, per block start / deltas / stop, message_delta, message_stop."""
        whole = self.reply(reply)
        usage = {"input_tokens": reply.prompt_tokens, "output_tokens": 0}
        start = dict(whole, content=[], stop_reason=None, usage=usage)
        yield _event("message_start", {"message": start})
        for index, block in enumerate(whole["content"]):
            yield from _block_events(index, block, reply.pieces)
        delta = {"stop_reason": whole["stop_reason"], "stop_sequence": reply.stop_sequence}
        yield _event(
            "message_delta",
            {"delta": delta, "usage": {"output_tokens": reply.completion_tokens}},
        )
        yield _event("message_stop", {})

    def error(self, error: WireError) -> dict:
        return {"type": "error", "error": {"type": error.kind, "message": error.message}}


def _messages(index: int, message: Any) -> list[dict]:
    """One request message as chat-template messages: a `tool` message per tool result, then the
    user's text and images (if any) or the assistant's text and tool calls."""
    role = field_of(message, "role")
    if role not in ("user", "assistant"):
        raise WireError(f"messages.{index}.role: must be user or assistant.")
    where = f"messages.{index}.content"
    blocks = message.get("content")
    if isinstance(blocks, str):
        blocks = [{"type": "text", "text": blocks}]
    if not isinstance(blocks, list):
        raise WireError(f"{where}: must be a string or a list of blocks.")
    # text and image blocks, as the content of the message
    parts = []
    thinking = []
    calls = []
    results = []
    for block in blocks:
        kind = field_of(block, "type")
        if kind == "text" or (kind == "image" and role == "user"):
            parts.append(block)
        elif kind == "thinking" and role == "assistant":
            thinking.append(text_of(block.get("thinking"), where))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input") or {}
            calls.append(tool_call(block.get("id", ""), block.get("name", ""), arguments, where))
        elif kind == "tool_result" and role == "user":
            answered = block.get("tool_use_id", "")
            result = tool_message(block.get("content"), answered, f"messages.{index}.tool_result")
            results.append(result)
        else:
            raise WireError(f"{where}: block type {kind!r} is not supported for role {role}.")
    if role == "assistant":
        assistant = chat_message(role, parts, where)
        if thinking:
            assistant["reasoning_content"] = "".join(thinking)
        if calls:
            assistant["tool_calls"] = calls
        return [assistant]
    if parts:
        return results + [chat_message(role, parts, where)]
    return results


def _tools(body: dict) -> tuple[list[dict], str | None]:
    """The request's tools as the chat template's function tools (none for tool_choice none), and
    the call tool_choice forces: None (auto, none), "" (any) or the named tool."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": str(tool.get("name")),
                "description": str(tool.get("description", "")),
                "parameters": tool_arguments(tool.get("input_schema", {}), "tools"),
            },
        }
        for tool in objects(body.get("tools"), "tools")
    ]
    choice = body.get("tool_choice") or {}
    if not isinstance(choice, dict):
        raise WireError('tool_choice: must be an object such as {"type": "auto"}.')
    kind = choice.get("type", "auto")
    if kind not in ("auto", "none", "any", "tool"):
        raise WireError("tool_choice: type must be auto, none, any or tool.")
    if kind == "none":
        return [], None
    if kind == "auto":
        return tools, None
    if not tools:
        raise WireError("tool_choice: forcing a tool call needs the tools it may call.")
    if kind == "any":
        return tools, ""
    return tools, forced_tool(choice.get("name"), tools, "tool_choice.name")


def _block_events(index: int, block: dict, pieces: dict[str, list[str]]) -> Iterator[bytes]:
    """A content block's start, its deltas (the reasoning or text as generated, or the tool input
    whole), and its stop."""
    kind = block["type"]
    if kind in STREAMED:
        field, delta = STREAMED[kind]
        opened = dict(block, **{kind: ""})
        # drawn as the pieces are: a live reply's content goes out as it is sampled
        deltas = ({"type": delta, kind: piece} for piece in pieces[field])
    else:
        opened = dict(block, input={})
        deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    yield _event("content_block_start", {"index": index, "content_block": opened})
    for streamed in deltas:
        yield _event("content_block_delta", {"index": index, "delta": streamed})
    yield _event("content_block_stop", {"index": index})


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(dict(type=name, **data))}\n\n".encode()
