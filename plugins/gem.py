"""GEM's Gymnasium-style environments as multi-turn Envs: `agent.plugin=gem:ENV_ID`.

ENV_ID is an id gem-llm registers: `game:GuessTheNumber-v0-easy`, `game:Sudoku-v0-easy`,
`game:Mastermind-v0-easy`, ... (text games) or `rg:TASK` (reasoning-gym tasks, answered in
`\\boxed{}`); gem-llm 0.1.0 is installed beside the `envs` extra (see docs/bring-your-env.md).
`agent.env_kwargs` are the environment's own settings, refused at start-up when it does not take
them.

The mapping is Gymnasium's, one call for one call:
- `reset(sample)` is gem's `reset(seed)` on the sample's seed; the first user message is its
  observation;
- `step(reply)` is gem's `step(reply) -> (observation, reward, terminated, truncated, info)`:
  the step's reward is the turn's reward (gem gives one every step: a format error, a repeated
  guess, a win), `terminated` and `truncated` end the episode, and otherwise the observation is
  the next user message.
gem's own observation wrappers append `info["suffix"]` (the board, "Enter your next guess.") to
an observation; so does this adapter. Train with `algo.advantage=turn` to credit each turn with
its own reward: docs/environments.md, "Rewards per turn".

Seeds: the training samples are seeds `seed .. seed + size - 1` of the run's seed (the held-out
split's from `seed + EVAL_OFFSET`); gem's reset seeds Python's, NumPy's and its own generators.

Offline: the `game:*` games (not the word games: Wordle, Hangman, Crosswords, WordSearch need
nltk data) and `rg:*` run; `math:*`, `code:*`, `qa:*`, `logic:*` and `eval:*` load data sets
from the Hugging Face hub, and the search tools a server: they fail here.
"""

import functools
import importlib
import inspect
import random
import re
from typing import Any

from workbench.api import Env, Result

# the held-out split's first seed, past any training set's seeds
EVAL_OFFSET = 1_000_000
# `agent.plugin=gem` without an id
DEFAULT_ID = "game:GuessTheNumber-v0-easy"


def _gem() -> Any:
    """The gem package; ValueError names how to install it."""
    try:
        import gem
    except ModuleNotFoundError:
        raise ValueError(
            "agent.plugin=gem needs gem-llm beside the envs extra: pip install -e '.[envs]' && "
            "pip install --no-deps gem-llm==0.1.0 (docs/bring-your-env.md says why --no-deps)."
        ) from None
    return gem


def _settings_signature(env_id: str) -> inspect.Signature:
    """The keyword settings of `env_id`'s environment class (what agent.env_kwargs may set)."""
    from gem.envs.registration import ENV_REGISTRY

    entry_point = ENV_REGISTRY[env_id].entry_point
    if isinstance(entry_point, str):
        module, _, name = entry_point.partition(":")
        entry_point = getattr(importlib.import_module(module), name)
    parameters = list(inspect.signature(entry_point).parameters.values())
    return inspect.Signature([p.replace(kind=p.KEYWORD_ONLY) for p in parameters])


def _message(observation: Any, info: dict[str, Any]) -> str:
    """A gem observation as the user's message, with the suffix gem's wrappers append."""
    suffix = info.get("suffix")
    if not suffix:
        return str(observation)
    return f"{observation}\n{suffix}"


