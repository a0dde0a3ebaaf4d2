"""Single-turn math with \\boxed{} answers, graded by numeric equivalence.

Run it with `molt-wb train +recipe=math`. Problems are small arithmetic expressions and fractions;
`\\boxed{3/4}`, `\\boxed{0.75}` and `\\boxed{\\frac{3}{4}}` all count as right
(workbench.tools.grading). The warm start demonstrates the format on a noisy teacher, right half
the time.
"""

import random
from fractions import Fraction

from workbench.api import Env, Result, extract_answer, grade

SYSTEM = "Solve the problem. Put the final answer in \\boxed{}."


class MathEnv(Env):
    system_prompt = SYSTEM

    def reset(self, sample: dict) -> str:
        self.answer = sample["answer"]
        return sample["problem"]

    def step(self, action: str) -> Result:
        return Result(
            reward=float(grade(action, self.answer)),
            info={"pred": extract_answer(action), "answer": self.answer},
        )


AgentRunner = MathEnv


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        a = rng.randrange(1, 10)
        b = rng.randrange(1, 10)
        c = rng.randrange(2, 6)
        if index % 2:
            problem = f"What is {a} * {c} + {b}?"
            answer = str(a * c + b)
        else:
            problem = f"What is {a}/{c} + {b}/{c}?"
            answer = str(Fraction(a + b, c))
        samples.append({"id": index, "problem": problem, "answer": answer})
    return samples


def eval_dataset(size: int, seed: int) -> list[dict]:
    return make_dataset(size, seed + 7919)  # another draw: the held-out split


def warm_start(sample: dict, rng: random.Random) -> str:
    answer = sample["answer"] if rng.random() < 0.5 else str(rng.randrange(1, 40))
    return f"\\boxed{{{answer}}}"
