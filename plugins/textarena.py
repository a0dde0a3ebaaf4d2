"""textarena's single-player text games as multi-turn Envs: `agent.plugin=textarena:GAME`.

GAME is a game id textarena registers (`GuessTheNumber-v0`, `TowerOfHanoi-v0`, `Mastermind-v0`,
`FrozenLake-v0`, ...; the `envs` extra installs textarena 0.7.4). `agent.env_kwargs` are the
game's own settings (`+agent.env_kwargs.max_turns=4`), refused at start-up when the game does not
take them. `agent.max_turns` is molt-wb's turn budget: set it to at least the game's own.

The mapping, one episode:
- `reset(sample)` makes the game, resets it for one player on the sample's seed and returns the
  game's first observation;
- `step(reply)` passes the reply to the game as the move; while the game goes on, the next user
  message is what the game added to its transcript since the last turn (textarena's observation
  is the whole transcript: only the new part is sent, since the chat history holds the rest);
- the reward: textarena's single-player games set the player's reward when the game ends
  (`close()`), so the last turn carries it and the turns before it 0; an episode the turn budget
  cuts before the game ends earns 0.

Seeds: the training samples are seeds `seed .. seed + size - 1` of the run's seed (the held-out
split's from `seed + EVAL_OFFSET`), and each episode's game is reset on its sample's seed, so a
resumed run replays the same games. textarena draws from Python's global `random`, seeded by its
reset; a game's moves draw nothing in the offline games.

Offline: the word games (Wordle, Hangman, Codenames, SpellingBee, ...) call `nltk.download` on
import and fail without a network; a game textarena cannot make is refused at start-up with its
error. Games of two or more players are refused: one policy plays one seat here.
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
# `agent.plugin=textarena` without a game
DEFAULT_GAME = "GuessTheNumber-v0"
# the most moves of a warm-start teacher's game
TEACHER_TURNS = 8


def _textarena() -> Any:
    """The textarena package; ValueError names the extra that installs it."""
    try:
        import textarena
    except ModuleNotFoundError:
        raise ValueError(
            "agent.plugin=textarena needs the envs extra: pip install -e '.[envs]'."
        ) from None
    return textarena


def _settings_signature(game: str) -> inspect.Signature:
    """The keyword settings of `game`'s environment class (what agent.env_kwargs may set)."""
    from textarena.envs.registration import ENV_REGISTRY

    entry_point = ENV_REGISTRY[game].entry_point
    if isinstance(entry_point, str):
        module, _, name = entry_point.partition(":")
        entry_point = getattr(importlib.import_module(module), name)
    parameters = list(inspect.signature(entry_point).parameters.values())
    return inspect.Signature([p.replace(kind=p.KEYWORD_ONLY) for p in parameters])


def _as_text(observation: Any) -> str:
    """A textarena observation as text: a wrapped game's is its transcript already; a `-raw`
    game's is a list of (sender, message, kind)."""
    if isinstance(observation, str):
        return observation
    return "\n".join(str(message) for _, message, *_ in observation)


def _gist(error: Exception) -> str:
    """The first line of an error's message that says something (nltk's opens with a rule of
    asterisks), without terminal colours."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()
    return next((line.strip() for line in lines if any(c.isalpha() for c in line)), "")


class TextArenaEnv(Env):
    """One single-player textarena game; a subclass per game binds `game`."""

    game: str = DEFAULT_GAME

    def __init__(self, **settings: Any) -> None:
        self.settings = settings

    def reset(self, sample: dict[str, Any]) -> str:
        self.arena = _textarena().make(self.game, **self.settings)
        self.arena.reset(num_players=1, seed=int(sample["seed"]))
        # the transcript the policy has seen so far
        self.seen = ""
        return self._news()

    def _news(self) -> str:
        """What the game's transcript gained since the last call."""
        _, observation = self.arena.get_observation()
        transcript = _as_text(observation)
        news = transcript
        if transcript.startswith(self.seen):
            news = transcript[len(self.seen) :]
        self.seen = transcript
        return news.strip()

    def step(self, action: str) -> Result:
        done, info = self.arena.step(action)
        if not done:
            return Result(observation=self._news(), terminated=False, info=dict(info or {}))
        rewards, game_info = self.arena.close()
        # the single player's reward, set when the game ended
        reward = float((rewards or {}).get(0, 0.0))
        return Result(reward=reward, info={"game": self.game, **(game_info or {}).get(0, {})})

    @classmethod
    def make_dataset(cls, size: int, seed: int, **settings: Any) -> list[dict[str, Any]]:
        """`size` games: the seeds `seed .. seed + size - 1`, each with the game's settings (what
        the warm start's teacher plays)."""
        return [{"id": index, "seed": seed + index, "settings": settings} for index in range(size)]

    @classmethod
    def eval_dataset(cls, size: int, seed: int, **settings: Any) -> list[dict[str, Any]]:
        """`size` held-out games, at seeds from `seed + EVAL_OFFSET` (none a training seed)."""
        return cls.make_dataset(size, seed + EVAL_OFFSET)


