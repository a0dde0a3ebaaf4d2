"""The loopback server driven by the real OpenAI and Anthropic SDKs: token-exact sessions,
extend vs seal, tool calls on both wires, streaming, retries, and bad requests refused."""

import copy
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import numpy as np
import openai
import pytest
import torch

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.token_identity import FORCED_VERSION
from workbench.server.loopback import MAX_BODY, LoopbackServer
from workbench.server.wires import WIRES
from workbench.server.wires.openai_chat import OpenAIChat

TOOL_PROMPT = "Use the tool."
TOOL_REPLY = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}},
    }
]
# renders the same as OPENAI_TOOLS
ANTHROPIC_TOOLS = [{"name": "add", "description": "Add.", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def server(tiny_path, tokenizer):
    """A real engine on the tiny model, fine-tuned for a moment to answer TOOL_PROMPT with a tool
    call."""
    engine = TorchEngine(tiny_path)
    model = engine.model.train()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": TOOL_PROMPT}],
        tools=OPENAI_TOOLS,
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    target = tokenizer(TOOL_REPLY, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = torch.tensor([list(prompt) + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    # one thread: the tiny model's matrices are too small to split (53 s -> 9 s on 2 cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(150):
            optimizer.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    loopback = LoopbackServer(
        engine,
        tokenizer,
        SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,)),
        # each turn draws from its session's own seed, whatever else shares its batch
        seed=0,
    )
    yield loopback
    loopback.stop()


def clients(session):
    return (
        openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        ),
        anthropic.Anthropic(
            base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
        ),
    )


def test_server_binds_loopback_only(server):
    assert server.url.startswith("http://127.0.0.1:")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_turns_extend_and_turn_one_ids_reappear_verbatim(server, stream):
    session = server.open_session(1)
    client, _ = clients(session)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for _ in range(3):
        if stream:
            chunks = list(
                client.chat.completions.create(model="policy", messages=messages, stream=True)
            )
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = (
                client.chat.completions.create(model="policy", messages=messages)
                .choices[0]
                .message.content
            )
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]
    (segment,), requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "extend", "extend"] and {
        r["stream"] for r in requests
    } == {stream}
    ids = np.array(segment.token_ids)
    mask = np.array(segment.loss_mask, bool)
    turns = zip(segment.turn_spans, segment.sampled_turns, strict=True)
    for turn, ((start, end), sampled) in enumerate(turns):
        # the ids the engine returned, verbatim
        np.testing.assert_array_equal(ids[start:end], sampled)
        # and turn 2's input started with everything up to turn 1's end
        if turn:
            assert requests[turn]["prompt_tokens_reused"] == segment.turn_spans[turn - 1][1]
    assert segment.identity_holds() and mask.sum() == sum(len(s) for s in segment.sampled_turns)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_turns_extend_the_same_way(server, stream):
    session = server.open_session(2)
    _, client = clients(session)
    messages = [{"role": "user", "content": "Hi"}]
    for _ in range(2):
        if stream:
            with client.messages.stream(model="policy", max_tokens=8, messages=messages) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(model="policy", max_tokens=8, messages=messages)
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens <= 8
        text = "".join(b.text for b in reply.content if b.type == "text")
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "More"}]
    segments, requests = server.close_session(session["session"])
    assert len(segments) == 1 and [r["action"] for r in requests] == ["open", "extend"]
    assert all(r["wire"] == "anthropic" for r in requests)


