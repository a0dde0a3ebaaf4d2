"""The policy writes a Python function; the sandbox runs the task's tests: reward = fraction passed.

`molt-wb train +recipe=code`. The reply's code is the last ```python block, or the whole reply.
It runs in workbench.tools.sandbox (time and memory limits, no network) followed by each test in
turn; a per-episode nonce marks the harness's own count, so code that prints a fake count earns
nothing.
"""

import random
import re
import secrets

from workbench.api import Env, Result, run_python

SYSTEM = "Write the Python function. Reply with code only."
# (prompt, reference solution, tests); {k} is drawn per sample
TASKS = [
    (
        "Write a function f(x) that returns x + {k}.",
        "def f(x):\n    return x + {k}",
        ["f(0) == {k}", "f(5) == 5 + {k}", "f(-{k}) == 0"],
    ),
    (
        "Write a function f(x) that returns x * {k}.",
        "def f(x):\n    return x * {k}",
        ["f(0) == 0", "f(1) == {k}", "f(3) == 3 * {k}"],
    ),
    (
        "Write a function f(s) that returns s repeated {k} times.",
        "def f(s):\n    return s * {k}",
        ["f('a') == 'a' * {k}", "f('') == ''", "f('xy') == 'xy' * {k}"],
    ),
    (
        "Write a function f(xs) that returns the sum of xs plus {k}.",
        "def f(xs):\n    return sum(xs) + {k}",
        ["f([]) == {k}", "f([1, 2]) == 3 + {k}", "f([-{k}]) == 0"],
    ),
]
HARNESS = """
namespace = {{}}
passed = 0
try:
    exec(compile({code!r}, "solution.py", "exec"), namespace)
except BaseException:
    pass
for test in {tests!r}:
    try:
        passed += bool(eval(test, namespace))
    except BaseException:
        pass
print({nonce!r}, passed)
"""


def extract_code(text: str) -> str:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else text


def tests_passed(code: str, tests: list[str]) -> int:
    """How many of `tests` (expressions) are true after running `code`, counted in the sandbox."""
    nonce = secrets.token_hex(8)
    result = run_python(
        HARNESS.format(code=code, tests=tests, nonce=nonce), timeout_s=5.0, memory_mb=256
    )
    counts = re.findall(rf"^{nonce} (\d+)$", result.stdout, re.MULTILINE)
    return int(counts[-1]) if counts else 0


class CodeEnv(Env):
    system_prompt = SYSTEM

    def reset(self, sample: dict) -> str:
        self.tests = sample["tests"]
        return sample["problem"]

    def step(self, action: str) -> Result:
        passed = tests_passed(extract_code(action), self.tests)
        return Result(
            reward=passed / len(self.tests), info={"passed": passed, "tests": len(self.tests)}
        )


AgentRunner = CodeEnv


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        prompt, solution, tests = TASKS[index % len(TASKS)]
        k = rng.randrange(2, 9)
        samples.append(
            {
                "id": index,
                "problem": prompt.format(k=k),
                "solution": solution.format(k=k),
                "tests": [test.format(k=k) for test in tests],
            }
        )
    return samples


def eval_dataset(size: int, seed: int) -> list[dict]:
    return make_dataset(size, seed + 7919)


def warm_start(sample: dict, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return sample["solution"]
    return sample["solution"].replace("return ", "return 1 + ")