def _guess_the_number_move(env: TextArenaEnv, rng: random.Random, interval: list[int]) -> str:
    """A noisy teacher's move: half the time no number (an invalid move, which costs a turn),
    otherwise half the time the middle of the numbers the hints leave (`interval`, narrowed here
    by the guess's hint) and half the time any number of the range."""
    game = env.arena
    # the game under textarena's wrappers
    while hasattr(game, "env"):
        game = game.env
    draw = rng.random()
    if draw < 0.5:
        return "?"
    guess = rng.randint(game.min_number, game.max_number)
    if draw < 0.75:
        guess = (interval[0] + interval[1]) // 2
    # what the hint will say
    if guess < game.game_number:
        interval[0] = max(interval[0], guess + 1)
    elif guess > game.game_number:
        interval[1] = min(interval[1], guess - 1)
    return f"[{guess}]"


def _guess_the_number_teacher(
    cls: type[TextArenaEnv], sample: dict[str, Any], rng: random.Random
) -> list[dict[str, str]]:
    """One game of the noisy teacher, as the turns after the opening (`model.warm_start_steps`):
    played on the real game, so every feedback message is the game's own."""
    env = cls(**sample.get("settings", {}))
    env.reset(sample)
    game = env.arena
    while hasattr(game, "env"):
        game = game.env
    interval = [game.min_number, game.max_number]
    turns = []
    for _ in range(TEACHER_TURNS):
        move = _guess_the_number_move(env, rng, interval)
        turns.append({"role": "assistant", "content": move})
        result = env.step(move)
        if result.terminated:
            return turns
        turns.append({"role": "user", "content": result.observation})
    # the demonstration ends on the teacher's move
    return turns[:-1]


# the games with a warm-start teacher
TEACHERS = {"GuessTheNumber-v0": _guess_the_number_teacher}


@functools.cache
def __getattr__(game: str) -> type[TextArenaEnv]:
    """`textarena:GAME`: the Env class of textarena's single-player game GAME, tried once here so
    that a game this machine cannot play is refused at start-up."""
    # a Python name is an attribute asked for, not a game id (textarena's ids hold a dash)
    if game.isidentifier():
        raise AttributeError(game)
    textarena = _textarena()
    from textarena.envs.registration import ENV_REGISTRY

    if game not in ENV_REGISTRY:
        raise ValueError(
            f"textarena has no game {game!r}: give a registered id such as {DEFAULT_GAME} "
            f"(`python -c 'import textarena.envs.registration as r; print(list(r.ENV_REGISTRY))'`)."
        )
    try:
        textarena.make(game).reset(num_players=1, seed=0)
    except AssertionError:
        raise ValueError(
            f"textarena's {game} is a game of several players: agent.plugin=textarena plays "
            f"single-player games (GuessTheNumber-v0, TowerOfHanoi-v0, Mastermind-v0, ...)."
        ) from None
    except Exception as error:
        raise ValueError(
            f"textarena's {game} does not start here ({type(error).__name__}: {_gist(error)}); "
            f"the word games download nltk data and fail offline: choose another game."
        ) from None
    attributes = {"game": game, "__signature__": _settings_signature(game)}
    if game in TEACHERS:
        attributes["warm_start"] = classmethod(TEACHERS[game])
    return type(f"TextArena[{game}]", (TextArenaEnv,), attributes)


class GuessTheNumber(TextArenaEnv):
    """`agent.plugin=textarena` without a game: GuessTheNumber-v0."""

    game = DEFAULT_GAME
    warm_start = classmethod(_guess_the_number_teacher)


AgentRunner = GuessTheNumber
make_dataset = GuessTheNumber.make_dataset
eval_dataset = GuessTheNumber.eval_dataset
warm_start = GuessTheNumber.warm_start
