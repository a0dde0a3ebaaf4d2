"""Single-digit addition: "What is 3 + 5?" -> "8". Reward 1 when the first number replied is right.

The warm start fine-tunes the tiny random model on a noisy teacher, right 40% of the time and
otherwise off by one or two, so the policy starts near 40% (sampled) and RL has to find which of
its answers earn the reward.
"""

import random
import re

from workbench.api import Env, Result

# operands 0..4: a small table of facts, so each is revisited often within a run
OPERANDS = 5


class ArithEnv(Env):
    def reset(self, sample: dict) -> str:
        self.answer = int(sample["answer"])
        return sample["problem"]

    def step(self, action: str) -> Result:
        match = re.search(r"-?\d+", action)
        correct = match is not None and int(match.group()) == self.answer
        return Result(
            reward=float(correct), terminated=True, info={"parsed": match and match.group()}
        )


AgentRunner = ArithEnv


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        a = rng.randrange(OPERANDS)
        b = rng.randrange(OPERANDS)
        samples.append({"id": index, "problem": f"What is {a} + {b}?", "answer": a + b})
    return samples


def warm_start(sample: dict, rng: random.Random) -> str:
    answer = sample["answer"]
    if rng.random() < 0.4:
        return str(answer)
    return str(max(0, answer + rng.choice([-2, -1, 1, 2])))
