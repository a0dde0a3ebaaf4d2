"""verifiers rewards scoring any Env's episodes: `agent.reward=verifiers:MODULE:Task`.

Not an agent plugin: `agent.reward` wraps the AgentRunner of whatever `agent.plugin` names. Task is
a verifiers 0.4.0 `vf.Task` subclass in MODULE (a module path, or a .py file's path, from the
current folder) whose `@vf.reward` functions score a transcript offline, e.g.

    class SumData(vf.TaskData):
        answer: int

    class SumTask(vf.Task[SumData]):
        @vf.reward(weight=1.0)
        async def correct(self, trace: vf.Trace) -> float:
            return float(trace.last_reply.strip() == str(self.data.answer))

The mapping, one episode:
- the task's data: the sample's columns that its TaskData subclass adds (`answer` above), and
  as `prompt` the sample's prompt, else the Env's first message;
- the transcript: the Env's system prompt and first message, each reply (an assistant message)
  and each observation (a user or tool message), as verifiers messages on one branch;
- the reward: after each turn the Task scores the transcript so far (its rewards' weighted sum,
  `trace.reward`); the turn's reward is how much that score rose since the turn before (the
  first turn's, from 0). An episode's reward is then the score of its whole transcript, wherever
  it ends (the Env's end or `agent.max_turns`), and `algo.advantage=turn` credits the turn that
  earned it. The Env's own reward is kept in the turn's info as `env_reward`, the Task's named
  scores as `verifiers`.

Offline: rewards that need no runtime (`runtime` without a default) score here; those that do,
and judges that call a model, are skipped by verifiers' own `score` (their names logged). The
`envs` extra's install note (docs/bring-your-env.md) says how verifiers is installed beside
molt-wb's SDKs.
"""

import asyncio
import dataclasses
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from workbench.api import Env, Result


def _vf() -> Any:
    """verifiers.v1; ValueError names how to install it."""
    try:
        import verifiers.v1 as vf
    except ModuleNotFoundError as error:
        raise ValueError(
            f"agent.reward=verifiers needs verifiers 0.4.0 ({error}): install it as "
            f"docs/bring-your-env.md says (pip install --no-deps verifiers==0.4.0 and its deps)."
        ) from None
    return vf


def _module(where: str) -> Any:
    """The module of a module path or a .py file's path (from the current folder)."""
    if where.endswith(".py"):
        path = Path(where).resolve()
        spec = importlib.util.spec_from_file_location(f"molt_wb_reward_{path.stem}", path)
        if spec is None or not path.exists():
            raise ValueError(f"agent.reward: the file {where} does not exist: fix the path.")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        # a module the reward's module imports is missing: that error is the one to show
        if error.name is None or not where.startswith(error.name):
            raise
        raise ValueError(
            f"agent.reward: no module {where} here: give a module importable from this folder "
            f"or a .py file's path."
        ) from None


def _task_class(target: str) -> type:
    """The verifiers Task class `MODULE:Class` names."""
    vf = _vf()
    where, colon, name = target.rpartition(":")
    task = getattr(_module(where), name, None) if colon else None
    if not (isinstance(task, type) and issubclass(task, vf.Task)):
        raise ValueError(
            f"agent.reward=verifiers:{target} names no verifiers Task class: give "
            f"verifiers:MODULE:Class, Class a vf.Task subclass with @vf.reward functions."
        )
    return task


def _text(content: Any) -> str:
    """A message's text (an Env's first message may be a list of content parts)."""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


def _score(task: Any, messages: list[Any]) -> tuple[float, dict[str, float]]:
    """The Task's weighted reward of a transcript, and its named scores."""
    from verifiers.v1.trace import AgentInfo, TraceTask

    vf = _vf()
    trace = vf.Trace(
        task=TraceTask(type=type(task).__name__, data=task.data),
        agent=AgentInfo(config=vf.AgentConfig()),
    )
    for index, message in enumerate(messages):
        parent = index - 1 if index else None
        sampled = message.role == "assistant"
        trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))
    asyncio.run(task.score(trace))
    named = {name: reward.value for name, reward in trace.rewards.items() if reward is not None}
    return trace.reward, named


def rewarded(runner: type, target: str) -> type:
    """`runner` (an Env class) with its rewards replaced by the verifiers Task's (module
    docstring)."""
    vf = _vf()
    task_class = _task_class(target)
    if not (isinstance(runner, type) and issubclass(runner, Env)):
        raise ValueError(
            f"agent.reward=verifiers:{target} scores an Env's episodes, and {runner.__name__} is "
            f"a ChatAgent: give its reward in its Result, or use an Env plugin."
        )
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

    def reset(self: Any, sample: dict[str, Any]) -> Any:
        first = runner.reset(self, sample)
        system = [SystemMessage(content=self.system_prompt)] if self.system_prompt else []
        self.verifiers_messages = [*system, UserMessage(content=_text(first))]
        data_type = task_class.data_type()
        # the Task's own columns: a sample's `id` is not verifiers' TaskData.id
        own = set(data_type.model_fields) - set(vf.TaskData.model_fields)
        data = {key: sample[key] for key in own if key in sample}
        data["prompt"] = sample.get("prompt", _text(first))
        self.verifiers_task = task_class(data_type(**data))
        self.verifiers_score = 0.0
        return first

    def step(self: Any, action: str) -> Result:
        result = runner.step(self, action)
        self.verifiers_messages.append(AssistantMessage(content=action))
        score, named = _score(self.verifiers_task, self.verifiers_messages)
        gained = score - self.verifiers_score
        self.verifiers_score = score
        if not (result.terminated or result.truncated):
            observation = result.observation or ""
            message = UserMessage(content=observation)
            if result.role == "tool":
                message = ToolMessage(tool_call_id="", content=observation)
            self.verifiers_messages.append(message)
        info = {**result.info, "env_reward": result.reward, "verifiers": named}
        return dataclasses.replace(result, reward=gained, info=info)

    return type(runner.__name__, (runner,), {"reset": reset, "step": step})
