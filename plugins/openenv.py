"""OpenEnv environments as multi-turn Envs: `agent.plugin=openenv:TARGET`.

TARGET is either
- the URL of an OpenEnv server (`openenv:http://127.0.0.1:8000`): each episode opens a session of
  its own on it (openenv's GenericEnvClient, over a WebSocket), closed when the episode ends or
  is dropped. Serve an environment with `python -m uvicorn NAME.server.app:app --host 127.0.0.1
  --port 8000`, its app's `max_concurrent_envs` at least the episodes a rollout worker runs at
  once (`trainer.prompts_per_step` x `trainer.group_size`);
- a module path, `:Class` optional (`openenv:echo_env.server.echo_env_environment`): its OpenEnv
  `Environment` class runs in this process, one instance per episode; the module is imported
  from the installed packages, else from the current folder.
The `envs` extra installs openenv 0.10.0 (`openenv init NAME` writes a working environment).

The mapping, one episode:
- `reset(sample)` resets the environment on the sample's seed (`reset(seed=...)`); the first user
  message is its observation, rendered by `render`;
- `step(reply)` parses the reply into the environment's Action with `action` and steps it; the
  observation's `reward` is the turn's reward (none: 0), its `done` ends the episode, and
  otherwise `render(observation)` is the next user message. Episodes run until `done` or
  `agent.max_turns`.
- `action(reply) -> dict`: a JSON object in the reply whose keys are Action fields is the Action;
  otherwise, when the Action has exactly one text field, the reply (stripped) is that field.
- `render(observation) -> str`: the observation's fields but `done`, `reward` and `metadata`; a
  lone text field as its text, several as JSON.
Override either in a few lines (docs/bring-your-env.md shows how). An Action the environment
refuses, or an error it raises, fails that episode with the environment's message.

Seeds: the training samples are seeds `seed .. seed + size - 1` of the run's seed (the held-out
split's from `seed + EVAL_OFFSET`); an environment that seeds its randomness from `reset(seed)`,
as `openenv init`'s template asks, replays a resumed run's episodes.

Offline: nothing ships an environment; `openenv init` writes one, and a server on this machine
serves it. `from_docker_image` and `from_env` (Docker, the Hugging Face hub) are not used.
"""

import functools
import importlib
import inspect
import json
import os
import re
import sys
import typing
import urllib.request
import weakref
from typing import Any

from workbench.api import Env, Result

# the held-out split's first seed, past any training set's seeds
EVAL_OFFSET = 1_000_000
# observation fields that are not the observation's content
CONTROL_FIELDS = ("done", "reward", "metadata")
JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def _openenv() -> Any:
    """The openenv package; ValueError names the extra that installs it."""
    try:
        import openenv
    except ModuleNotFoundError:
        raise ValueError(
            "agent.plugin=openenv needs the envs extra: pip install -e '.[envs]'."
        ) from None
    return openenv


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _server_schema(url: str) -> dict[str, Any]:
    """The JSON schema of a server's Action (its GET /schema); ValueError when none answers."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/schema", timeout=10) as reply:
            return json.load(reply)["action"]
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(
            f"No OpenEnv server answers at {url} ({error}): start one, e.g. `python -m uvicorn "
            f"NAME.server.app:app --host 127.0.0.1 --port 8000`, and give its URL."
        ) from None


def _environment_class(target: str) -> tuple[type, type]:
    """The Environment class and its Action class of `module[:Class]`."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action

    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        # as for agent.plugin: a module in the current folder
        sys.path.append(os.getcwd())
        module = importlib.import_module(module_name)
    classes = [
        value
        for name, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, Environment)
        and value.__module__ == module.__name__
        and name == (class_name or name)
    ]
    if len(classes) != 1:
        raise ValueError(
            f"openenv:{target}: module {module_name} defines {len(classes)} OpenEnv Environment "
            f"classes{f' named {class_name}' if class_name else ''}: name one as "
            f"openenv:{module_name}:Class."
        )
    action = typing.get_type_hints(classes[0].step).get("action")
    if not (isinstance(action, type) and issubclass(action, Action)):
        raise ValueError(
            f"openenv:{target}: {classes[0].__name__}.step does not annotate its Action class: "
            f"write `def step(self, action: MyAction)`."
        )
    return classes[0], action


