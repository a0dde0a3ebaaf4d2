"""The template preflight: a policy's own chat template and response parser driven through the
cases that break token identity, before a run spends compute on them (`molt-wb check-template`,
and `molt-wb train` at start-up).

Each case is a short conversation played through the real loopback server (its OpenAI wire, the
token accumulator, the response parser) against a scripted engine that "samples" the turn the chat
template itself writes (the response template's literal format where the chat template writes
none): no weights, no forward, rendering and parsing only. A case passes when every echo of a
reply extends the episode's one segment, the sampled ids stay exact and the parser reads back what
was written. Every case runs under both `agent.history_rewrite` modes: `bridge` is recommended
when it passes cases that `seal` fails (the template rewrites earlier turns), else `seal`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.engines.base import Generation, SamplingParams
from workbench.models.pretrained import PRETRAINED, held_folder, named_path
from workbench.models.tiny import TINY_SPECS
from workbench.server.loopback import LoopbackServer
from workbench.server.replies import response_template

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODES = ("seal", "bridge")
PASS = "pass"
FAIL = "FAIL"
# a case the template cannot express (no reasoning field, one call per turn): nothing to check
NOT_APPLICABLE = "n/a"
QUESTION = "What is 2 + 2?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"id": "call_0", "name": "add", "arguments": {"a": 2, "b": 3}}
SECOND_CALL = {"id": "call_1", "name": "add", "arguments": {"a": 4, "b": 5}}
STOP = "Observation:"
# why an echo seals, by the accumulator's seal reason
SEALED = {
    "template_rewrite": "the history rewrote",
    "compaction": "the client's echo is not the reply as sampled",
    "tools_changed": "the tools changed",
}


class CaseError(Exception):
    """A case stopped: the server refused a turn, or a reply read back wrong (one sentence)."""


class NotApplicable(Exception):
    """The template cannot express the case (the sentence says why)."""


@dataclass
class Outcome:
    """One case under one `agent.history_rewrite` mode: pass, FAIL or n/a, and why."""

    case: str
    mode: str
    status: str
    detail: str


class ScriptedEngine:
    """An engine that 'samples' the ids queued on it, one reply per call row, each ending with the
    stop token: the preflight's stand-in for a policy (no weights, no forward)."""

    version = 0

    def __init__(self) -> None:
        self.queued: list[list[int]] = []

    def generate(
        self,
        prompts: list[np.ndarray],
        params: SamplingParams,
        images: list | None = None,
        listener: Callable | None = None,
    ) -> list[Generation]:
        """The queued replies, in order, one per prompt."""
        generations = []
        for _ in prompts:
            ids = np.asarray(self.queued.pop(0), dtype=np.int32)
            zeros = np.zeros(len(ids), np.float32)
            generations.append(Generation(ids, zeros, np.zeros(len(ids), np.int32), "stop"))
        return generations

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Nothing to load: the replies are scripted."""


class Probe:
    """The tokenizer's templates behind a loopback server of one `agent.history_rewrite` mode."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, mode: str):
        if tokenizer.eos_token_id is None or not tokenizer.chat_template:
            raise ValueError(
                "The tokenizer has no chat template or no eos token: give a chat model's folder "
                "(its tokenizer_config.json sets both)."
            )
        self.tokenizer = tokenizer
        self.mode = mode
        self.engine = ScriptedEngine()
        params = SamplingParams(max_tokens=512, stop_token_ids=(tokenizer.eos_token_id,))
        self.server = LoopbackServer(self.engine, tokenizer, params, history_rewrite=mode)

    def render(self, messages: list[dict], tools: list[dict] | None, prompt: bool) -> str:
        """The chat template's text of `messages` (and the assistant's opening when `prompt`)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=prompt
        )

    def written(self, messages: list[dict], turn: dict, tools: list[dict] | None) -> str | None:
        """The text of assistant `turn` as the chat template writes it after `messages`, up to its
        stop token; None where the template renders it elsewhere or refuses it."""
        try:
            prompt = self.render(messages, tools, True)
            whole = self.render([*messages, turn], tools, False)
        # the template's own refusal (raise_exception), or a shape it cannot render
        except Exception as error:
            raise NotApplicable(f"the chat template refuses it ({error})") from None
        eos = self.tokenizer.eos_token
        if not whole.startswith(prompt) or eos not in whole[len(prompt) :]:
            return None
        text = whole[len(prompt) :]
        return text[: text.index(eos)]

    def chat(self, tools: list[dict] | None = None) -> Chat:
        return Chat(self, tools)

    def close(self) -> None:
        self.server.stop()


class Chat:
    """One episode: a client on the OpenAI wire that keeps each reply as the SDK returns it."""

    def __init__(self, probe: Probe, tools: list[dict] | None):
        self.probe = probe
        self.tools = tools
        self.session = probe.server.open_session(0)
        # what the client sends: each reply kept as the wire returned it
        self.messages: list[dict] = []
        # the same conversation in the chat template's form, to write the next turn after
        self.history: list[dict] = []

    def ask(self, *messages: dict) -> None:
        """Add the user's (or tools') next messages."""
        self.messages += messages
        self.history += messages

    def write(self, content: str) -> str:
        """A text turn as the chat template writes it after the history (else the text itself)."""
        written = self.probe.written(self.history, assistant(content), self.tools)
        if written is None or content not in written:
            return content
        return written

    def reply(self, text: str, turn: dict, stop: str | None = None) -> dict:
        """The engine samples `text` and the stop token; the reply's message as the client keeps
        it (echoed on the next turn). `turn`: the same reply in the chat template's form."""
        tokenizer = self.probe.tokenizer
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.probe.engine.queued.append([*ids, tokenizer.eos_token_id])
        body: dict[str, Any] = {"model": "policy", "messages": self.messages}
        if self.tools:
            body["tools"] = self.tools
        if stop:
            body["stop"] = [stop]
        message = self._post(body)["choices"][0]["message"]
        self.messages.append(message)
        self.history.append(turn)
        return message

    def _post(self, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.session['openai_base_url']}/chat/completions",
            data=json.dumps(body).encode(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {self.session['api_key']}",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            refusal = json.loads(error.read()).get("error", {}).get("message", "")
            raise CaseError(f"the server refused turn {len(self.history) + 1}: {refusal}") from None

    def verdict(self, passed: str) -> str:
        """Close the episode: `passed` when it stayed one segment whose sampled ids are exact."""
        segments, requests = self.probe.server.close_session(self.session["session"])
        for turn, request in enumerate(requests[1:], start=2):
            if request["action"] != "extend":
                reason = segments[0].seal_reason
                raise CaseError(f"turn {turn} sealed the segment ({reason}): {SEALED[reason]}")
        if not all(segment.identity_holds() for segment in segments):
            raise CaseError("the segment's sampled ids differ from the engine's")
        return passed


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(content: str, **fields: Any) -> dict:
    return {"role": "assistant", "content": content, **fields}


def read_back(message: dict, content: str) -> None:
    """The reply's content, as the response parser reads it, holds `content`."""
    if content.strip() not in (message.get("content") or ""):
        raise CaseError(
            f"the response template reads the content {message.get('content')!r}, not {content!r}"
        )


# ---- the cases: each plays one conversation; returns what passed, raises what failed


def multi_turn(probe: Probe) -> str:
    """Three plain turns: each echo extends the segment (the render of the history stays a
    prefix)."""
    chat = probe.chat()
    for question, answer in ((QUESTION, "4."), ("And twice that?", "8."), ("Thanks.", "Glad to.")):
        chat.ask(user(question))
        read_back(chat.reply(chat.write(answer), assistant(answer)), answer)
    return chat.verdict("3 turns, one segment")


def reasoning(probe: Probe) -> str:
    """A turn with reasoning, then a new question: templates that drop earlier reasoning (Qwen3)
    rewrite the history."""
    thinking = response_template(probe.tokenizer)["fields"].get("thinking") or {}
    if not isinstance(thinking.get("open"), str):
        raise NotApplicable("the response template reads no reasoning")
    chat = probe.chat()
    chat.ask(user(QUESTION))
    thought = "Two and two make four."
    turn = assistant("4.", reasoning_content=thought)
    text = probe.written(chat.history, turn, None)
    if text is None or thought not in text:
        text = f"{thinking['open']}\n{thought}\n{thinking['close']}\n\n{chat.write('4.')}"
    message = chat.reply(text, turn)
    if thought not in (message.get("reasoning_content") or ""):
        raise CaseError(f"the response template reads no reasoning back from {text!r}")
    chat.ask(user("And twice that?"))
    chat.reply(chat.write("8."), assistant("8."))
    return chat.verdict("reasoning read back; the next question extends")


def tool_round_trip(probe: Probe, calls: list[dict], content: str) -> str:
    """A turn of `calls` (after `content`) written as the chat template writes them, read back by
    the response template, answered by the tools, then a final answer: one segment."""
    question = user("Add 2 and 3." if len(calls) == 1 else "Add 2 and 3, and 4 and 5.")
    if probe.render([question], TOOLS, True) == probe.render([question], None, True):
        raise CaseError("the chat template does not show the tools to the policy")
    chat = probe.chat(TOOLS)
    chat.ask(question)
    turn = assistant(content, tool_calls=calls)
    text = probe.written(chat.history, turn, TOOLS)
    if text is None or not all(call["name"] in text for call in calls):
        raise CaseError(
            "the chat template renders no tool call: a fresh render (after a seal) drops the "
            "calls the policy made"
        )
    if content and content not in text:
        raise NotApplicable("the chat template writes no content beside a tool call")
    message = chat.reply(text, turn)
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]
    if got != [(call["name"], call["arguments"]) for call in calls]:
        raise CaseError(f"the response template reads {got or 'no call'} back from {text!r}")
    if content:
        read_back(message, content)
    chat.ask(*(tool_result(call) for call in message["tool_calls"]))
    chat.reply(chat.write("It is 5."), assistant("It is 5."))
    return chat.verdict(f"{len(calls)} call(s) read back; the results and answer extend")