def test_streamed_text_equals_the_whole_reply(server):
    session = server.open_session(3)
    client, _ = clients(session)
    messages = [{"role": "user", "content": "What is 1 + 1?"}]
    chunks = list(
        client.chat.completions.create(
            model="policy", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1
    # an identical request is a retry: the committed reply comes back, nothing is generated again
    again = list(
        client.chat.completions.create(
            model="policy", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in again if c.choices) == streamed
    (segment,), requests = server.close_session(session["session"])
    assert len(requests) == 1 and len(segment.turn_spans) == 1
    assert server.tokenizer.decode(segment.sampled_turns[0][: len(streamed) and None]).startswith(
        streamed
    )


def test_a_compacted_conversation_seals_the_segment(server):
    session = server.open_session(4)
    client, _ = clients(session)
    first = [{"role": "user", "content": "Long story."}]
    text = client.chat.completions.create(model="policy", messages=first).choices[0].message.content
    compacted = [
        {"role": "user", "content": "Summary of the story."},
        {"role": "user", "content": "Go on."},
    ]
    client.chat.completions.create(model="policy", messages=compacted)
    segments, requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "seal"]
    assert [s.seal_reason for s in segments] == ["compaction", "end"]
    assert segments[0].sampled_turns and all(s.identity_holds() for s in segments)
    assert "Summary" in segments[1].prompt_text and text is not None


def test_a_template_that_rewrites_history_seals(server, tokenizer):
    hiding = copy.deepcopy(tokenizer)
    hiding.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
        "{{- '<|im_start|>assistant\\n(hidden)<|im_end|>\\n' }}{%- else %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    rewriting = LoopbackServer(server.engine, hiding, server.params)
    try:
        session = rewriting.open_session(5)
        client, _ = clients(session)
        messages = [{"role": "user", "content": "Think."}]
        text = (
            client.chat.completions.create(model="policy", messages=messages)
            .choices[0]
            .message.content
        )
        client.chat.completions.create(
            model="policy",
            messages=messages
            + [{"role": "assistant", "content": text}, {"role": "user", "content": "Next."}],
        )
        segments, requests = rewriting.close_session(session["session"])
    finally:
        rewriting.stop()
    assert requests[1]["action"] == "seal" and [s.seal_reason for s in segments] == [
        "template_rewrite",
        "end",
    ]


def test_openai_tool_call_round_trip(server):
    session = server.open_session(6)
    client, _ = clients(session)
    tools = OPENAI_TOOLS
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    reply = client.chat.completions.create(
        model="policy", messages=messages, tools=tools, temperature=0, max_tokens=40
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    client.chat.completions.create(model="policy", messages=messages, tools=tools, temperature=0)
    (segment,), requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "extend"]
    assert "<tool_response>5</tool_response>" in server.tokenizer.decode(segment.token_ids)
    # the call is the sampled ids
    assert TOOL_REPLY in server.tokenizer.decode(segment.sampled_turns[0])


def test_anthropic_tool_use_round_trip_streaming(server):
    session = server.open_session(7)
    _, client = clients(session)
    tools = ANTHROPIC_TOOLS
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    with client.messages.stream(
        model="policy", max_tokens=40, messages=messages, tools=tools, extra_body={"temperature": 0}
    ) as events:
        reply = events.get_final_message()
    assert reply.stop_reason == "tool_use"
    use = next(b for b in reply.content if b.type == "tool_use")
    assert use.name == "add" and use.input == {"a": 2, "b": 3}
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
        },
    ]
    client.messages.create(model="policy", max_tokens=8, messages=messages, tools=tools)
    _, requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "extend"]


def test_wrong_key_and_unknown_session_touch_nothing(server):
    session = server.open_session(8)
    bad = dict(session, api_key="sk-wrong")
    client, aclient = clients(bad)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError):
        aclient.messages.create(
            model="policy", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    ghost = dict(
        session, openai_base_url=session["openai_base_url"].replace(session["session"], "nope")
    )
    with pytest.raises(openai.NotFoundError):
        clients(ghost)[0].chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}]
        )
    assert server.close_session(session["session"]) == ([], [])


