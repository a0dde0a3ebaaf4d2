"""Replies parsed by the tokenizer's response template, through the real server and the stock
`openai` and `anthropic` SDKs: content, reasoning and tool calls of three families' formats
(tests/fixtures/templates.py), reasoning out on every wire and a faithful echo of it in one
segment, a malformed call left as text and counted, and a forced call opened in the policy's own
format.

The engine is scripted: it "samples" a chosen reply (the part the prompt does not already hold),
so what the server parses is known."""

import copy
import json

import anthropic
import numpy as np
import openai
import pytest
from fixtures.templates import FAMILIES

from workbench.engines.base import Generation, SamplingParams
from workbench.invariants.token_identity import FORCED_VERSION
from workbench.models.tiny import RESPONSE_TEMPLATE
from workbench.server.loopback import LoopbackServer
from workbench.server.replies import parse_reply

PROMPT = "Add 2 and 3."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {"name": "add", "description": "Add.", "input_schema": TOOLS[0]["function"]["parameters"]}
]
# per family: a reply calling add(a=2, b=3) as its policy writes it, and its (content, reasoning)
CALLS = {
    "qwen3": (
        "<think>\nThey want a sum.\n</think>\n\nLet me add.\n<tool_call>\n"
        '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "\n\nLet me add.\n",
        "They want a sum.",
    ),
    "llama3": ('{"name": "add", "parameters": {"a": 2, "b": "3"}}', "", ""),
    "qwen3_coder": (
        "Adding.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
        "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>",
        "Adding.\n",
        "",
    ),
}
ANSWER = "It is 5."


class Scripted:
    """An engine whose policy 'samples' the replies it is given, in order: the part of each that
    the prompt does not already hold (a forced opening), then the stop token."""

    version = 0

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer = tokenizer
        self.replies = list(replies)

    def generate(self, prompts, params, images=None, listener=None) -> list[Generation]:
        generations = []
        for prompt in prompts:
            reply = self.replies.pop(0)
            prompt_text = self.tokenizer.decode(prompt)
            held = max(k for k in range(len(reply) + 1) if prompt_text.endswith(reply[:k]))
            text_ids = self.tokenizer(reply[held:], add_special_tokens=False)["input_ids"]
            ids = np.array(text_ids + [self.tokenizer.eos_token_id], np.int32)
            zeros = np.zeros(len(ids), np.float32)
            generations.append(Generation(ids, zeros, zeros.astype(np.int32), "stop"))
        return generations


def serve(tokenizer, replies: list[str], history_rewrite: str = "seal") -> LoopbackServer:
    params = SamplingParams(max_tokens=64, stop_token_ids=(tokenizer.eos_token_id,))
    engine = Scripted(tokenizer, replies)
    return LoopbackServer(engine, tokenizer, params, history_rewrite=history_rewrite)


def clients(session) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    key = session["api_key"]
    return (
        openai.OpenAI(base_url=session["openai_base_url"], api_key=key, max_retries=0),
        anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=key, max_retries=0),
    )


def openai_turn(client, messages: list[dict], stream: bool, **request) -> dict:
    """One Chat Completions turn, whole or streamed, as the assistant message a client keeps."""
    request = dict(model="policy", messages=messages, **request)
    if not stream:
        return client.chat.completions.create(**request).choices[0].message.model_dump()
    deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **request)]
    calls = [
        {"id": call.id, "type": "function", "function": call.function.model_dump()}
        for delta in deltas
        for call in delta.tool_calls or []
    ]
    return {
        "role": "assistant",
        "content": "".join(delta.content or "" for delta in deltas),
        "reasoning_content": "".join(getattr(d, "reasoning_content", "") or "" for d in deltas),
        "tool_calls": calls,
    }


def anthropic_turn(client, messages: list[dict], stream: bool, **request):
    """One Messages turn, whole or streamed (the SDK accumulating the events)."""
    request = dict(model="policy", max_tokens=64, messages=messages, **request)
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        return events.get_final_message()