def tool_result(call: dict) -> dict:
    """A tool's answer to a call as the client sends it."""
    return {"role": "tool", "tool_call_id": call["id"], "content": "5"}


def single_call(probe: Probe) -> str:
    """One tool call, its result, the answer."""
    return tool_round_trip(probe, [CALL], "")


def parallel_calls(probe: Probe) -> str:
    """Two calls in one turn."""
    return tool_round_trip(probe, [CALL, SECOND_CALL], "")


def call_with_content(probe: Probe) -> str:
    """Text, then a call, in one turn."""
    return tool_round_trip(probe, [CALL], "Let me add.")


def whitespace(probe: Probe) -> str:
    """Replies with whitespace around them, echoed verbatim, then stripped (as many clients
    do)."""
    chat = probe.chat()
    for question, answer, keep in ((QUESTION, "4.", str), ("And twice that?", "8.", str.strip)):
        chat.ask(user(question))
        written, _, after = chat.write(answer).rpartition(answer)
        message = chat.reply(f"{written} {answer}\n\n{after}", assistant(answer))
        message["content"] = keep(message["content"])
    chat.ask(user("Thanks."))
    chat.reply(chat.write("Glad to."), assistant("Glad to."))
    return chat.verdict("echoes verbatim and stripped extend")


def stop_string(probe: Probe) -> str:
    """Turns cut at a stop string (no stop token sampled), echoed without it, then with it put
    back (smolagents re-appends its stop string)."""
    chat = probe.chat()
    for question, answer in (
        (QUESTION, "Thought: add them.\n"),
        ("And twice?", "Thought: double.\n"),
    ):
        chat.ask(user(question))
        message = chat.reply(chat.write(f"{answer}{STOP} 4"), assistant(answer), stop=STOP)
        if STOP in (message.get("content") or ""):
            raise CaseError("the reply kept the text after its stop string")
    chat.messages[-1]["content"] += STOP
    chat.ask(user("Go on."))
    chat.reply(chat.write("4."), assistant("4."))
    return chat.verdict("cut turns extend, with or without the stop string echoed")