def post(url: str, data: bytes, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_malformed_oversize_and_unsupported_requests_get_wire_shaped_errors(server):
    session = server.open_session(9)
    chat_url = session["openai_base_url"] + "/chat/completions"
    messages_url = session["anthropic_base_url"] + "/v1/messages"
    status, body = post(chat_url, b"{not json", session["api_key"])
    assert status == 400 and "Malformed JSON" in body["error"]["message"]
    status, body = post(messages_url, b"[1, 2]", session["api_key"])
    assert (
        status == 400 and body["type"] == "error" and "Malformed JSON" in body["error"]["message"]
    )
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}).encode()
    status, body = post(chat_url, huge, session["api_key"])
    assert status == 413 and "Request body over" in body["error"]["message"]
    client, aclient = clients(session)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], logit_bias={"1": 2}
        )
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], n=2
        )
    with pytest.raises(anthropic.BadRequestError, match="top_p"):
        aclient.messages.create(
            model="policy",
            max_tokens=4,
            messages=[{"role": "user", "content": "x"}],
            extra_body={"top_p": 0.5},
        )
    assert server.close_session(session["session"]) == ([], [])


class EchoChat(OpenAIChat):
    """A third wire, as issue #14 adds one: OpenAI's request and reply under its own name and path,
    with its own error shape."""

    name = "echo"
    path = "/v1/echo"

    def error(self, error):
        return {"echo_error": error.message}


def test_a_new_wire_is_one_object_the_server_serves_without_knowing_it(server):
    extra = LoopbackServer(
        server.engine, server.tokenizer, server.params, wires=(*WIRES, EchoChat())
    )
    try:
        session = extra.open_session(13)
        url = session["openai_base_url"] + "/echo"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        status, reply = post(url, json.dumps(body).encode(), session["api_key"])
        assert status == 200 and reply["object"] == "chat.completion"
        status, refused = post(url, json.dumps({"n": 2, **body}).encode(), session["api_key"])
        assert status == 400 and "n=1" in refused["echo_error"]
        # a GET: no such method, answered in the echo wire's error shape
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(url)
        assert error.value.code == 405 and "GET" in json.loads(error.value.read())["echo_error"]
        # the other wires are served as before
        status, refused = post(session["openai_base_url"] + "/chat/completions", b"[]", "sk-x")
        assert status == 401 and refused["error"]["type"] == "authentication_error"
        _, requests = extra.close_session(session["session"])
    finally:
        extra.stop()
    assert [(r["wire"], r["action"]) for r in requests] == [("echo", "open")]
    assert requests[0]["generated_tokens"] == reply["usage"]["completion_tokens"]


def test_models_endpoint_lists_the_policy(server):
    with urllib.request.urlopen(server.url + "/v1/models") as response:
        assert json.loads(response.read())["data"][0]["id"] == "policy"


def test_concurrent_sessions_share_engine_calls_and_stay_separate(server):
    sessions = [server.open_session(100 + i) for i in range(6)]

    def ask(session):
        client, _ = clients(session)
        return client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": session["session"]}]
        )

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(ask, sessions))
    for session in sessions:
        (segment,), (request,) = server.close_session(session["session"])
        assert session["session"] in segment.prompt_text and request["rollout_id"] >= 100


class FailingOnce(TorchEngine):
    """A real engine whose next generate call fails, as an out-of-memory or a killed kernel
    would."""

    fail_next = False

    def generate(self, prompts, params, images=None, listener=None):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine crashed")
        return super().generate(prompts, params, images, listener)


def test_a_failed_generation_commits_nothing(tiny_path, tokenizer):
    engine = FailingOnce(tiny_path)
    loopback = LoopbackServer(
        engine, tokenizer, SamplingParams(max_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    )
    try:
        session = loopback.open_session(0)
        client, _ = clients(session)
        messages = [{"role": "user", "content": "Hi"}]
        text = (
            client.chat.completions.create(model="policy", messages=messages)
            .choices[0]
            .message.content
        )
        longer = messages + [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "And?"},
        ]
        engine.fail_next = True
        with pytest.raises(openai.InternalServerError, match="nothing was recorded"):
            client.chat.completions.create(model="policy", messages=longer)
        # the retry extends the committed turn
        client.chat.completions.create(model="policy", messages=longer)
        (segment,), requests = loopback.close_session(session["session"])
    finally:
        loopback.stop()
    assert [r["action"] for r in requests] == ["open", "extend"] and len(segment.turn_spans) == 2


