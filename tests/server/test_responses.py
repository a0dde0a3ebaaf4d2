"""The Responses wire driven by the stock `openai` SDK and by the OpenAI Agents SDK's default
model: whole and streamed turns, echoed items and previous_response_id, function calls, each
episode one token-exact segment; bad requests refused in OpenAI's error shape."""

import asyncio

import agents
import numpy as np
import openai
import pytest
import torch

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.token_identity import FORCED_VERSION, TokenAccumulator
from workbench.server.loopback import LoopbackServer
from workbench.server.wires.openai_responses import OpenAIResponses

INSTRUCTIONS = "Be brief."
TOOL_PROMPT = "Use the tool."
TOOL_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "5"
AGAIN = "Again."
# rounds of (call add, answer) the model is taught, as the Agents SDK test runs them
ROUNDS = 3
MAX_TOKENS = 12
CALLS = []


@agents.function_tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    CALLS.append((a, b))
    return a + b


# the tool as the Agents SDK sends it
TOOLS = [
    {
        "type": "function",
        "name": add.name,
        "description": add.description,
        "parameters": add.params_json_schema,
        "strict": True,
    }
]


def taught_episode(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and labels of ROUNDS rounds of (a call to add, its result, the answer), as the
    server accumulates them from Responses requests: what the model is fine-tuned on."""
    chat = OpenAIResponses().decode(
        {"instructions": INSTRUCTIONS, "input": TOOL_PROMPT, "tools": TOOLS}
    )
    episode = TokenAccumulator(tokenizer, chat.messages, chat.tools)
    call = {"id": "call_0", "name": "add", "arguments": {"a": 2, "b": 3}}
    turns = [
        (TOOL_REPLY, {"role": "assistant", "content": "", "tool_calls": [call]}),
        (ANSWER, {"role": "assistant", "content": ANSWER}),
    ]
    for round_index in range(ROUNDS):
        if round_index:
            episode.add_messages([{"role": "user", "content": AGAIN}])
        for text, message in turns:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            episode.add_sampled(ids, np.zeros(len(ids)), 0, message, "stop")
            if message.get("tool_calls"):
                episode.add_messages(
                    [{"role": "tool", "content": ANSWER, "tool_call_id": "call_0"}]
                )
    ids = torch.tensor([episode.token_ids.tolist()])
    labels = ids.clone()
    labels[0, ~torch.tensor(episode.open.loss_mask, dtype=torch.bool)] = -100
    return ids, labels


@pytest.fixture(scope="module")
def server(tiny_path, tokenizer):
    """A seeded server on the tiny model, fine-tuned for a moment to call add and answer its
    result, round after round."""
    engine = TorchEngine(tiny_path)
    model = engine.model.train()
    ids, labels = taught_episode(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    # a model this small trains fastest on one thread (many times faster on a busy machine)
    torch.set_num_threads(1)
    try:
        for _ in range(150):
            optimizer.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,)
    )
    loopback = LoopbackServer(engine, tokenizer, params, seed=3)
    yield loopback
    loopback.stop()


def client_of(session) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )


def streamed(client, **request) -> tuple[openai.types.responses.Response, str]:
    """A streamed response as its last event holds it, and its text deltas joined."""
    events = list(client.responses.create(stream=True, **request))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return events[-1].response, deltas


def test_responses_turns_extend_one_segment_and_stream_exactly_the_whole_text(server):
    # two sessions of one rollout draw the same seeds: one whole, one streamed
    texts = {}
    for stream in (False, True):
        session = server.open_session(1)
        client = client_of(session)
        texts[stream] = []
        items = [{"role": "user", "content": "What is 2 + 2?"}]
        previous = None
        for turn in range(3):
            request = dict(model="policy", instructions=INSTRUCTIONS, input=items)
            # turn 3 sends only its new item and names turn 2's response
            if previous:
                request.update(input=items[-1:], previous_response_id=previous)
            if stream:
                response, deltas = streamed(client, **request)
                assert deltas == response.output_text
            else:
                response = client.responses.create(**request)
            assert response.status in ("completed", "incomplete")
            if response.status == "incomplete":
                assert response.incomplete_details.reason == "max_output_tokens"
                assert response.usage.output_tokens == MAX_TOKENS
            texts[stream].append(response.output_text)
            # the output items echoed back as the SDK dumps them
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append({"role": "user", "content": "Again."})
            if turn == 1:
                previous = response.id
        segments, requests = server.close_session(session["session"])
        assert len(segments) == 1 and len(segments[0].turn_spans) == 3
        assert [r["action"] for r in requests] == ["open", "extend", "extend"]
        assert {(r["wire"], r["stream"]) for r in requests} == {("responses", stream)}
        assert segments[0].identity_holds()
    assert texts[True] == texts[False] and all(texts[False])


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip_stays_one_segment(server, tokenizer, stream):
    session = server.open_session(2)
    client = client_of(session)
    request = dict(model="policy", instructions=INSTRUCTIONS, tools=TOOLS, temperature=0)
    items = [{"role": "user", "content": TOOL_PROMPT}]
    if stream:
        # the SDK's stream helper checks each item's events against the item they complete
        with client.responses.stream(input=items, max_output_tokens=40, **request) as events:
            kind = "response.function_call_arguments.delta"
            deltas = [event.delta for event in events if event.type == kind]
            response = events.get_final_response()
        assert deltas == [response.output[0].arguments]
    else:
        response = client.responses.create(input=items, max_output_tokens=40, **request)
    assert response.status == "completed" and response.output_text == ""
    (call,) = response.output
    assert call.type == "function_call" and call.name == "add"
    assert call.arguments == '{"a": 2, "b": 3}'
    items += [item.model_dump(exclude_none=True) for item in response.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": ANSWER})
    if stream:
        with client.responses.stream(input=items, **request) as events:
            answer = events.get_final_response()
    else:
        answer = client.responses.create(input=items, **request)
    assert answer.status == "completed" and answer.output_text == ANSWER
    (segment,), requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "extend"]
    assert "<tool_response>5</tool_response>" in tokenizer.decode(segment.token_ids)
    assert tokenizer.decode(segment.sampled_turns[0]).startswith(TOOL_REPLY)


@pytest.mark.parametrize(
    ("choice", "forced"),
    [
        ("required", '<tool_call>{"name": "'),
        ({"type": "function", "name": "add"}, '<tool_call>{"name": "add", "arguments":'),
    ],
)
def test_a_forced_tool_choice_is_forced_tokens_and_the_policy_samples_the_call(
    server, tokenizer, choice, forced
):
    session = server.open_session(7)
    response = client_of(session).responses.create(
        model="policy",
        instructions=INSTRUCTIONS,
        input=TOOL_PROMPT,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_output_tokens=40,
    )
    (call,) = response.output
    assert (call.type, call.name, call.arguments) == ("function_call", "add", '{"a": 2, "b": 3}')
    (segment,), _ = server.close_session(session["session"])
    forced_ids = tokenizer(forced, add_special_tokens=False)["input_ids"]
    start, end = segment.turn_spans[0]
    # the opening sits before the sampled ids: not trained on, marked forced
    opening = slice(start - len(forced_ids), start)
    assert segment.token_ids[opening] == forced_ids
    assert segment.loss_mask[opening] == [0] * len(forced_ids)
    assert segment.behavior_version[opening] == [FORCED_VERSION] * len(forced_ids)
    sampled = tokenizer.decode(segment.token_ids[start:end])
    assert forced + sampled.removesuffix(tokenizer.eos_token) == TOOL_REPLY


def test_the_agents_sdk_default_model_runs_tool_turns_in_one_segment(server, tokenizer):
    agents.set_tracing_disabled(True)
    session = server.open_session(3)
    client = openai.AsyncOpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    agent = agents.Agent(
        name="adder",
        instructions=INSTRUCTIONS,
        tools=[add],
        model=agents.OpenAIResponsesModel(model="policy", openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=40),
    )

    async def three_rounds():
        first = await agents.Runner.run(agent, TOOL_PROMPT)
        # round 2 echoes every item back; round 3 streams and names round 2's last response
        again = first.to_input_list() + [{"role": "user", "content": AGAIN}]
        second = await agents.Runner.run(agent, again)
        third = agents.Runner.run_streamed(
            agent, AGAIN, previous_response_id=second.last_response_id
        )
        async for _ in third.stream_events():
            pass
        return first, second, third

    CALLS.clear()
    # one event loop: the SDK's client keeps its connections on the loop that opened them
    first, second, third = asyncio.run(three_rounds())
    assert [run.final_output for run in (first, second, third)] == [ANSWER] * ROUNDS
    assert CALLS == [(2, 3)] * ROUNDS
    segments, requests = server.close_session(session["session"])
    # every request the SDK sent was served and extended the one segment
    assert [r["action"] for r in requests] == ["open"] + ["extend"] * (2 * ROUNDS - 1)
    assert [r["stream"] for r in requests] == [False] * 4 + [True] * 2
    (segment,) = segments
    assert segment.identity_holds() and len(segment.turn_spans) == 2 * ROUNDS
    sampled = [tokenizer.decode(turn) for turn in segment.sampled_turns]
    assert [text.startswith(TOOL_REPLY) for text in sampled] == [True, False] * ROUNDS


def test_previous_response_id_does_not_carry_the_old_instructions(server):
    session = server.open_session(4)
    client = client_of(session)
    first = client.responses.create(model="policy", instructions="Speak French.", input="Hi")
    client.responses.create(
        model="policy",
        instructions="Speak German.",
        input="Again.",
        previous_response_id=first.id,
    )
    segments, requests = server.close_session(session["session"])
    # OpenAI's rule: the new instructions replace the old, so the prompt was rewritten
    assert [r["action"] for r in requests] == ["open", "seal"]
    assert "Speak German." in segments[1].prompt_text
    assert "Speak French." not in segments[1].prompt_text
    assert first.output_text in segments[1].prompt_text


def test_values_that_change_nothing_are_accepted(server):
    session = server.open_session(5)
    no_ops = dict(
        store=False,
        truncation="disabled",
        include=[],
        text={"format": {"type": "text"}, "verbosity": "low"},
        reasoning={"effort": "low"},
        service_tier="auto",
        metadata={"run": "x"},
        user="u",
        prompt_cache_key="k",
        parallel_tool_calls=True,
        tool_choice="auto",
        top_p=1,
        max_output_tokens=2,
    )
    items = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]
    response = client_of(session).responses.create(model="policy", input=items, **no_ops)
    assert response.usage.output_tokens <= 2
    (segment,), _ = server.close_session(session["session"])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in segment.prompt_text


REFUSED = [
    (dict(previous_response_id="resp_unknown"), "previous_response_id"),
    (dict(text={"format": {"type": "json_object"}}), "text="),
    (dict(tool_choice="required"), "give the tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "name": "mul"}), "tools (add)"),
    (dict(tools=TOOLS, tool_choice={"type": "allowed_tools", "tools": []}), "tool_choice must"),
    (dict(tools=[{"type": "web_search"}]), "only function tools"),
    (dict(reasoning={"effort": "low", "summary": "auto"}), "reasoning="),
    (dict(top_p=0.5), "top_p"),
    (dict(include=["message.output_text.logprobs"]), "include="),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "item_reference"),
    (
        dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
        "JSON",
    ),
    (dict(input=[]), "input"),
    (dict(conversation="conv_1"), "conversation"),
]


@pytest.mark.parametrize(("change", "named"), REFUSED)
def test_bad_requests_get_a_4xx_in_openai_shape_and_record_nothing(server, change, named):
    session = server.open_session(6)
    request = dict(model="policy", input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(session).responses.create(**dict(request, **change))
    error = refused.value
    assert error.status_code == 400 and named in error.message
    assert set(error.body) == {"message", "type", "param", "code"}
    assert server.close_session(session["session"]) == ([], [])
