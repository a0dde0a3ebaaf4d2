"""What every wire shares: the `Wire` base a wire module subclasses, the request it decodes into,
the reply it encodes, its error, and the decoders of the fields the wires have in common.

A wire decodes a request body into one `ChatRequest` (messages in the chat template's own form:
role, content, reasoning_content, tool_calls, tool_call_id) and encodes one `ChatReply` back, whole
or as that wire's server-sent events. A field the server does not support is refused in the wire's
own error shape.
"""

import abc
import base64
import binascii
import io
import json
import tomllib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any


class WireError(Exception):
    """A refused request: its HTTP status, the sentence the client reads, and the error's type."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


@dataclass
class ChatRequest:
    """One request, whichever wire it came by: the conversation and how to sample its reply."""

    messages: list[dict]
    tools: list[dict] | None
    max_tokens: int | None
    temperature: float | None
    stop: list[str]
    stream: bool
    # a last streamed chunk with the token counts (OpenAI's stream_options.include_usage)
    include_usage: bool = False
    # return each sampled token's behavior log-prob (OpenAI's logprobs)
    logprobs: bool = False
    # a forced tool call (tool_choice required/any: "", or a tool's name): its opening is inserted
    # as forced tokens and the policy samples the rest
    forced_tool: str | None = None
    # Anthropic's assistant prefill: the turn starts with this text, forced, and the reply
    # continues it
    prefill: str = ""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise WireError("max_tokens must be at least 1.")
        if self.temperature is not None and not 0 <= self.temperature <= 100:
            raise WireError("temperature must be a number from 0 to 100.")


@dataclass
class ChatReply:
    """One generated turn, whichever wire it goes back by."""

    # its content, as the response template parses it
    text: str
    # {"id", "name", "arguments": dict}
    tool_calls: list[dict]
    # stop | length | stop_sequence
    finish: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    stop_sequence: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    # (token text, behavior log-prob) of each sampled token the reply holds
    token_logprobs: list[tuple[str, float]] = field(default_factory=list)
    # the policy's reasoning ("thinking"), as the response template parses it
    reasoning: str = ""
    # "reasoning" and "content" in the pieces they were generated in (a stream sends one each):
    # their concatenations are `reasoning` and `text`
    pieces: dict[str, list[str]] = field(default_factory=dict)
    # its content went out as it was sampled (a stream), so it comes first, before its reasoning
    # and tool calls
    live: bool = False


class Wire(abc.ABC):
    """One API a stock SDK speaks: where it is served, how its request body decodes into a
    `ChatRequest`, and how a `ChatReply` (whole or streamed) and a `WireError` encode back in its
    own shapes. A new wire is one module with a subclass, listed in `workbench.server.wires.WIRES`.
    """

    # the wire's name in the `requests` rows
    name: str
    # served at /s/<session><path>; its last part also picks the error shape of unrouted requests
    path: str
    # the session info's key for this wire's SDK base URL, and what follows /s/<session> in it
    base_url_key: str
    base_url_suffix: str
    # its section of fields.toml: each request field supported, a no-op or refused
    fields: str

    @abc.abstractmethod
    def decode(self, body: dict) -> ChatRequest:
        """The request a JSON body asks for; a `WireError` for what this server does not support."""

    @abc.abstractmethod
    def reply(self, reply: ChatReply) -> dict:
        """The whole reply's JSON body."""

    @abc.abstractmethod
    def events(self, request: ChatRequest, reply: ChatReply) -> Iterator[bytes]:
        """The reply as server-sent events (its reasoning and text in `reply.pieces`)."""

    def error(self, error: WireError) -> dict:
        """A refusal's JSON body (OpenAI's shape unless the wire has its own)."""
        return {
            "error": {"message": error.message, "type": error.kind, "param": None, "code": None}
        }


def forced_tool(name: Any, tools: list[dict] | None, where: str) -> str:
    """A tool_choice's named tool, which must be one of the request's tools."""
    functions = [tool.get("function") for tool in tools or []]
    names = [function.get("name") for function in functions if isinstance(function, dict)]
    if not isinstance(name, str) or name not in names:
        raise WireError(f"{where}: name one of the request's tools ({', '.join(map(str, names))}).")
    return name


def openai_forced_tool(
    choice: Any, tools: list[dict] | None, name_of: Callable[[dict], Any]
) -> str | None:
    """OpenAI's tool_choice as a forced call: None (absent, auto, none), "" (required) or the
    function a {"type": "function", ...} choice names (`name_of(choice)`: each OpenAI wire names it
    in its own place)."""
    if choice in (None, "auto", "none"):
        return None
    if not tools:
        raise WireError("tool_choice forces a tool call: give the tools it may call.")
    if choice == "required":
        return ""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return forced_tool(name_of(choice), tools, "tool_choice")
    raise WireError('tool_choice must be auto, none, required or {"type": "function", ...}.')


def chat_message(role: str, content: Any, where: str) -> dict:
    """A message of text in the chat template's form: a user's may hold images too, and a
    developer message is a system one."""
    read = text_of
    if role == "user":
        read = user_content
    if role == "developer":
        role = "system"
    return {"role": role, "content": read(content, where)}


def field_of(value: Any, key: str, default: Any = None) -> Any:
    """A JSON object's field (`default` where it has none); None when `value` is no object."""
    if not isinstance(value, dict):
        return None
    return value.get(key, default)