def _gist(error: Exception) -> str:
    """The first line of an error's message that says something (nltk's opens with a rule of
    asterisks), without terminal colours."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    return next((line.strip() for line in lines if any(c.isalpha() for c in line)), "")


class GemEnv(Env):
    """One episode of a gem environment; a subclass per id binds `env_id`."""

    env_id: str = DEFAULT_ID

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def reset(self, sample: dict[str, Any]) -> str:
        self.gem_env = _gem().make(self.env_id, **self.settings)
        observation, info = self.gem_env.reset(seed=int(sample["seed"]))
        return _message(observation, info or {})

    def step(self, action: str) -> Result:
        observation, reward, terminated, truncated, info = self.gem_env.step(action)
        info = dict(info or {})
        return Result(
            reward=float(reward),
            observation=_message(observation, info),
            terminated=bool(terminated),
            truncated=bool(truncated),
            info={key: value for key, value in info.items() if key != "suffix"},
        )

    @classmethod
    def make_dataset(cls, size: int, seed: int, **settings: Any) -> list[dict[str, Any]]:
        """`size` episodes: the seeds `seed .. seed + size - 1`, each with the environment's
        settings (what the warm start's teacher plays)."""
        return [{"id": index, "seed": seed + index, "settings": settings} for index in range(size)]

    @classmethod
    def eval_dataset(cls, size: int, seed: int, **settings: Any) -> list[dict[str, Any]]:
        """`size` held-out episodes, at seeds from `seed + EVAL_OFFSET` (none a training seed)."""
        return cls.make_dataset(size, seed + EVAL_OFFSET)


def _guess_the_number_teacher(
    cls: type[GemEnv], sample: dict[str, Any], rng: random.Random
) -> list[dict[str, str]]:
    """One game of a noisy teacher, as the turns after the opening (`model.warm_start_steps`),
    played on the real environment: one move in ten without a boxed number (gem ends the game
    with its format penalty), otherwise half the time the middle of the numbers the hints leave
    and half the time any number of the range."""
    env = cls(**sample.get("settings", {}))
    env.reset(sample)
    game = env.gem_env
    interval = [game.min_number, game.max_number]
    turns = []
    for _ in range(game.max_turns):
        draw = rng.random()
        guess = rng.randint(game.min_number, game.max_number)
        if draw < 0.55:
            guess = (interval[0] + interval[1]) // 2
        if guess < game.game_number:
            interval[0] = max(interval[0], guess + 1)
        elif guess > game.game_number:
            interval[1] = min(interval[1], guess - 1)
        move = "?" if draw >= 0.9 else f"\\boxed{{{guess}}}"
        turns.append({"role": "assistant", "content": move})
        result = env.step(move)
        if result.terminated or result.truncated:
            return turns
        turns.append({"role": "user", "content": result.observation})
    # the demonstration ends on the teacher's move
    return turns[:-1]


# the environments with a warm-start teacher
TEACHERS = {DEFAULT_ID: _guess_the_number_teacher}


@functools.cache
def __getattr__(env_id: str) -> type[GemEnv]:
    """`gem:ENV_ID`: the Env class of gem's environment ENV_ID, reset once here so that one this
    machine cannot run is refused at start-up."""
    # a Python name is an attribute asked for, not an id (gem's ids hold a colon)
    if env_id.isidentifier():
        raise AttributeError(env_id)
    gem = _gem()
    from gem.envs.registration import ENV_REGISTRY

    if env_id not in ENV_REGISTRY:
        raise ValueError(
            f"gem has no environment {env_id!r}: give a registered id such as {DEFAULT_ID} "
            f"(`python -c 'import gem.envs.registration as r; print(list(r.ENV_REGISTRY))'`)."
        )
    try:
        gem.make(env_id).reset(seed=0)
    except Exception as error:
        raise ValueError(
            f"gem's {env_id} does not start here ({type(error).__name__}: {_gist(error)}); "
            f"math:*, code:*, qa:* and eval:* load data sets from the hub, and the word games "
            f"nltk data: choose another game:* id or an rg:* one."
        ) from None
    attributes = {"env_id": env_id, "__signature__": _settings_signature(env_id)}
    if env_id in TEACHERS:
        attributes["warm_start"] = classmethod(TEACHERS[env_id])
    return type(f"Gem[{env_id}]", (GemEnv,), attributes)


class GuessTheNumber(GemEnv):
    """`agent.plugin=gem` without an id: game:GuessTheNumber-v0-easy."""

    env_id = DEFAULT_ID
    warm_start = classmethod(_guess_the_number_teacher)


AgentRunner = GuessTheNumber
make_dataset = GuessTheNumber.make_dataset
eval_dataset = GuessTheNumber.eval_dataset
warm_start = GuessTheNumber.warm_start