@pytest.fixture(scope="module")
def families(tokenizer):
    return {name: family.tokenizer(tokenizer) for name, family in FAMILIES.items()}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_call_parses_on_the_openai_wire_and_its_round_trip_is_one_segment(
    families, family, stream
):
    reply, content, reasoning = CALLS[family]
    server = serve(families[family], [reply, ANSWER])
    try:
        session = server.open_session(1)
        client, _ = clients(session)
        messages = [{"role": "user", "content": PROMPT}]
        message = openai_turn(client, messages, stream, tools=TOOLS)
        assert message["content"] == content
        assert (message.get("reasoning_content") or "") == reasoning
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "add"
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        assert openai_turn(client, messages, stream, tools=TOOLS)["content"] == ANSWER
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["action"] for r in requests] == ["open", "extend"]
    assert [r["malformed_tool_calls"] for r in requests] == [0, 0]
    assert segment.identity_holds()
    assert families[family].decode(segment.sampled_turns[0]).startswith(reply)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_call_parses_on_the_anthropic_wire_and_its_round_trip_is_one_segment(
    families, family, stream
):
    reply, content, reasoning = CALLS[family]
    server = serve(families[family], [reply, ANSWER])
    try:
        session = server.open_session(1)
        _, client = clients(session)
        messages = [{"role": "user", "content": PROMPT}]
        message = anthropic_turn(client, messages, stream, tools=ANTHROPIC_TOOLS)
        blocks = {block.type: block for block in message.content}
        expected = ["text", "tool_use"]
        if reasoning:
            expected = ["thinking", "text", "tool_use"]
            assert blocks["thinking"].thinking == reasoning
        if not content:
            expected.remove("text")
        assert [block.type for block in message.content] == expected
        assert message.stop_reason == "tool_use"
        assert blocks["tool_use"].name == "add" and blocks["tool_use"].input == {"a": 2, "b": 3}
        assert content == getattr(blocks.get("text"), "text", "")
        result = {"type": "tool_result", "tool_use_id": blocks["tool_use"].id, "content": "5"}
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {"role": "user", "content": [result]},
        ]
        answer = anthropic_turn(client, messages, stream, tools=ANTHROPIC_TOOLS)
        assert [(b.type, b.text) for b in answer.content] == [("text", ANSWER)]
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["action"] for r in requests] == ["open", "extend"] and segment.identity_holds()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_call_parses_on_the_responses_wire_and_its_echoed_items_extend(
    families, family
):
    reply, content, reasoning = CALLS[family]
    server = serve(families[family], [reply, ANSWER])
    tools = [dict(TOOLS[0]["function"], type="function")]
    try:
        session = server.open_session(1)
        client, _ = clients(session)
        items = [{"role": "user", "content": PROMPT}]
        response = client.responses.create(model="policy", input=items, tools=tools)
        kinds = {item.type: item for item in response.output}
        assert response.output_text == content
        assert list(kinds) == ["reasoning"] * bool(reasoning) + ["message"] * bool(content) + [
            "function_call"
        ]
        if reasoning:
            assert kinds["reasoning"].content[0].text == reasoning
        call = kinds["function_call"]
        assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
        items += [item.model_dump(exclude_none=True) for item in response.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
        answer = client.responses.create(model="policy", input=items, tools=tools)
        assert answer.output_text == ANSWER
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["action"] for r in requests] == ["open", "extend"] and segment.identity_holds()


MALFORMED = {
    "qwen3": '<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"a": 2}',
}


@pytest.mark.parametrize("family", list(MALFORMED))
def test_a_malformed_call_stays_text_is_counted_and_its_echo_extends(families, family):
    # bridge: the next user message takes Qwen3's think block away (a rewrite, tested elsewhere)
    server = serve(families[family], [MALFORMED[family], ANSWER], history_rewrite="bridge")
    try:
        session = server.open_session(1)
        client, _ = clients(session)
        messages = [{"role": "user", "content": PROMPT}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        # the agent sees exactly what was generated, as text
        assert message.content == MALFORMED[family] and not message.tool_calls
        assert reply.choices[0].finish_reason == "stop"
        messages += [{"role": "assistant", "content": message.content}]
        messages += [{"role": "user", "content": "That call was malformed."}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["malformed_tool_calls"] for r in requests] == [1, 0]
    assert [r["action"] for r in requests] == ["open", "extend"] and segment.identity_holds()


@pytest.mark.parametrize(
    ("wire", "choice", "opener"),
    [
        ("openai", "required", "<tool_call>\n<function="),
        (
            "openai",
            {"type": "function", "function": {"name": "add"}},
            "<tool_call>\n<function=add>",
        ),
        ("anthropic", {"type": "any"}, "<tool_call>\n<function="),
        ("anthropic", {"type": "tool", "name": "add"}, "<tool_call>\n<function=add>"),
    ],
)
def test_a_forced_call_under_the_xml_format_opens_with_that_formats_opener(
    families, wire, choice, opener
):
    tokenizer = families["qwen3_coder"]
    call = CALLS["qwen3_coder"][0].removeprefix("Adding.\n")
    server = serve(tokenizer, [call])
    try:
        session = server.open_session(1)
        openai_client, anthropic_client = clients(session)
        messages = [{"role": "user", "content": PROMPT}]
        if wire == "openai":
            reply = openai_client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, tool_choice=choice
            )
            [used] = reply.choices[0].message.tool_calls
            assert (used.function.name, used.function.arguments) == ("add", '{"a": 2, "b": 3}')
        else:
            reply = anthropic_client.messages.create(
                model="policy",
                messages=messages,
                tools=ANTHROPIC_TOOLS,
                tool_choice=choice,
                max_tokens=64,
            )
            assert [(b.name, b.input) for b in reply.content] == [("add", {"a": 2, "b": 3})]
        (segment,), _ = server.close_session(session["session"])
    finally:
        server.stop()
    start = segment.turn_spans[0][0]
    prompt = zip(segment.token_ids[:start], segment.behavior_version[:start], strict=True)
    forced = [token for token, version in prompt if version == FORCED_VERSION]
    # the forced ids sit right before the sampled ones: the opening of the format's call
    assert forced == segment.token_ids[start - len(forced) : start]
    assert tokenizer.decode(forced).startswith(opener) and call.startswith(tokenizer.decode(forced))


