"""The OpenAI Responses wire: `POST /v1/responses`, whole or streamed, in OpenAI's shapes.

Its input items become chat-template messages: `instructions` a leading system message, a
`function_call` item an assistant tool call (joined to the assistant message before it), a
`function_call_output` item a `tool` message, a reasoning item's text the reasoning_content of the
assistant message after it (a summary is not the reasoning: an item with none carries nothing).
`previous_response_id` continues the conversation an earlier response of the same session ended
(the session keeps it), so a client that sends only its new items extends the episode's segment
exactly as one that echoes every item back.
"""

import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Self

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
    text_of,
    tool_call,
    tool_message,
)

ROLES = ("user", "assistant", "system", "developer")


@dataclass
class ResponsesRequest(ChatRequest):
    """A Responses request: it may continue a conversation an earlier response of the session
    ended; the loopback server hands it the session's conversations (`continued`) and keeps the
    one it ends (`history`)."""

    # the system message `instructions` put first (none or one); a later response does not
    # inherit it (OpenAI's rule), so it is kept out of the conversation a response ends
    instructions: list[dict] = field(default_factory=list)
    previous_response_id: str | None = None

    def continued(self, conversations: dict[str, list[dict]]) -> Self:
        """This request with the conversation its previous response ended before its input."""
        if self.previous_response_id is None:
            return self
        earlier = conversations.get(self.previous_response_id.removeprefix("resp_"))
        if earlier is None:
            raise WireError(
                f"Unknown previous_response_id {self.previous_response_id!r}: only a response "
                f"of this session can be continued."
            )
        given = self.history(self.messages)
        return replace(self, messages=self.instructions + earlier + given)

    def history(self, messages: list[dict]) -> list[dict]:
        """What a later response continues: the conversation `messages` without the
        instructions."""
        return messages[len(self.instructions) :]


class OpenAIResponses(Wire):
    name = "responses"
    path = "/v1/responses"
    # the OpenAI SDK's base URL serves both of its wires
    base_url_key = "openai_base_url"
    base_url_suffix = "/v1"
    fields = "openai_responses"

    def decode(self, body: dict) -> ResponsesRequest:
        refuse_unsupported(body, self.fields)
        refuse_top_p(body)
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise WireError("'previous_response_id' must be a string.")
        instructions = []
        if body.get("instructions"):
            instructions = [chat_message("system", body["instructions"], "instructions")]
        items = body.get("input")
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        if not isinstance(items, list):
            raise WireError("'input' must be a string or a list of items.")
        messages = _messages(items)
        # a turn follows something new; without it the episode would seal (an empty input names
        # no new user turn or function output to answer)
        if not messages:
            raise WireError("'input' must hold a message or a function_call_output item.")
        tools = _tools(body)
        return ResponsesRequest(
            messages=instructions + messages,
            tools=tools,
            max_tokens=number(body, "max_output_tokens", int),
            temperature=number(body, "temperature"),
            stop=[],
            stream=bool(body.get("stream")),
            # a named function: {"type": "function", "name": ...}
            forced_tool=openai_forced_tool(
                body.get("tool_choice"), tools, lambda choice: choice.get("name")
            ),
            instructions=instructions,
            previous_response_id=previous,
        )

    def reply(self, reply: ChatReply) -> dict:
        status = "completed"
        incomplete = None
        if reply.finish == "length":
            status = "incomplete"
            incomplete = {"reason": "max_output_tokens"}
        output = []
        if reply.reasoning:
            text = {"type": "reasoning_text", "text": reply.reasoning}
            output.append(
                {"type": "reasoning", "id": f"rs_{reply.id}", "summary": [], "content": [text]}
            )
        if reply.text or not reply.tool_calls:
            text = {"type": "output_text", "text": reply.text, "annotations": [], "logprobs": []}
            # a live reply's message went out first
            output.insert(
                0 if reply.live else len(output),
                {
                    "type": "message",
                    "id": f"msg_{reply.id}",
                    "role": "assistant",
                    "status": status,
                    "content": [text],
                },
            )
        for call in reply.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call['id']}",
                    "call_id": call["id"],
                    "name": call["name"],
                    "arguments": json.dumps(call["arguments"]),
                    "status": "completed",
                }
            )
        return {
            "id": f"resp_{reply.id}",
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": reply.model,
            "output": output,
            # the request's tool settings are not echoed: a reply knows only what was generated
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": reply.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": reply.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            },
        }

    def events(self, request: ChatRequest, reply: ChatReply) -> Iterator[bytes]:
        """response.created and .in_progress; per output item its added event, its reasoning or
        text deltas (one per generated piece) or its arguments, and its done events;
        response.completed (or .incomplete when max_output_tokens cut it)."""
        whole = self.reply(reply)
        numbers = itertools.count()

        def event(kind: str, **data: Any) -> bytes:
            body = {"type": kind, "sequence_number": next(numbers), **data}
            return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

        opened = dict(whole, status="in_progress", incomplete_details=None, output=[], usage=None)
        yield event("response.created", response=opened)
        yield event("response.in_progress", response=opened)
        for index, item in enumerate(whole["output"]):
            yield event("response.output_item.added", output_index=index, item=_started(item))
            at = {"output_index": index, "item_id": item["id"]}
            in_part = dict(at, content_index=0)
            if item["type"] == "message":
                part = item["content"][0]
                yield event("response.content_part.added", **in_part, part=_started(part))
                for piece in reply.pieces["content"]:
                    yield event("response.output_text.delta", **in_part, delta=piece, logprobs=[])
                yield event("response.output_text.done", **in_part, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **in_part, part=part)
            elif item["type"] == "reasoning":
                for piece in reply.pieces["reasoning"]:
                    yield event("response.reasoning_text.delta", **in_part, delta=piece)
                yield event("response.reasoning_text.done", **in_part, text=reply.reasoning)
            else:
                arguments = item["arguments"]
                yield event("response.function_call_arguments.delta", **at, delta=arguments)
                done = dict(at, name=item["name"], arguments=arguments)
                yield event("response.function_call_arguments.done", **done)
            yield event("response.output_item.done", output_index=index, item=item)
        yield event(f"response.{whole['status']}", response=whole)


