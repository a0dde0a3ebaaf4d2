"""reasoning-gym's procedurally generated tasks as Envs: `agent.plugin=reasoning_gym:TASK`.

TASK is any name reasoning-gym registers (`chain_sum`, `gcd`, `letter_counting`, ...; the
`envs` extra installs it: `pip install -e '.[envs]'`). `agent.env_kwargs` are the task's own
config keys (`+agent.env_kwargs.max_terms=2`); they reach the episodes, the training data and the
held-out split alike.

The data: training samples are the task's items at seeds `seed .. seed + size - 1` (reasoning-gym
draws item i from `Random(seed + i)`), the held-out split's at seeds from `seed + EVAL_OFFSET`,
so the two never share a seed (a small task can still draw the same question twice).

The reward is 1 when the reply's answer gets reasoning-gym's full score (`score_answer` = 1) and 0
otherwise. The answer is the last `<answer>…</answer>` of the reply when it has one, else its last
number when the task's answer is a number, else its last line. reasoning-gym's partial credit (a
reply that merely contains the answer scores the answer's share of its length, e.g. 0.3) is not
used: it pays a reply that lists several candidates, which RL learns to exploit, and a binary
reward makes the mean reward the accuracy (`eval.threshold=1`).
"""

import functools
import re
from typing import Any

from workbench.api import Env, Result

# the held-out split's first seed, past any training set's seeds
EVAL_OFFSET = 1_000_000
# what the policy is asked to reply, after the task's own question
NUMBER_ASK = "Answer with just the number."
TEXT_ASK = "Answer with just the answer."
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
TAGGED = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def _is_number(text: str) -> bool:
    """Whether a task's answer is a plain number (then the reply's last number is its answer)."""
    return NUMBER.fullmatch(text.strip()) is not None


@functools.lru_cache(maxsize=64)
def _scorer(task: str, config: tuple[tuple[str, Any], ...]) -> Any:
    """A one-item dataset of `task` with `config`, for its `score_answer` (built once)."""
    return _dataset(task, 1, 0, dict(config))


def _dataset(task: str, size: int, seed: int, config: dict[str, Any]) -> Any:
    """reasoning-gym's dataset of `task`; ValueError names a missing package or a bad config."""
    try:
        import reasoning_gym
    except ModuleNotFoundError:
        raise ValueError(
            "agent.plugin=reasoning_gym needs the envs extra: pip install -e '.[envs]'."
        ) from None
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except (TypeError, AssertionError, ValueError) as error:
        raise ValueError(
            f"reasoning-gym's {task} refused agent.env_kwargs {config} ({error or 'invalid'}): "
            f"give keys and values of its config class."
        ) from None


def extract(reply: str, oracle: str) -> str:
    """The answer a reply gives: its last tagged answer, else its last number (for a numeric
    task), else its last non-empty line."""
    tagged = TAGGED.findall(reply)
    if tagged:
        return tagged[-1]
    if _is_number(oracle):
        numbers = NUMBER.findall(reply)
        return numbers[-1] if numbers else ""
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    return lines[-1].rstrip(".") if lines else ""


def to_sample(entry: dict[str, Any]) -> dict[str, Any]:
    """One reasoning-gym item as a sample row: the question asked with its reply format."""
    ask = NUMBER_ASK if _is_number(entry["answer"]) else TEXT_ASK
    return {
        "problem": f"{entry['question']}\n{ask}",
        "answer": entry["answer"],
        "metadata": entry["metadata"],
    }


class ReasoningGymEnv(Env):
    """One single-turn episode of a reasoning-gym task; a subclass per task binds `task`."""

    task: str = ""

    def __init__(self, **config: Any) -> None:
        self.config = config

    def reset(self, sample: dict[str, Any]) -> str:
        self.sample = sample
        return sample["problem"]

    def step(self, action: str) -> Result:
        answer = extract(action, self.sample["answer"])
        scorer = _scorer(self.task, tuple(sorted(self.config.items())))
        entry = {"answer": self.sample["answer"], "metadata": self.sample["metadata"]}
        score = scorer.score_answer(answer, entry)
        # full credit only (module docstring)
        return Result(
            reward=float(score >= 1.0),
            info={"pred": answer, "answer": self.sample["answer"], "score": score},
        )

    @classmethod
    def make_dataset(cls, size: int, seed: int, **config: Any) -> list[dict[str, Any]]:
        """`size` training samples of the task, at seeds `seed ..`."""
        return [to_sample(entry) for entry in _dataset(cls.task, size, seed, config)]

    @classmethod
    def eval_dataset(cls, size: int, seed: int, **config: Any) -> list[dict[str, Any]]:
        """`size` held-out samples, at seeds from `seed + EVAL_OFFSET` (none a training seed)."""
        return cls.make_dataset(size, seed + EVAL_OFFSET, **config)


@functools.cache
def __getattr__(task: str) -> type[ReasoningGymEnv]:
    """`reasoning_gym:TASK`: the Env class of reasoning-gym's task TASK."""
    if task.startswith("__"):
        raise AttributeError(task)
    try:
        import reasoning_gym.factory
    except ModuleNotFoundError:
        reasoning_gym = None
    # without the package the class is made all the same: its data names the missing extra
    if reasoning_gym is not None and task not in reasoning_gym.factory.DATASETS:
        raise AttributeError(task)
    # named for the task: pickle finds it again through this function
    return type(task, (ReasoningGymEnv,), {"task": task})


class ChainSum(ReasoningGymEnv):
    """`agent.plugin=reasoning_gym` without a task: chain_sum."""

    task = "chain_sum"


AgentRunner = ChainSum
make_dataset = ChainSum.make_dataset
eval_dataset = ChainSum.eval_dataset
