"""The loopback server under fuzzing: whatever a request says, the answer is a 4xx in the wire's
error shape (or a proper reply), never a 5xx; a refused request records nothing; no session ever
sees another's content or key. `bench/fuzz_server.py` runs the same fuzzer longer."""

import http.client
import json
from collections import Counter

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as with_seed
from hypothesis import strategies as st

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.server.loopback import MAX_BODY, LoopbackServer

MARKER = "zebra-quartz-7f3a"  # in the victim session's conversation only
WEIRD_NUMBERS = st.sampled_from(
    [0, -1, 1, 3, 2.5, 10**12, 1e308, float("inf"), float("nan"), "3", True, None, 200000]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
ROLES = (
    st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "", "USER"])
    | JSON
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "image", "tool_use", "tool_result", "audio"])},
    optional={
        "text": JSON,
        "image_url": st.sampled_from(
            [{"url": "file:///etc/passwd"}, {"url": "data:image/png;base64,xyz"}, {}]
        ),
        "source": st.sampled_from([{"data": "AAAA"}, {"type": "url", "url": "http://127.0.0.1/x"}]),
        "input": JSON,
        "content": JSON,
        "id": JSON,
    },
)
ARGUMENTS = (
    st.sampled_from(['{"a": 1}', '{"a":', "[1, 2]", "null", '"x"', "", "{}", "[" * 5000]) | JSON
)
TOOL_CALLS = (
    st.lists(
        st.fixed_dictionaries(
            {
                "id": JSON,
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": JSON, "arguments": ARGUMENTS}),
            }
        ),
        max_size=2,
    )
    | JSON
)
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={
        "content": st.text(max_size=30) | st.lists(PART, max_size=2) | JSON,
        "tool_calls": TOOL_CALLS,
        "tool_call_id": JSON,
    },
)
COMMON = {
    "model": JSON,
    "max_tokens": WEIRD_NUMBERS,
    "temperature": WEIRD_NUMBERS,
    "top_p": WEIRD_NUMBERS,
    "stream": JSON,
    "tools": JSON
    | st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": JSON}), max_size=2),
    "tool_choice": JSON,
    "metadata": JSON,
    "logit_bias": JSON,
}
OPENAI = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional=dict(
        COMMON, stop=JSON, n=WEIRD_NUMBERS, stream_options=JSON, max_completion_tokens=WEIRD_NUMBERS
    ),
)
ANTHROPIC = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON, "max_tokens": WEIRD_NUMBERS},
    optional=dict(
        {k: v for k, v in COMMON.items() if k != "max_tokens"}, system=JSON, stop_sequences=JSON
    ),
)
RESPONSES_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "text"])},
    optional={
        "text": JSON,
        "image_url": st.sampled_from(["file:///etc/passwd", "data:image/png;base64,xyz"]) | JSON,
    },
)
RESPONSES_CONTENT = st.text(max_size=30) | st.lists(RESPONSES_PART, max_size=2) | JSON
ITEM = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "item_reference"]
        )
        | JSON
    },
    optional={
        "role": ROLES,
        "content": RESPONSES_CONTENT,
        "call_id": JSON,
        "name": JSON,
        "arguments": ARGUMENTS,
        "output": RESPONSES_CONTENT,
        "summary": JSON,
    },
)
RESPONSES_FIELDS = {
    "model": JSON,
    "instructions": JSON,
    "max_output_tokens": st.integers(-2, 300) | WEIRD_NUMBERS,
    "temperature": WEIRD_NUMBERS,
    "top_p": WEIRD_NUMBERS,
    "stream": JSON,
    "tools": JSON
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"])},
            optional={"name": JSON, "parameters": JSON, "strict": JSON},
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["required", {"type": "function", "name": "add"}]) | JSON,
    "previous_response_id": JSON,
    "store": JSON,
    "truncation": JSON,
    "include": JSON,
    "text": JSON,
    "reasoning": JSON,
    "metadata": JSON,
}
RESPONSES = st.fixed_dictionaries(
    {"input": st.text(max_size=30) | st.lists(ITEM | MESSAGE, max_size=3) | JSON},
    optional=RESPONSES_FIELDS,
)
MUTATIONS = {
    **COMMON,
    "stop": JSON,
    "stop_sequences": JSON,
    "stream_options": JSON,
    "system": JSON,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_tokens": st.integers(-2, 300) | WEIRD_NUMBERS,
}
TOOL_TURN = [
    {"role": "user", "content": "Add."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "3"},
]
# the same turn as Responses input items
TOOL_ITEMS = [
    {"role": "user", "content": "Add."},
    {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
    {"type": "function_call_output", "call_id": "c1", "output": "3"},
]
WIRES = {
    "openai": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "responses": "/v1/responses",
}
TARGETS = ["own"] * 6 + [
    "other_key",
    "other_path",
    "unknown_session",
    "no_key",
    "odd_key",
    "traversal",
    "get",
    "no_route",
]
BODIES = ["wire"] * 4 + ["mutant"] * 6 + ["json", "bytes", "nested", "huge"]


def victim_and_target(server):
    """A victim session with one real turn (MARKER in its prompt; by the Responses wire, so the
    fuzzer can name the victim's response as a previous_response_id), and the session the fuzzer
    talks to."""
    victim = server.open_session(900)
    reply = openai.OpenAI(
        base_url=victim["openai_base_url"], api_key=victim["api_key"], max_retries=0
    ).responses.create(model="policy", input=f"Remember {MARKER}.", max_output_tokens=2)
    victim = dict(victim, reply=reply.output_text, response_id=reply.id)
    return victim, server.open_session(901)


def snapshot(server, session_id):
    session = server.sessions[session_id]
    conversations = len(session.conversations)
    return id(session.accumulator), len(session.requests), session.last_request, conversations


def draw_route(data, wire: str, target_kind: str, victim: dict, target: dict) -> tuple[str, dict]:
    """The path and headers of a request aimed where `target_kind` says."""
    endpoint = WIRES[wire]
    session = target["session"]
    key = target["api_key"]
    if target_kind == "other_key":
        key = victim["api_key"]
    elif target_kind == "other_path":
        session = victim["session"]
    elif target_kind == "unknown_session":
        session = "0123456789abcdef"
    elif target_kind == "odd_key":
        key = data.draw(st.sampled_from(["\xe9\xff", "sk-" + "a" * 5000, "", " " + key, key[:-1]]))
    path = {
        "traversal": f"/s/../../etc/passwd{endpoint}",
        "no_route": f"/s/{session}/v1/files",
    }.get(target_kind, f"/s/{session}{endpoint}")
    if target_kind == "no_key":
        return path, {}
    if data.draw(st.booleans()):
        return path, {"x-api-key": key}
    return path, {"Authorization": f"Bearer {key}"}


def draw_body(data, wire: str, body_kind: str, response_ids: list[str]) -> bytes:
    """A hostile body of the kind `body_kind` names; a Responses request may name one of
    `response_ids` (the victim's response, the target's latest, an unknown one)."""
    if wire == "responses" and body_kind in ("wire", "mutant"):
        return draw_responses_body(data, body_kind, response_ids)
    if body_kind == "wire":
        return json.dumps(data.draw(OPENAI if wire == "openai" else ANTHROPIC)).encode()
    if body_kind == "mutant":
        # a valid request with one or two fields made hostile: reaches the deeper code
        hello = [{"role": "user", "content": "Hi."}]
        conversations = [hello, TOOL_TURN if wire == "openai" else hello]
        base = {
            "model": "policy",
            "max_tokens": 2,
            "messages": data.draw(st.sampled_from(conversations)),
        }
        keys = data.draw(
            st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=2, unique=True)
        )
        return json.dumps(dict(base, **{key: data.draw(MUTATIONS[key]) for key in keys})).encode()
    if body_kind == "json":
        return json.dumps(data.draw(JSON)).encode()
    if body_kind == "bytes":
        return data.draw(st.binary(max_size=64))
    # the wire's conversation field: deep or huge there reaches its decoder
    conversation = b'{"messages": '
    if wire == "responses":
        conversation = b'{"input": '
    if body_kind == "nested":
        depth = data.draw(st.integers(100, 200_000))
        return conversation + b"[" * depth + b"]" * depth + b"}"
    return conversation + b'[{"role": "user", "content": "' + b"x" * (MAX_BODY + 1024) + b'"}]}'


