"""Every request field the installed `openai` and `anthropic` SDKs type, in exactly one class of
the server's classification (workbench/server/wires/fields.toml): supported, accepted as a no-op
at its no-op values, or refused with a sentence naming it and the fix. An SDK release that adds a
field fails here, not as a framework's 400 in a user's run; the real SDKs then send the fields a
stock client sends to the real server."""

import importlib
import inspect
import json
import typing
import urllib.error
import urllib.request

import openai
import pytest
from anthropic.resources.messages import Messages
from openai.resources.chat.completions import Completions
from openai.resources.responses import Responses
from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.server.loopback import LoopbackServer
from workbench.server.wires import WIRES
from workbench.server.wires.base import FIELDS

HELLO = [{"role": "user", "content": "Hi."}]
# each wire's path under a session's base URL, and a request it serves
REQUESTS = {
    "openai_chat": ("openai_base_url", "/chat/completions", {"messages": HELLO, "max_tokens": 2}),
    "openai_responses": ("openai_base_url", "/responses", {"input": "Hi.", "max_output_tokens": 2}),
    "anthropic_messages": (
        "anthropic_base_url",
        "/v1/messages",
        {"messages": HELLO, "max_tokens": 2},
    ),
}


def sdk_fields(params: type) -> set[str]:
    """The request fields a typed request parameter (a TypedDict, or a union of them: streamed
    and not) names."""
    members = typing.get_args(params) or (params,)
    return {key for member in members for key in typing.get_type_hints(member)}


def classes(section: str) -> dict[str, set[str]]:
    """A wire's fields by class."""
    fields = FIELDS[section]
    return {
        "supported": set(fields["supported"]),
        "no_op": set(fields["no_op"]),
        "refused": set(fields["refused"]),
    }


def assert_classified(section: str, params: type) -> None:
    """Fail, naming them, when the request type has fields the wire's section does not
    classify."""
    classified = set().union(*classes(section).values())
    missing = sorted(sdk_fields(params) - classified)
    assert not missing, (
        f"{params.__name__} has field(s) {', '.join(missing)} in no class of [{section}]: add each "
        f"to supported, no_op or refused (with its reason) in workbench/server/wires/fields.toml."
    )


def sdk_type(section: str) -> type:
    """The SDK's typed request parameters the section names (`module:Name`)."""
    module, _, name = FIELDS[section]["sdk"].partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("section", sorted(FIELDS))
def test_every_field_of_the_installed_sdks_is_in_exactly_one_class(section):
    assert_classified(section, sdk_type(section))
    by_class = classes(section)
    for name, fields in by_class.items():
        others = set().union(*(other for key, other in by_class.items() if key != name))
        assert not fields & others, f"[{section}] lists {fields & others} in two classes"


def test_the_sections_are_the_wires_and_the_sdk_types_are_the_ones_the_clients_send():
    assert {wire.fields for wire in WIRES} == set(FIELDS)
    # both SDKs' create() take exactly the fields their typed parameters name
    for section, create in [
        ("openai_chat", Completions.create),
        ("openai_responses", Responses.create),
        ("anthropic_messages", Messages.create),
    ]:
        keywords = set(inspect.signature(create).parameters) - {"self", "timeout"}
        keywords -= {"extra_headers", "extra_query", "extra_body"}
        assert keywords == sdk_fields(sdk_type(section))


class FutureParamsNonStreaming(CompletionCreateParamsBase, total=False):
    """A Chat Completions request of a later SDK release: one field more."""

    stream: typing.Literal[False]
    telepathy: bool


class FutureParamsStreaming(CompletionCreateParamsBase):
    stream: typing.Literal[True]


def test_a_request_type_with_an_unclassified_field_fails_the_check_naming_it():
    future = typing.Union[FutureParamsNonStreaming, FutureParamsStreaming]  # noqa: UP007
    assert sdk_fields(future) - sdk_fields(sdk_type("openai_chat")) == {"telepathy"}
    with pytest.raises(AssertionError, match=r"field\(s\) telepathy in no class of \[openai_chat"):
        assert_classified("openai_chat", future)


