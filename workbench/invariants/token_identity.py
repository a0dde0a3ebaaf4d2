"""Invariant: the token ids the policy sampled are the trajectory; nothing is re-encoded.

`TokenAccumulator` builds an episode's token sequence turn by turn. Sampled ids are appended as
they came out of the engine (mask 1, with their log-prob and version). A new message is added by
rendering the conversation with the chat template and tokenising only the *delta* the new message
adds (mask 0); when the old render is not a prefix of the new one (a template that rewrites
history, a compacted context) the open segment is sealed and a new one starts from a fresh render
(with `rewrite="bridge"`, a template's rewrite keeps the sampled ids and appends the new messages as
the template renders a trailing turn).
Decoded text exists for the environment and for display, never as trainer input. An image in a
message renders as one placeholder that the model's image codec expands to that image's run of
placeholder ids (mask 0); the segment keeps the image bytes in the order of their runs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedTokenizerBase

    from workbench.models.multimodal import ImageCodec

# the behavior version of a forced token: inserted by the server (a forced tool call's opening, a
# prefill), never sampled (mask 0, no behavior log-prob)
FORCED_VERSION = -2
# why a segment ended before its episode did (a new segment started)
SEAL_REASONS = ("compaction", "tools_changed", "template_rewrite")


@dataclass
class SegmentTokens:
    """Token-exact arrays of one segment, before it becomes a `Segment` record."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprob: list[float] = field(default_factory=list)
    # the sampled ids' log-probs before the engine's top_p truncation, NaN where it gave none
    raw_logprob: list[float] = field(default_factory=list)
    behavior_version: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    seal_reason: str = ""
    prompt_text: str = ""
    # what the engine returned, per turn
    sampled_turns: list[np.ndarray] = field(default_factory=list)
    # finish reason of the last sampled turn
    finish: str = ""
    # encoded images, in the order of their placeholder runs
    images: list[bytes] = field(default_factory=list)
    # int16 [t, layers, k] experts of the latest forward over positions 0..t
    routes: np.ndarray | None = None

    def extend(
        self,
        ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray | None = None,
        versions: Sequence[int] | np.ndarray | None = None,
        raw: np.ndarray | None = None,
    ) -> None:
        """Append `ids`: sampled (mask 1) when they come with their `logprobs`, else mask 0 with
        log-prob 0 and `versions` (default -1); `raw`: their log-probs before truncation."""
        sampled = logprobs is not None
        self.token_ids.extend(map(int, ids))
        self.loss_mask.extend([int(sampled)] * len(ids))
        self.behavior_logprob.extend(map(float, logprobs) if sampled else [0.0] * len(ids))
        self.raw_logprob.extend([np.nan] * len(ids) if raw is None else map(float, raw))
        self.behavior_version.extend([-1] * len(ids) if versions is None else map(int, versions))

    def copy(self) -> SegmentTokens:
        """A copy whose lists grow apart from this one's (their items are never mutated)."""
        lists = {name: list(value) for name, value in vars(self).items() if isinstance(value, list)}
        return dataclasses.replace(self, **lists)

    def identity_holds(self) -> bool:
        """Audit: the mask-1 ids are exactly the engine's sampled ids, in order."""
        sampled = np.asarray(self.token_ids)[np.asarray(self.loss_mask, dtype=bool)]
        returned = np.concatenate([np.zeros(0, np.int64), *self.sampled_turns])
        return np.array_equal(sampled, returned)

    def arrays(self) -> dict[str, np.ndarray | None]:
        routed = None
        # positions added after the last forward are unknown (-1)
        if self.routes is not None:
            routed = np.full((len(self.token_ids), *self.routes.shape[1:]), -1, dtype=np.int16)
            routed[: len(self.routes)] = self.routes[: len(self.token_ids)]
        return {
            "routed_experts": routed,
            "token_ids": np.asarray(self.token_ids, dtype=np.int32),
            "loss_mask": np.asarray(self.loss_mask, dtype=np.uint8),
            "behavior_logprob": np.asarray(self.behavior_logprob, dtype=np.float32),
            "raw_logprob": np.asarray(self.raw_logprob, dtype=np.float32),
            "behavior_version": np.asarray(self.behavior_version, dtype=np.int32),
        }


