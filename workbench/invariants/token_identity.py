"""Invariant: the token ids the policy sampled are the trajectory; nothing is decoded and re-encoded.

`TokenAccumulator` builds an episode's token sequence turn by turn. Sampled ids are appended as
they came out of the engine (mask 1, with their log-prob and version). A new message is added by
rendering the conversation with the chat template and tokenising only the *delta* the new message
adds (mask 0); when the old render is not a prefix of the new one (a template that rewrites
history, a compacted context) the open segment is sealed and a new one starts from a fresh render.
Decoded text exists for the environment and for display, never as trainer input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SegmentTokens:
    """Token-exact arrays of one segment, before it becomes a `Segment` record."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    behavior_logprob: list[float] = field(default_factory=list)
    behavior_version: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    seal_reason: str = ""
    prompt_text: str = ""

    def extend(self, ids, sampled: bool, logprobs=None, versions=None) -> None:
        self.token_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([int(sampled)] * len(ids))
        self.behavior_logprob.extend([float(x) for x in logprobs] if sampled else [0.0] * len(ids))
        self.behavior_version.extend([int(v) for v in versions] if sampled else [-1] * len(ids))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"token_ids": np.asarray(self.token_ids, dtype=np.int32),
                "loss_mask": np.asarray(self.loss_mask, dtype=np.uint8),
                "behavior_logprob": np.asarray(self.behavior_logprob, dtype=np.float32),
                "behavior_version": np.asarray(self.behavior_version, dtype=np.int32)}


class TokenAccumulator:
    def __init__(self, tokenizer, messages: list[dict]):
        self.tokenizer = tokenizer
        self.sealed: list[SegmentTokens] = []
        self.last_finish = "stop"
        self._open(list(messages))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def token_ids(self) -> np.ndarray:
        """The exact ids generation continues from (int32 [t])."""
        return np.asarray(self.open.token_ids, dtype=np.int32)

    def add_sampled(self, token_ids: np.ndarray, logprobs: np.ndarray, versions, text: str, finish_reason: str) -> None:
        """Append what the engine sampled, untouched, with each token's log-prob and weight version
        (`versions`: one int for the whole turn or int [n]); `text` is its decoding, for the conversation only."""
        start = len(self.open.token_ids)
        versions = np.broadcast_to(np.asarray(versions, dtype=np.int32), (len(token_ids),))
        self.open.extend(token_ids, sampled=True, logprobs=logprobs, versions=versions)
        self.open.turn_spans.append((start, len(self.open.token_ids)))
        self.messages.append({"role": "assistant", "content": text})
        self.last_finish = finish_reason

    def add_messages(self, new_messages: list[dict]) -> bool:
        """Extend the open segment with the rendered delta of `new_messages`; False if it had to seal."""
        previous = self.render(self.messages, generation_prompt=False)
        full = self.render(self.messages + new_messages, generation_prompt=True)
        if not full.startswith(previous):
            self.seal("template_rewrite")
            self._open(self.messages + new_messages)
            return False
        # The template closes the assistant turn after its stop token (e.g. a newline); a turn that ran
        # out of tokens never sampled the stop token, so it is added here, untrainable.
        eos = self.tokenizer.eos_token
        end = previous.rfind(eos)
        tail = previous[end + len(eos):] if self.last_finish == "stop" else previous[end:]
        self.open.extend(self.encode(tail + full[len(previous):]), sampled=False)
        self.messages.extend(new_messages)
        return True

    def seal(self, reason: str) -> None:
        self.open.seal_reason = reason
        self.sealed.append(self.open)

    def finish(self) -> list[SegmentTokens]:
        """Seal the open segment (reason `end`) and return every segment of the episode in order."""
        self.seal("end")
        return self.sealed

    def _open(self, messages: list[dict]) -> None:
        self.messages = messages
        prompt = self.render(messages, generation_prompt=True)
        self.open = SegmentTokens(prompt_text=prompt)
        self.open.extend(self.encode(prompt), sampled=False)