def text_of(content: Any, where: str) -> str:
    """A message's text content: a string, or a list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(p.get("text", "") for p in content)
    raise WireError(f"{where}: only text content is supported here.")


def _image(data: str, where: str) -> dict:
    """An inline image (`data:image/png;base64,...` or bare base64) as a content part; nothing is
    ever fetched."""
    from PIL import Image

    header = "base64"
    payload = data
    if data.startswith("data:"):
        header, _, payload = data.partition(",")
    try:
        if "base64" not in header:
            raise ValueError
        raw = base64.b64decode(payload, validate=True)
        Image.open(io.BytesIO(raw)).verify()
    except (ValueError, binascii.Error, OSError):
        raise WireError(
            f"{where}: an image must be inline base64 data of a PNG or JPEG "
            f"(data:image/png;base64,...); URLs are not fetched."
        ) from None
    return {"type": "image", "image": raw}


def user_content(content: Any, where: str) -> str | list[dict]:
    """A user message's content: its text, or a list of text and image parts when it holds
    images (OpenAI's image_url parts and Anthropic's image blocks alike)."""
    if not isinstance(content, list):
        return text_of(content, where)
    parts = []
    for part in content:
        kind = field_of(part, "type")
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "image_url":
            parts.append(_image(str((part.get("image_url") or {}).get("url", "")), where))
        elif kind == "image" and isinstance(part.get("source"), dict):
            parts.append(_image(str(part["source"].get("data", "")), where))
        else:
            raise WireError(
                f"{where}: content part type {kind!r} is not supported "
                f"(text and inline images are)."
            )
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def number(body: dict, key: str, kind: type[int] | type[float] = float) -> int | float | None:
    """The number at `key` (None when absent) as `kind`; a bool or a string is refused."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireError(f"'{key}' must be a number.")
    return kind(value)


def strings(value: Any, key: str) -> list[str]:
    """A string or a list of strings as a list (none when absent)."""
    values = value or []
    if isinstance(value, str):
        values = [value]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise WireError(f"'{key}' must be a string or a list of strings.")
    return values


def objects(value: Any, key: str) -> list[dict]:
    """A list of JSON objects (none when absent)."""
    if value is not None and not (
        isinstance(value, list) and all(isinstance(v, dict) for v in value)
    ):
        raise WireError(f"'{key}' must be a list of objects.")
    return value or []


def tool_arguments(value: Any, where: str) -> dict:
    """A tool call's arguments, which must be a JSON object."""
    if not isinstance(value, dict):
        raise WireError(f"{where}: tool call arguments must be a JSON object.")
    return value


def tool_message(content: Any, call_id: Any, where: str) -> dict:
    """A tool's result, answering the call `call_id`, in the chat template's form."""
    return {"role": "tool", "content": text_of(content, where), "tool_call_id": str(call_id)}


def tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    """A tool call in the chat template's form."""
    return {"id": str(call_id), "name": str(name), "arguments": tool_arguments(arguments, where)}


# each wire's request fields, classified: supported, accepted as a no-op (at the values a rule
# of fields.toml gives), or refused with a reason
FIELDS = tomllib.loads(resources.files(__package__).joinpath("fields.toml").read_text())
# a no-op rule naming a type: any value of it
TYPES = {"a string": str, "true or false": bool, "an integer": int, "an object": dict}


def changes_nothing(value: Any, rule: str | list | dict) -> bool:
    """Whether a no-op field's value is one its rule accepts (null always is)."""
    if value is None:
        return True
    if isinstance(rule, str):
        # a bool is an int to Python, not to JSON
        return isinstance(value, TYPES[rule]) and isinstance(value, bool) == (
            rule == "true or false"
        )
    if isinstance(rule, dict):
        return isinstance(value, dict) and all(
            key in rule and changes_nothing(item, rule[key]) for key, item in value.items()
        )
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in rule)


def accepted(rule: str | list | dict) -> str:
    """The values a no-op rule accepts, as a refusal names them."""
    if isinstance(rule, str):
        return rule
    if isinstance(rule, dict):
        return "{" + ", ".join(f'"{key}": {accepted(item)}' for key, item in rule.items()) + "}"
    return " or ".join(json.dumps(value) for value in rule)


def refuse_unsupported(body: dict, fields: str) -> None:
    """Refuse a body holding a field the wire's `fields` section of fields.toml does not list, a
    field it refuses, or a no-op field at a value that changes something here."""
    classes = FIELDS[fields]
    no_ops = classes["no_op"]
    allowed = {*classes["supported"], *no_ops}
    unknown = sorted(set(body) - allowed - set(classes["refused"]))
    if unknown:
        raise WireError(
            f"Unsupported field(s) {', '.join(unknown)}: this server samples exact token ids and "
            f"supports only {', '.join(sorted(allowed))}."
        )
    for key, reason in classes["refused"].items():
        if body.get(key) is not None:
            raise WireError(f"{key} is not supported: {reason}.")
    for key, rule in no_ops.items():
        if not changes_nothing(body.get(key), rule):
            shown = json.dumps(body[key])[:60]
            raise WireError(
                f"{key}={shown} is not supported: this server samples the policy as it is, so "
                f"only {accepted(rule)} (which changes nothing) is accepted."
            )


def refuse_top_p(body: dict) -> None:
    """Refuse nucleus sampling: the learner recomputes each token's log-prob over the whole
    vocabulary."""
    if body.get("top_p", 1) != 1:
        raise WireError(
            "Only top_p=1 is supported: the learner must be able to recompute every log-prob."
        )