def test_bad_sampling_values_are_refused(server):
    session = server.open_session(10)
    client, _ = clients(session)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert server.close_session(session["session"]) == ([], [])


def test_stop_sequences_cut_the_reply_on_both_wires(server):
    session = server.open_session(11)
    client, aclient = clients(session)
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    reply = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=OPENAI_TOOLS,
        temperature=0,
        max_tokens=40,
        stop=["arguments"],
    )
    assert (
        reply.choices[0].message.content == '<tool_call>{"name": "add", "'
        and reply.choices[0].finish_reason == "stop"
    )
    other = server.open_session(12)
    _, aclient = clients(other)
    message = aclient.messages.create(
        model="policy",
        max_tokens=40,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        stop_sequences=["arguments"],
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "arguments"
    for name in (session["session"], other["session"]):
        (segment,), _ = server.close_session(name)
        sampled = server.tokenizer.decode(segment.sampled_turns[0])
        # the ids up to the stop, kept
        assert sampled.endswith("arguments") or "arguments" in sampled[-12:]


def test_a_seeded_server_samples_each_turn_from_its_rollout_and_turn_not_its_batch(
    tiny_path, tokenizer
):
    # what makes a resumed chat-agent run sample as the uninterrupted one did
    params = SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    conversation = [{"role": "user", "content": "Count with me."}]

    def reply(server, session):
        client = openai.OpenAI(
            base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
        )
        answer = client.chat.completions.create(model="policy", messages=conversation)
        return answer.choices[0].message.content

    engine = TorchEngine(tiny_path)
    first = LoopbackServer(engine, tokenizer, params, seed=7)
    second = LoopbackServer(engine, tokenizer, params, seed=7)
    try:
        alone = reply(first, first.open_session(42))
        # the same rollout's first turn, sent among eight other sessions' requests
        sessions = [second.open_session(rollout) for rollout in (40, 41, 42, 43, 44, 45, 46, 47)]
        with ThreadPoolExecutor(8) as pool:
            crowd = list(pool.map(lambda session: reply(second, session), sessions))
        assert crowd[2] == alone
        # other rollouts and the judge's stream of rollout 42 draw other seeds
        assert len(set(crowd)) > 1
        assert reply(first, first.open_session(42, stream=1)) != alone
    finally:
        first.stop()
        second.stop()


def test_values_that_change_nothing_are_accepted_and_those_that_would_are_refused(server):
    session = server.open_session(70)
    openai_client, anthropic_client = clients(session)
    hello = [{"role": "user", "content": "Hi."}]
    no_ops = dict(
        frequency_penalty=0,
        presence_penalty=0,
        logprobs=False,
        top_logprobs=0,
        response_format={"type": "text"},
        store=False,
        reasoning_effort="low",
        service_tier="auto",
        verbosity="medium",
    )
    openai_client.chat.completions.create(model="policy", messages=hello, max_tokens=2, **no_ops)
    anthropic_client.messages.create(
        model="policy", messages=hello, max_tokens=2, thinking={"type": "disabled"}
    )
    refused = [
        dict(frequency_penalty=0.5),
        dict(top_logprobs=2),
        dict(response_format={"type": "json_object"}),
    ]
    for change in refused:
        with pytest.raises(openai.BadRequestError, match="is not supported") as error:
            openai_client.chat.completions.create(
                model="policy", messages=hello, max_tokens=2, **change
            )
        assert next(iter(change)) in str(error.value)
    with pytest.raises(anthropic.BadRequestError, match="thinking="):
        anthropic_client.messages.create(
            model="policy",
            messages=hello,
            max_tokens=2,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    # two accepted turns, both on the one conversation; nothing refused was recorded
    _, requests = server.close_session(session["session"])
    assert len(requests) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_behavior_log_probs_the_session_stored(server, stream):
    session = server.open_session(71)
    client, _ = clients(session)
    hello = [{"role": "user", "content": "Count."}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="policy", messages=hello, max_tokens=6, logprobs=True, stream=True
            )
        )
        [content] = [c.choices[0].logprobs.content for c in chunks if c.choices[0].logprobs]
    else:
        reply = client.chat.completions.create(
            model="policy", messages=hello, max_tokens=6, logprobs=True
        )
        content = reply.choices[0].logprobs.content
    (segment,), _ = server.close_session(session["session"])
    start, end = segment.turn_spans[0]
    stored = segment.behavior_logprob[start:end]
    assert [entry.logprob for entry in content] == pytest.approx(stored[: len(content)], abs=1e-6)
    assert len(content) == end - start
    ids = segment.token_ids[start:end]
    assert [entry.token for entry in content] == [server.tokenizer.decode([i]) for i in ids]


def test_a_model_is_retrieved_by_id_and_count_tokens_counts_the_rendered_prompt(server):
    session = server.open_session(72)
    openai_client, anthropic_client = clients(session)
    assert openai_client.models.retrieve("policy").id == "policy"
    with pytest.raises(openai.NotFoundError, match="No model 'gpt-9'"):
        openai_client.models.retrieve("gpt-9")
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = anthropic_client.messages.count_tokens(
        model="policy", messages=messages, system="Be brief."
    )
    reply = anthropic_client.messages.create(
        model="policy", messages=messages, system="Be brief.", max_tokens=2
    )
    assert counted.input_tokens == reply.usage.input_tokens > 5


def test_a_client_that_echoes_the_stop_string_back_or_strips_the_reply_stays_in_one_segment(server):
    # smolagents' CodeAgent adds back the stop string it asked for; other clients strip replies
    session = server.open_session(73)
    client, _ = clients(session)
    messages = [{"role": "user", "content": TOOL_PROMPT}]
    # cut inside the call: what is left does not parse, so the reply is its text
    reply = client.chat.completions.create(
        model="policy", messages=messages, tools=OPENAI_TOOLS, stop=[", "], max_tokens=40
    )
    content = reply.choices[0].message.content
    assert content == TOOL_REPLY.partition(", ")[0]
    messages += [
        {"role": "assistant", "content": content + ", "},
        {"role": "user", "content": "Again."},
    ]
    second = client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS)
    messages += [
        {"role": "assistant", "content": (second.choices[0].message.content or "").strip()},
        {"role": "user", "content": "Once more."},
    ]
    if second.choices[0].message.tool_calls:
        messages[-2]["tool_calls"] = [c.model_dump() for c in second.choices[0].message.tool_calls]
    client.chat.completions.create(model="policy", messages=messages, tools=OPENAI_TOOLS)
    segments, requests = server.close_session(session["session"])
    assert [r["action"] for r in requests] == ["open", "extend", "extend"]
    assert len(segments) == 1


