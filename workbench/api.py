"""The agent contract: the only module a plugin imports.

A plugin (a shipped `plugins/NAME.py`, a name registered in the `molt_wb.plugins` entry-point
group, a dotted module or a file path: workbench/locate.py) exports `AgentRunner`, either

- an `Env`: the framework owns the LLM loop, calling `reset(sample)` for the first observation and
  then `step(action)` with each decoded reply until the episode terminates or the turn budget runs
  out; or
- a `ChatAgent`: the plugin owns the loop. `run(ctx)` (plain or `async def`) gets a `ChatContext`
  with a per-episode base URL and key for the stock `openai` or `anthropic` SDK and returns a
  `Result`; the loopback server behind that URL records every sampled token.

Optionally it exports `make_dataset(size, seed) -> list[dict]` (synthetic samples, used when no
`data.path` is given) and `warm_start(sample, rng) -> str` (a completion to fine-tune on before
RL when a tiny random model would otherwise never earn a reward, or a list of turns); a ChatAgent
plugin names the Env plugin whose demonstrations it shares as `WARM_START_AS`.
"""

from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.locate import PLUGIN_PACKAGE, load_plugin, shipped_folder

# Tools and graders for plugins, re-exported so that plugins import only this module.
from workbench.tools.grading import extract_answer, format_ok, geo3k_reward, grade, is_equivalent
from workbench.tools.sandbox import SandboxResult, run_python, use_isolation

__all__ = [
    "PLUGIN_DIR",
    "ChatAgent",
    "ChatContext",
    "Env",
    "Result",
    "SandboxResult",
    "extract_answer",
    "format_ok",
    "geo3k_reward",
    "grade",
    "is_equivalent",
    "load_plugin",
    "run_python",
    "use_isolation",
]

# the shipped plugins: the repository's plugins/, installed as the package workbench.plugins
PLUGIN_DIR: Path = shipped_folder(PLUGIN_PACKAGE)


@dataclass
class Result:
    """What `Env.step` returns, aligned with Gymnasium's step tuple."""

    reward: float = 0.0
    # the next turn, when not terminated
    observation: str | None = None
    # who speaks `observation`: user, or tool (a tool's output, rendered as a tool response)
    role: str = "user"
    terminated: bool = True
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    # a ChatAgent's reward of each of its policy calls, in order (None: `reward` at the last); an
    # Env's turn rewards are its steps' `reward`, and its episode's reward is their sum
    turn_rewards: list[float] | None = None


class Env:
    """One episode of an environment the framework drives turn by turn."""

    system_prompt: str | None = None
    # OpenAI-style tool schemas the chat template lists for the policy
    tools: list[dict[str, Any]] | None = None

    def reset(self, sample: dict[str, Any]) -> str | list[dict[str, Any]]:
        """Start an episode on `sample`; return the first user message.

        The message is its text, or a list of content parts `{"type": "text", "text": ...}` and
        `{"type": "image", "image": <PNG/JPEG bytes>}` (vision-language).
        """
        raise NotImplementedError

    def step(self, action: str) -> Result:
        """Take the policy's reply; return its reward and, unless terminated, the next turn."""
        raise NotImplementedError


@dataclass
class ChatContext:
    """What a ChatAgent gets for one episode."""

    # OpenAI SDK: OpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
    base_url: str
    # Anthropic SDK: Anthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key)
    anthropic_base_url: str
    api_key: str
    model: str
    # the sample's "prompt" (or "problem") field
    prompt: str
    # the sample's "answer" field, for the reward
    label: object
    sample: dict[str, Any]
    max_tokens: int
    temperature: float
    # LLM-as-judge: {"base_url", "api_key"} of a session on the same engine that is never trained
    judge: dict[str, str] | None = None


class ChatAgent:
    """One episode of an agent program that talks to the policy through an SDK."""

    def run(self, ctx: ChatContext) -> Result | Awaitable[Result]:
        """Run one episode against `ctx`'s endpoint (plain or `async def`); return its `Result`."""
        raise NotImplementedError