def test_the_tiny_tokenizer_carries_its_response_template_and_one_without_gets_hermes(tokenizer):
    # loaded from the tiny model's folder: save_pretrained kept it
    assert tokenizer.response_template == RESPONSE_TEMPLATE
    bare = copy.deepcopy(tokenizer)
    bare.response_template = None
    reply = CALLS["qwen3"][0]
    for each in (tokenizer, bare):
        message, malformed = parse_reply(each, reply, [], TOOLS)
        assert malformed == 0 and message["reasoning_content"] == "They want a sum."
        assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [
            ("add", {"a": 2, "b": 3})
        ]


THINKING = "<think>\nFirst the units.\n</think>\n\nFour."


def echo(wire: str, client, messages: list, stream: bool) -> list:
    """One turn on `wire` (whole or streamed) and the conversation a client keeps after it: its
    reply echoed with the reasoning as the wire carries it, and a new user message."""
    if wire == "openai":
        message = openai_turn(client, messages, stream)
        assert (message["reasoning_content"], message["content"]) == (
            "First the units.",
            "\n\nFour.",
        )
        kept = {key: message[key] for key in ("role", "content", "reasoning_content")}
        return messages + [kept, {"role": "user", "content": "And?"}]
    if wire == "anthropic":
        message = anthropic_turn(client, messages, stream)
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "First the units."
        assert message.content[0].signature == "" and message.content[1].text == "\n\nFour."
        blocks = [b.model_dump() for b in message.content]
        return messages + [
            {"role": "assistant", "content": blocks},
            {"role": "user", "content": "And?"},
        ]
    response, reasoning = responses_turn(client, messages, stream)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning == "First the units."
    assert response.output_text == "\n\nFour."
    items = [item.model_dump(exclude_none=True) for item in response.output]
    return messages + items + [{"role": "user", "content": "And?"}]


def responses_turn(client, items: list, stream: bool):
    """One Responses turn, and its reasoning (streamed: its deltas joined)."""
    if not stream:
        response = client.responses.create(model="policy", input=items)
        return response, response.output[0].content[0].text
    events = list(client.responses.create(model="policy", input=items, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    return events[-1].response, reasoning


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("wire", ["openai", "anthropic", "responses"])
def test_reasoning_goes_out_on_every_wire_and_its_faithful_echo_stays_one_segment(
    tokenizer, wire, stream
):
    # the tiny tokenizer's own templates: ChatML, whose render shows no reasoning
    server = serve(tokenizer, [THINKING, ANSWER])
    try:
        session = server.open_session(1)
        openai_client, anthropic_client = clients(session)
        client = openai_client
        if wire == "anthropic":
            client = anthropic_client
        messages = echo(wire, client, [{"role": "user", "content": PROMPT}], stream)
        if wire == "responses":
            client.responses.create(model="policy", input=messages)
        elif wire == "openai":
            client.chat.completions.create(model="policy", messages=messages)
        else:
            client.messages.create(model="policy", messages=messages, max_tokens=64)
        (segment,), requests = server.close_session(session["session"])
    finally:
        server.stop()
    assert [r["action"] for r in requests] == ["open", "extend"] and segment.identity_holds()