def message_images(messages: list[dict]) -> list[bytes]:
    """Encoded images of `messages` in render order.

    Content parts look like `{"type": "image", "image": bytes}`."""
    return [
        part["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image"
    ]


def retokenize_drift(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> bool:
    """Would decoding these ids to text and encoding it again give other ids?

    Measured, never acted on. Through the fast tokenizer's Rust backend when there is one:
    the same round trip, a quarter of the cost."""
    ids = list(token_ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"] != ids
    text = backend.decode(ids, skip_special_tokens=False)
    return backend.encode(text, add_special_tokens=False).ids != ids


def reply_text(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int] | np.ndarray, finish_reason: str
) -> str:
    """The text of a sampled turn, for the agent: the stop token dropped, tool-call tags kept."""
    ids = token_ids[:-1] if finish_reason == "stop" and len(token_ids) else token_ids
    return tokenizer.decode(ids, skip_special_tokens=False)


def stream_pieces(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int] | np.ndarray, content: str
) -> list[str]:
    """`content` in the pieces it was generated in (for streaming): their concatenation is exactly
    `content`. A character whose bytes span several tokens goes out whole with its last token: the
    decoded prefix ends in U+FFFD until then."""
    pieces = []
    sent = 0
    for k in range(1, len(token_ids) + 1):
        stable = reply_text(tokenizer, token_ids[:k], "length").rstrip("\ufffd")
        if len(stable) > sent and content.startswith(stable[: len(content)]):
            end = min(len(stable), len(content))
            pieces.append(content[sent:end])
            sent = end
    if sent < len(content):
        pieces.append(content[sent:])
    return [piece for piece in pieces if piece]


def _calls(message: dict) -> list[tuple[str | None, dict | None]]:
    """A message's tool calls by name and arguments."""
    return [(call.get("name"), call.get("arguments")) for call in message.get("tool_calls") or []]


class TokenAccumulator:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        messages: list[dict],
        tools: list[dict] | None = None,
        codec: ImageCodec | None = None,
        rewrite: str = "seal",
    ) -> None:
        """`rewrite`: what a template that rewrites the history does to the episode: `seal` (a new
        segment from the template's fresh render) or `bridge` (the sampled ids stay; the new
        messages are appended as the template renders a trailing turn)."""
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.codec = codec
        self.rewrite = rewrite
        # the episode's segments before the open one
        self.sealed = []
        self.last_finish = "stop"
        self._open(list(messages))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str, images: Sequence[bytes] = ()) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if images and self.codec is None:
            raise ValueError(
                "A message holds an image but the policy has no vision tower: "
                "use a vision-language model."
            )
        return self.codec.expand(ids, images) if images else ids

    @property
    def token_ids(self) -> np.ndarray:
        """The exact ids generation continues from (int32 [t])."""
        return np.asarray(self.open.token_ids, dtype=np.int32)

    def add_forced(self, token_ids: Sequence[int] | np.ndarray) -> None:
        """Start the next turn with ids the policy did not sample (mask 0, marked forced)."""
        self.open.extend(token_ids, versions=[FORCED_VERSION] * len(token_ids))

    def add_sampled(
        self,
        token_ids: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        versions: int | Sequence[int] | np.ndarray,
        message: dict,
        finish_reason: str,
        routed_experts: np.ndarray | None = None,
        stop_sequence: str | None = None,
        raw_logprobs: np.ndarray | None = None,
    ) -> None:
        """Append what the engine sampled, untouched, with each token's log-prob and weight version
        (`versions`: one int for the whole turn or int [n]) and, where the engine returns them, its
        log-probs before truncation. `message` is the assistant message decoded from it (text, tool
        calls), for the conversation only; `finish_reason` "stop" means the last id is the
        template's stop token."""
        if len(logprobs) != len(token_ids):
            raise ValueError(
                f"The engine returned {len(logprobs)} log-probs "
                f"for {len(token_ids)} sampled tokens."
            )
        start = len(self.open.token_ids)
        versions = np.broadcast_to(versions, len(token_ids))
        self.open.extend(token_ids, logprobs, versions, raw_logprobs)
        self.open.turn_spans.append((start, len(self.open.token_ids)))
        self.open.sampled_turns.append(np.array(token_ids, dtype=np.int64))
        # a sampled turn, and the stop string it was cut at: what its echo may carry
        self.stops[len(self.messages)] = stop_sequence
        # the rollout's experts for every position of this forward
        if routed_experts is not None:
            self.open.routes = routed_experts
        self.messages.append(message)
        self.last_finish = self.open.finish = finish_reason

    def continue_with(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """Take a client's whole conversation.

        `extend` when it continues this one (our messages are its prefix and the render stays a
        prefix), else `seal` and start a new segment from its full render."""
        known = len(self.messages)
        tools = tools or None
        if (
            tools == self.tools
            and len(messages) > known
            and all(map(self._echoes, range(known), messages[:known]))
        ):
            return "extend" if self.add_messages(messages[known:]) else "seal"
        self.seal("compaction" if tools == self.tools else "tools_changed")
        self.tools = tools
        self._open(list(messages))
        return "seal"

    def _echoes(self, index: int, echo: dict) -> bool:
        """Whether a client's `echo` of our message `index` says what it said: equal, or for a
        sampled turn its content plus the stop string it was cut at, or stripped of surrounding
        whitespace, with tool calls equal by name and arguments (a client may renumber them) and
        its reasoning, if the echo carries one, as sampled."""
        ours = self.messages[index]
        if echo == ours:
            return True
        if index not in self.stops or echo.get("role") != "assistant":
            return False
        content = ours.get("content") or ""
        said = {content, content + (self.stops[index] or ""), content.strip()}
        reasoning = echo.get("reasoning_content") or None
        return (
            (echo.get("content") or "") in said
            and _calls(echo) == _calls(ours)
            and reasoning in (None, ours.get("reasoning_content"))
        )

    def add_messages(self, new_messages: list[dict]) -> bool:
        """Extend the open segment with the rendered delta of `new_messages`.

        False if it had to seal."""
        previous = self.render(self.messages, generation_prompt=False)
        full = self.render(self.messages + new_messages, generation_prompt=True)
        if not full.startswith(previous):
            if self.rewrite == "seal":
                self.seal("template_rewrite")
                self._open(self.messages + new_messages)
                return False
            # bridge: the sampled ids stay; cut `full` where the first new message's content
            # begins, so the delta below is the trailing turn: the close after the last stop
            # token, then the new messages as the template renders them after the history
            previous = full[: self._content_start(new_messages, full)]
        # The template closes the assistant turn after its stop token (e.g. a newline); a turn that
        # ran out of tokens never sampled the stop token, so it is added here, untrainable.
        eos = self.tokenizer.eos_token
        end = previous.rfind(eos)
        tail = previous[end + len(eos) :] if self.last_finish == "stop" else previous[end:]
        images = message_images(new_messages)
        self.open.extend(self.encode(tail + full[len(previous) :], images))
        self.open.images += images
        self.messages.extend(new_messages)
        return True

    def _content_start(self, new_messages: list[dict], full: str) -> int:
        """Where the first new message's content begins in `full`, the render of the conversation
        and `new_messages`: the longest prefix `full` shares with both renders whose first new
        message says "a" or "b" instead (one of them differs at its first character).

        Limit: the template must render the old messages the same whatever that content says
        (Qwen3's keys on roles and positions, except a user message that is a `<tool_response>`),
        and no stop token may stand between the new message's start and its content."""
        starts = []
        for probe in ("a", "b"):
            probed = [dict(new_messages[0], content=probe), *new_messages[1:]]
            render = self.render(self.messages + probed, generation_prompt=True)
            starts.append(len(os.path.commonprefix([full, render])))
        return min(starts)

    def fork(self) -> TokenAccumulator:
        """A copy to try a turn on; the original is untouched until the copy replaces it."""
        # lists are copied; their items (ints, arrays, bytes, messages) are never mutated
        twin = copy.copy(self)
        twin.open = self.open.copy()
        twin.sealed = list(self.sealed)
        twin.messages = list(self.messages)
        twin.stops = dict(self.stops)
        return twin

    def seal(self, reason: str) -> None:
        self.open.seal_reason = reason
        self.sealed.append(self.open)

    def finish(self) -> list[SegmentTokens]:
        """Seal the open segment (reason `end`) and return every segment of the episode in order."""
        self.seal("end")
        return self.sealed

    def _open(self, messages: list[dict]) -> None:
        self.messages = messages
        # message index -> the stop string its sampled turn was cut at (None: none)
        self.stops = {}
        prompt = self.render(messages, generation_prompt=True)
        self.open = SegmentTokens(prompt_text=prompt, images=message_images(messages))
        self.open.extend(self.encode(prompt, self.open.images))