@pytest.fixture(scope="module")
def server(tiny_path, tokenizer):
    """The real server on the tiny model: a request it accepts samples two tokens."""
    params = SamplingParams(max_tokens=2, stop_token_ids=(tokenizer.eos_token_id,))
    loopback = LoopbackServer(TorchEngine(tiny_path), tokenizer, params, seed=0)
    yield loopback
    loopback.stop()


def post(session: dict, section: str, extra: dict) -> tuple[int, str]:
    """POST a wire's request with `extra` fields: the status and the refusal's message."""
    base_key, path, request = REQUESTS[section]
    body = json.dumps({"model": "policy", **request, **extra}).encode()
    headers = {"Authorization": f"Bearer {session['api_key']}", "x-api-key": session["api_key"]}
    sent = urllib.request.Request(session[base_key] + path, body, headers, method="POST")
    try:
        with urllib.request.urlopen(sent) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        body = json.loads(error.read())
        return error.code, body["error"]["message"]


def test_the_fields_a_stock_openai_client_sends_are_accepted_on_both_openai_wires(server):
    session = server.open_session(0)
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    hints = dict(prompt_cache_key="episode-0", safety_identifier="user-hash")
    chat = client.chat.completions.create(
        model="policy", messages=HELLO, max_tokens=2, modalities=["text"], **hints
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    response = client.responses.create(model="policy", input="Hi.", max_output_tokens=2, **hints)
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="policy", messages=HELLO, modalities=["text", "audio"])
    assert error.value.body["message"].startswith('modalities=["text", "audio"] is not')
    with pytest.raises(openai.BadRequestError, match="audio is not supported: .* text only"):
        client.chat.completions.create(
            model="policy", messages=HELLO, audio={"voice": "alloy", "format": "wav"}
        )
    segments, requests = server.close_session(session["session"])
    # the two accepted turns were recorded, the refused ones not
    assert [r["wire"] for r in requests] == ["openai", "responses"]


@pytest.mark.parametrize("section", sorted(FIELDS))
def test_every_refused_field_is_refused_in_one_sentence_naming_it_and_records_nothing(
    server, section
):
    session = server.open_session(1)
    for field, reason in FIELDS[section]["refused"].items():
        status, message = post(session, section, {field: {"any": "value"}})
        assert status == 400 and message == f"{field} is not supported: {reason}."
        assert message.count(". ") == 0 and message.endswith(".")
    status, message = post(session, section, {"telepathy": True})
    assert status == 400 and message.startswith("Unsupported field(s) telepathy:")
    assert server.close_session(session["session"]) == ([], [])


# a value of each kind of no-op rule that changes nothing, and one that would change something
NO_OPS = [
    (
        "openai_chat",
        {"top_logprobs": 0, "store": True, "service_tier": "flex"},
        {"top_logprobs": 1},
    ),
    ("openai_chat", {"prompt_cache_options": {"mode": "explicit"}}, {"store": "yes"}),
    ("openai_chat", {"frequency_penalty": None}, {"frequency_penalty": False}),
    (
        "openai_responses",
        {"text": {"format": {"type": "text"}, "verbosity": "low"}, "reasoning": {"effort": "low"}},
        {"text": {"format": {"type": "json_object"}}},
    ),
    ("openai_responses", {"max_tool_calls": 3, "background": False}, {"background": True}),
    ("openai_responses", {"include": []}, {"reasoning": {"summary": "auto"}}),
    ("anthropic_messages", {"output_config": {"effort": "low"}}, {"output_config": {"format": {}}}),
    ("anthropic_messages", {"thinking": {"type": "disabled"}, "speed": "fast"}, {"speed": 1}),
]


@pytest.mark.parametrize(("section", "no_op", "change"), NO_OPS)
def test_no_op_fields_are_accepted_only_at_the_values_that_change_nothing(
    server, section, no_op, change
):
    session = server.open_session(2)
    assert post(session, section, no_op) == (200, "")
    status, message = post(session, section, change)
    (field,) = change
    assert status == 400 and message.startswith(f"{field}={json.dumps(change[field])}")
    assert "is not supported: this server samples the policy as it is, so only" in message
    _, requests = server.close_session(session["session"])
    assert len(requests) == 1