def _started(part: dict) -> dict:
    """An output item or content part as it opens: in progress, nothing generated yet."""
    if part["type"] in ("message", "reasoning"):
        return dict(part, status="in_progress", content=[])
    if part["type"] == "function_call":
        return dict(part, status="in_progress", arguments="")
    return dict(part, text="")


def _messages(items: list) -> list[dict]:
    """Input items as chat-template messages."""
    messages = []
    # a reasoning item's text, for the assistant message that follows it (the same response's)
    reasoning = ""
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = field_of(item, "type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            # a call joins the assistant message it came with (the same response's output)
            if not messages or messages[-1]["role"] != "assistant" or reasoning:
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(_call(item, where))
        elif kind == "function_call_output":
            output = _parts(item.get("output"), where)
            messages.append(tool_message(output, item.get("call_id", ""), where))
        elif kind == "reasoning":
            reasoning += text_of(_parts(item.get("content"), where), where)
            continue
        else:
            raise WireError(
                f"{where}: item type {kind!r} is not supported (message, function_call, "
                f"function_call_output and reasoning are)."
            )
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
        reasoning = ""
    return messages


def _message(item: dict, where: str) -> dict:
    """A message item (a developer message is a system one)."""
    role = item.get("role")
    if role not in ROLES:
        raise WireError(f"{where}.role must be user, assistant, system or developer.")
    return chat_message(role, _parts(item.get("content"), where), where)


def _parts(content: Any, where: str) -> Any:
    """Content as the shared decoders read it: a string, or its parts as text and image parts."""
    if isinstance(content, list):
        return [_part(part, where) for part in content]
    return content


def _part(part: Any, where: str) -> dict:
    """A content part in the form the shared decoders read (text, or an inline image)."""
    kind = field_of(part, "type")
    if kind in ("input_text", "output_text", "reasoning_text"):
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": str(part.get("image_url") or "")}}
    raise WireError(
        f"{where}: content part type {kind!r} is not supported "
        f"(input_text, output_text and inline input_image are)."
    )


def _call(item: dict, where: str) -> dict:
    """A function_call item as the chat template's tool call, its JSON arguments parsed."""
    try:
        arguments = json.loads(item.get("arguments") or "{}")
    except (TypeError, ValueError, RecursionError):
        raise WireError(f"{where}: arguments must be a JSON object as a string.") from None
    return tool_call(item.get("call_id", ""), item.get("name", ""), arguments, where)


def _tools(body: dict) -> list[dict] | None:
    """The request's function tools as the chat template's (none for tool_choice none)."""
    tools = []
    for index, tool in enumerate(objects(body.get("tools"), "tools")):
        if tool.get("type") != "function":
            raise WireError(
                f"tools[{index}]: only function tools are supported, not {tool.get('type')!r}."
            )
        parameters = tool.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise WireError(f"tools[{index}].parameters must be a JSON schema object.")
        # `strict` is accepted but not enforced: a call is what the policy samples, and a
        # malformed one stays text
        function = {
            "name": str(tool.get("name")),
            "description": str(tool.get("description") or ""),
            "parameters": parameters,
        }
        tools.append({"type": "function", "function": function})
    if body.get("tool_choice") == "none":
        return None
    return tools or None