def draw_responses_body(data, body_kind: str, response_ids: list[str]) -> bytes:
    """A hostile Responses body: drawn whole, or a valid request with one or two fields made
    hostile (its previous_response_id another session's response, its own, or none)."""
    if body_kind == "wire":
        return json.dumps(data.draw(RESPONSES)).encode()
    mutations = dict(
        RESPONSES_FIELDS,
        input=st.lists(ITEM | MESSAGE, min_size=1, max_size=3),
        previous_response_id=st.sampled_from(response_ids) | JSON,
    )
    base = {
        "model": "policy",
        "max_output_tokens": 2,
        "input": data.draw(st.sampled_from(["Hi.", TOOL_ITEMS])),
    }
    # naming a response reaches the continuation (and another session's must not): drawn often
    fields = sorted(mutations) + ["previous_response_id"] * 4
    keys = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=2, unique=True))
    return json.dumps(dict(base, **{key: data.draw(mutations[key]) for key in keys})).encode()


def in_error_shape(path: str, reply: bytes) -> bool:
    """Is this refusal in the error shape of the wire the path names?"""
    try:
        error = json.loads(reply)
        if path.endswith("/messages"):
            return error["type"] == "error" and isinstance(error["error"]["message"], str)
        if path.endswith("/responses"):
            # OpenAI's shape with every field the SDK reads
            fields = {"message", "type", "param", "code"}
            return set(error["error"]) == fields and isinstance(error["error"]["message"], str)
        return isinstance(error["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        return False


def fuzz(
    server,
    victim: dict,
    target: dict,
    budget: int,
    statuses: Counter,
    problems: list[str],
    seed: int | None = None,
) -> None:
    """Send `budget` hostile requests (a fixed set unless `seed`); count status codes in
    `statuses` and every broken promise in `problems`."""
    connection = [http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)]

    def send(method: str, path: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        for attempt in range(2):
            try:
                connection[0].request(method, path, body=body, headers=headers)
                response = connection[0].getresponse()
                return response.status, response.read()
            # the server closed a connection (after a 413): reconnect
            except (ConnectionError, http.client.HTTPException):
                connection[0].close()
                connection[0] = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                if attempt:
                    raise

    @settings(
        max_examples=budget,
        deadline=None,
        derandomize=seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @with_seed(seed or 0)
    @given(st.data())
    def one_request(data):
        wire = data.draw(st.sampled_from(list(WIRES)))
        target_kind = data.draw(st.sampled_from(TARGETS))
        body_kind = data.draw(st.sampled_from(BODIES))
        path, headers = draw_route(data, wire, target_kind, victim, target)
        # the victim's response, the target's latest and an unknown one (a fixed-length list:
        # hypothesis replays draws, so their choices must not depend on the server's state)
        latest = next(reversed(server.sessions[target["session"]].conversations), "unknown")
        response_ids = [victim["response_id"], f"resp_{latest}", "resp_unknown"]
        body = draw_body(data, wire, body_kind, response_ids)
        before = {s: snapshot(server, s) for s in (victim["session"], target["session"])}
        status, reply = send(
            "GET" if target_kind == "get" else "POST",
            path,
            dict(headers, **{"Content-Type": "application/json"}),
            body,
        )
        statuses[status] += 1
        where = f"{target_kind}/{body_kind}/{wire}: {body[:160]!r}"
        if status >= 500:
            problems.append(f"{status} for {where}: {reply[:300]!r}")
        if MARKER.encode() in reply or victim["api_key"].encode() in reply:
            problems.append(f"victim content or key leaked for {where}")
        if snapshot(server, victim["session"]) != before[victim["session"]]:
            problems.append(f"victim session changed by {where}")
        if status != 200:
            if snapshot(server, target["session"]) != before[target["session"]]:
                problems.append(f"a refused request ({status}) changed the session: {where}")
            if not in_error_shape(path, reply):
                problems.append(
                    f"{status} not in the {wire} error shape for {where}: {reply[:200]!r}"
                )

    one_request()
    connection[0].close()


@pytest.fixture(scope="module")
def fuzz_server(tiny_path, tokenizer):
    server = LoopbackServer(
        TorchEngine(tiny_path),
        tokenizer,
        SamplingParams(max_tokens=4, stop_token_ids=(tokenizer.eos_token_id,)),
        max_total_tokens=256,
    )
    yield server
    server.stop()


def test_hostile_requests_get_wire_shaped_4xx_and_change_nothing(fuzz_server):
    victim, target = victim_and_target(fuzz_server)
    statuses = Counter()
    problems = []
    fuzz(fuzz_server, victim, target, 300, statuses, problems)
    assert not problems, "\n".join(problems[:10])
    assert sum(statuses.values()) == 300 and all(status < 500 for status in statuses)
    assert {400, 401, 404, 413} <= set(statuses)  # the fuzzer reached every refusal
    # the server is still whole: the victim's conversation extends, a new session works
    client = openai.OpenAI(
        base_url=victim["openai_base_url"], api_key=victim["api_key"], max_retries=0
    )
    client.chat.completions.create(
        model="policy",
        messages=[
            {"role": "user", "content": f"Remember {MARKER}."},
            {"role": "assistant", "content": victim["reply"]},
            {"role": "user", "content": "Again."},
        ],
        max_tokens=2,
    )
    assert [r["action"] for r in fuzz_server.sessions[victim["session"]].requests] == [
        "open",
        "extend",
    ]


@pytest.mark.slow
def test_ten_thousand_hostile_requests_break_no_promise(fuzz_server):
    # a fresh draw of the same fuzzer at volume (seeded: a failure replays); every wire
    victim, target = victim_and_target(fuzz_server)
    statuses = Counter()
    problems = []
    fuzz(fuzz_server, victim, target, 10_000, statuses, problems, seed=13)
    assert not problems, "\n".join(problems[:10])
    assert sum(statuses.values()) == 10_000 and all(status < 500 for status in statuses)
    assert {200, 400, 401, 404, 405, 413} <= set(statuses)


def test_token_limit_and_body_limit_are_enforced(fuzz_server):
    session = fuzz_server.open_session(1)
    client = openai.OpenAI(
        base_url=session["openai_base_url"], api_key=session["api_key"], max_retries=0
    )
    with pytest.raises(openai.BadRequestError, match="exceeds this server's limit of 256 tokens"):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=300
        )
    with pytest.raises(openai.BadRequestError, match="exceeds this server's limit"):
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "word " * 400}]
        )
    assert not fuzz_server.sessions[session["session"]].requests
    with pytest.raises(openai.APIStatusError, match="Request body over") as error:
        client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x" * MAX_BODY}]
        )
    assert error.value.status_code == 413