def test_thirty_two_concurrent_streaming_sessions_each_stay_in_one_segment(server):
    def episode(rollout: int) -> tuple[list, list]:
        session = server.open_session(rollout)
        client, _ = clients(session)
        # multi-byte characters the tiny tokenizer splits across tokens
        messages = [{"role": "user", "content": f"Café naïve ✓ {rollout}"}]
        for turn in range(3):
            chunks = client.chat.completions.create(
                model="policy", messages=messages, stream=True, max_tokens=10
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And é {turn}?"},
            ]
        return server.close_session(session["session"])

    with ThreadPoolExecutor(32) as pool:
        episodes = list(pool.map(episode, range(100, 132)))
    assert [len(segments) for segments, _ in episodes] == [1] * 32
    for _, requests in episodes:
        assert [r["action"] for r in requests] == ["open", "extend", "extend"]


def forced_span(server, segment, forced: str) -> tuple[int, int]:
    """Where `forced`'s ids sit in the segment: right after the first prompt, before the sample."""
    ids = server.tokenizer(forced, add_special_tokens=False)["input_ids"]
    start = segment.turn_spans[0][0] - len(ids)
    assert segment.token_ids[start : start + len(ids)] == ids
    assert segment.loss_mask[start : start + len(ids)] == [0] * len(ids)
    assert segment.behavior_logprob[start : start + len(ids)] == [0.0] * len(ids)
    assert segment.behavior_version[start : start + len(ids)] == [FORCED_VERSION] * len(ids)
    # the prompt before them is the prompt's, not forced
    assert segment.behavior_version[start - 1] == -1
    return start, start + len(ids)