def default_system(probe: Probe) -> str:
    """A system prompt the template writes when the conversation has none: kept in every prompt
    (never trained); one that reads the clock changes between turns of the same episode."""
    tokenizer = probe.tokenizer
    if "strftime_now" in tokenizer.chat_template:
        raise CaseError(
            "the template writes today's date (strftime_now): an episode open across midnight "
            "seals, and a resumed run's prompts differ"
        )
    rendered = probe.render([user("PROBE")], None, True)
    before = rendered[: rendered.index("PROBE")]
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    for special in [*specials, *tokenizer.all_special_tokens]:
        before = before.replace(special, " ")
    # what is left but role names: text no message holds
    words = [word for word in before.split() if word not in ("system", "user")]
    if not words:
        return "no system prompt inserted"
    inserted = " ".join(words)
    return f"inserts {inserted[:70]!r} before the first message (in every prompt, mask 0)"


CASES: dict[str, Callable[[Probe], str]] = {
    "multi_turn": multi_turn,
    "reasoning": reasoning,
    "tool_call": single_call,
    "parallel_calls": parallel_calls,
    "call_with_content": call_with_content,
    "whitespace": whitespace,
    "stop_string": stop_string,
    "default_system": default_system,
}


@dataclass
class Report:
    """Every case under both modes, and the mode recommended."""

    outcomes: list[Outcome]
    recommended: str

    def outcome(self, case: str, mode: str) -> Outcome:
        return next(o for o in self.outcomes if o.case == case and o.mode == mode)

    def failing(self, mode: str) -> list[Outcome]:
        """The cases that fail under `mode`, in case order."""
        return [o for o in self.outcomes if o.mode == mode and o.status == FAIL]

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(case, status under seal, under bridge, what happened: the failure where one failed)."""
        rows = []
        for case in CASES:
            outcomes = [self.outcome(case, mode) for mode in MODES]
            failed = [o for o in outcomes if o.status == FAIL]
            detail = (failed or outcomes)[0].detail
            rows.append((case, outcomes[0].status, outcomes[1].status, detail))
        return rows

    def advice(self) -> str:
        """The recommended `agent.history_rewrite`, and why."""
        if self.recommended == "bridge":
            rewritten = ", ".join(
                o.case for o in self.failing("seal") if o not in self.failing("bridge")
            )
            return (
                f"recommended: agent.history_rewrite=bridge: the template rewrites earlier "
                f"turns ({rewritten}), so seal starts a new segment there and prefills the "
                f"history again; bridge keeps one segment per episode."
            )
        return (
            "recommended: agent.history_rewrite=seal (the default): the template rewrites no "
            "earlier turn that bridge would keep."
        )


def check(tokenizer: PreTrainedTokenizerBase) -> Report:
    """Play every case under seal and bridge; bridge is recommended where it fails fewer."""
    outcomes = []
    for mode in MODES:
        probe = Probe(tokenizer, mode)
        try:
            for name, case in CASES.items():
                outcomes.append(_play(probe, name, case))
        finally:
            probe.close()
    failures = {
        mode: len([o for o in outcomes if o.mode == mode and o.status == FAIL]) for mode in MODES
    }
    recommended = "bridge" if failures["bridge"] < failures["seal"] else "seal"
    return Report(outcomes, recommended)


def _play(probe: Probe, name: str, case: Callable[[Probe], str]) -> Outcome:
    """One case's outcome; a reply a refused turn left queued never reaches the next case."""
    try:
        return Outcome(name, probe.mode, PASS, case(probe))
    except CaseError as error:
        return Outcome(name, probe.mode, FAIL, str(error))
    except NotApplicable as error:
        return Outcome(name, probe.mode, NOT_APPLICABLE, str(error))
    finally:
        probe.engine.queued.clear()


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `model`: a checkpoint folder, a .gguf file (its conversion where this
    machine holds one, else read from the file) or a built-in model's name (tiny, smollm2-135m,
    ...: fetched and converted once, as `molt-wb train model=NAME` does)."""
    from transformers import AutoTokenizer

    path = Path(model)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    if path.suffix == ".gguf" and path.is_file():
        converted = held_folder("", model)
        if converted:
            return AutoTokenizer.from_pretrained(converted)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if model in TINY_SPECS or model in PRETRAINED:
        return AutoTokenizer.from_pretrained(named_path(model))
    raise ValueError(
        f"{model} is neither a checkpoint folder, a .gguf file nor a built-in model "
        f"({', '.join([*TINY_SPECS, *PRETRAINED])}): give one of those."
    )


# the cases a policy that never calls a tool cannot meet
TOOL_CASES = ("tool_call", "parallel_calls", "call_with_content")


def startup_warnings(model: str, mode: str, tools: bool = True) -> list[str]:
    """One sentence per case the policy's template (`model`) fails under `agent.history_rewrite`
    `mode` (the tool cases only where the run's policy may call `tools`): what `molt-wb train`
    prints before it starts."""
    try:
        report = check(load_tokenizer(model))
    # advisory: a check that cannot run never stops a run (the run itself says what is wrong)
    except Exception as error:
        return [f"template check skipped: {type(error).__name__}: {error}"]
    other = MODES[1 - MODES.index(mode)]
    sentences = []
    for outcome in report.failing(mode):
        if outcome.case in TOOL_CASES and not tools:
            continue
        fix = ""
        if report.outcome(outcome.case, other).status == PASS:
            fix = f"; agent.history_rewrite={other} passes it"
        sentences.append(
            f"template check, {outcome.case}: {outcome.detail}{fix} (molt-wb check-template "
            f"{model})."
        )
    return sentences