class OpenEnvEnv(Env):
    """One episode of an OpenEnv environment; a subclass per target binds `target`, `schema`
    (the Action's JSON schema) and, in process, `environment` and `action_class`."""

    target: str = ""
    schema: dict[str, Any] = {}
    environment: type | None = None
    action_class: type | None = None

    def action(self, reply: str) -> dict[str, Any]:
        """The Action's fields for the policy's reply (override to map replies your way)."""
        fields = [name for name in self.schema.get("properties", {}) if name != "metadata"]
        found = JSON_OBJECT.search(reply)
        if found:
            try:
                parsed = json.loads(found.group())
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and parsed and set(parsed) <= set(fields):
                return parsed
        properties = self.schema.get("properties", {})
        text_fields = [name for name in fields if properties[name].get("type") == "string"]
        if len(text_fields) == 1:
            return {text_fields[0]: reply.strip()}
        raise ValueError(
            f"The reply is no JSON object of the Action's fields {fields}, and the Action has "
            f"{len(text_fields)} text fields: override action(reply) to map replies to it."
        )

    def render(self, observation: dict[str, Any]) -> str:
        """The user message of an observation (override to show it your way)."""
        content = {key: value for key, value in observation.items() if key not in CONTROL_FIELDS}
        if len(content) == 1 and isinstance(next(iter(content.values())), str):
            return next(iter(content.values()))
        return json.dumps(content, default=str)

    def reset(self, sample: dict[str, Any]) -> str:
        seed = int(sample["seed"])
        if self.environment is None:
            from openenv.core.generic_client import GenericEnvClient

            self.client = GenericEnvClient(base_url=self.target).sync()
            # a session cut by the turn budget closes when its Env is dropped
            weakref.finalize(self, self.client.close)
            observation, _, _ = self._outcome(self.client.reset(seed=seed))
        else:
            self.local = self.environment()
            accepts = inspect.signature(self.local.reset).parameters
            kwargs = {"seed": seed} if "seed" in accepts or "kwargs" in accepts else {}
            observation, _, _ = self._outcome(self.local.reset(**kwargs))
        return self.render(observation)

    def step(self, action: str) -> Result:
        fields = self.action(action)
        if self.environment is None:
            observation, reward, done = self._outcome(self.client.step(fields))
        else:
            observation, reward, done = self._outcome(self.local.step(self.action_class(**fields)))
        if done:
            self.close()
            return Result(reward=reward, info={"observation": observation})
        return Result(reward=reward, observation=self.render(observation), terminated=False)

    def close(self) -> None:
        """End the episode's session (a server's) or environment (in process)."""
        if self.environment is None:
            self.client.close()
        else:
            self.local.close()

    @staticmethod
    def _outcome(result: Any) -> tuple[dict[str, Any], float, bool]:
        """(observation fields, reward, done) of a client's StepResult or an Observation."""
        if hasattr(result, "model_dump"):
            observation = result.model_dump()
            reward = observation.get("reward")
            done = observation.get("done", False)
        else:
            observation = dict(result.observation)
            reward = result.reward
            done = result.done
        return observation, float(reward or 0.0), bool(done)

    @classmethod
    def make_dataset(cls, size: int, seed: int) -> list[dict[str, Any]]:
        """`size` episodes: the seeds `seed .. seed + size - 1`."""
        return [{"id": index, "seed": seed + index} for index in range(size)]

    @classmethod
    def eval_dataset(cls, size: int, seed: int) -> list[dict[str, Any]]:
        """`size` held-out episodes, at seeds from `seed + EVAL_OFFSET` (none a training seed)."""
        return cls.make_dataset(size, seed + EVAL_OFFSET)


@functools.cache
def __getattr__(target: str) -> type[OpenEnvEnv]:
    """`openenv:TARGET`: the Env class of the server at a URL, or of the Environment class of a
    module; the server is asked for its Action's schema here, so a missing one is refused at
    start-up."""
    # a Python name is an attribute asked for, not a target (a URL or a dotted module path)
    if target.isidentifier():
        raise AttributeError(target)
    _openenv()
    attributes: dict[str, Any] = {"target": target}
    if _is_url(target):
        attributes["schema"] = _server_schema(target)
    else:
        environment, action_class = _environment_class(target)
        attributes["environment"] = environment
        attributes["action_class"] = action_class
        attributes["schema"] = action_class.model_json_schema()
    return type(f"OpenEnv[{target}]", (OpenEnvEnv,), attributes)