@pytest.mark.parametrize(
    ("choice", "forced"),
    [
        # the chat template's tool call up to the name, or to the arguments
        ("required", '<tool_call>{"name": "'),
        ({"type": "function", "function": {"name": "add"}}, None),
    ],
)
def test_a_forced_tool_choice_is_forced_tokens_and_the_policy_samples_the_rest(
    server, choice, forced
):
    session = server.open_session(80)
    client, _ = clients(session)
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": TOOL_PROMPT}],
        tools=OPENAI_TOOLS,
        tool_choice=choice,
        max_tokens=40,
    )
    [call] = reply.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    (segment,), _ = server.close_session(session["session"])
    forced = forced or '<tool_call>{"name": "add", "arguments":'
    forced_span(server, segment, forced)
    start, end = segment.turn_spans[0]
    sampled = server.tokenizer.decode(segment.token_ids[start:end])
    assert forced + sampled.removesuffix(server.tokenizer.eos_token) == TOOL_REPLY


def test_anthropic_any_tool_and_an_assistant_prefill_are_forced_too(server):
    session = server.open_session(81)
    _, client = clients(session)
    reply = client.messages.create(
        model="policy",
        messages=[{"role": "user", "content": TOOL_PROMPT}],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "add"},
        max_tokens=40,
    )
    assert [(b.name, b.input) for b in reply.content if b.type == "tool_use"] == [
        ("add", {"a": 2, "b": 3})
    ]
    (segment,), _ = server.close_session(session["session"])
    forced_span(server, segment, '<tool_call>{"name": "add", "arguments":')
    # a prefill: the reply continues it, and the prefill is forced, not sampled
    session = server.open_session(82)
    _, client = clients(session)
    prefill = '<tool_call>{"name": "add",'
    reply = client.messages.create(
        model="policy",
        messages=[
            {"role": "user", "content": TOOL_PROMPT},
            {"role": "assistant", "content": prefill},
        ],
        max_tokens=40,
    )
    (segment,), _ = server.close_session(session["session"])
    forced_span(server, segment, prefill)
    start, end = segment.turn_spans[0]
    assert reply.content[0].text.startswith(
        server.tokenizer.decode(segment.token_ids[start:end])[:5]
    )
    assert not reply.content[0].text.startswith(prefill)


def test_a_forced_tool_the_request_does_not_offer_is_refused(server):
    session = server.open_session(83)
    openai_client, anthropic_client = clients(session)
    hello = [{"role": "user", "content": "Hi."}]
    with pytest.raises(openai.BadRequestError, match=r"name one of the request's tools \(add\)"):
        openai_client.chat.completions.create(
            model="policy",
            messages=hello,
            tools=OPENAI_TOOLS,
            tool_choice={"type": "function", "function": {"name": "mul"}},
        )
    with pytest.raises(anthropic.BadRequestError, match="needs the tools"):
        anthropic_client.messages.create(
            model="policy", messages=hello, max_tokens=2, tool_choice={"type": "any"}
        )
    assert not server.sessions[session["session"]].requests
