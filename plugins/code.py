"""The policy writes a Python function; the sandbox runs the task's tests: reward = fraction passed.

`molt-wb train +recipe=code`. The reply's code is the last ```python block, or the whole reply.

The grade cannot be forged by the program. Each test is `CALL == EXPECTED`; the policy's program
runs alone in one jail and reports, as JSON, what each CALL gave; the EXPECTED sides are computed in
another jail that holds no program; the two lists of plain data are compared here. Whatever the
program prints, patches (eval, json, its caller's frame) or rewrites, it only chooses the values it
reports for the tests' calls, which is what a solution does; the expected values are nowhere it can
read. (A test of another shape is one CALL whose expected value is True.)
"""

import ast
import functools
import json
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
# Runs in a jail: `code` (empty for the expected sides), then each expression, each value as JSON
# (null where it raised or is not plain data), after a per-call nonce.
HARNESS = """
import json
namespace = {{}}
try:
    exec(compile({code!r}, "solution.py", "exec"), namespace)
except BaseException:
    pass
values = []
for expression in {expressions!r}:
    try:
        values.append(json.dumps(eval(expression, namespace)))
    except BaseException:
        values.append(None)
print({nonce!r}, json.dumps(values))
"""


# an expression that failed: equal to nothing
_FAILED = object()


def extract_code(text: str) -> str:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, re.DOTALL)
    return blocks[-1] if blocks else text


def split_test(test: str) -> tuple[str, str]:
    """(CALL, EXPECTED) of a test `CALL == EXPECTED`; (test, "True") for a test of another shape."""
    try:
        tree = ast.parse(test, mode="eval").body
    except SyntaxError:
        return test, "True"
    if isinstance(tree, ast.Compare) and len(tree.ops) == 1 and isinstance(tree.ops[0], ast.Eq):
        return ast.unparse(tree.left), ast.unparse(tree.comparators[0])
    return test, "True"


def evaluate(code: str, expressions: list[str]) -> list:
    """The value of each expression after `code`, run in a jail of its own; a _FAILED marker for
    one that raised, is not plain data, or whose report is missing or malformed."""
    nonce = secrets.token_hex(8)
    harness = HARNESS.format(code=code, expressions=expressions, nonce=nonce)
    result = run_python(harness, timeout_s=5.0, memory_mb=256)
    reports = re.findall(rf"^{nonce} (.*)$", result.stdout, re.MULTILINE)
    try:
        texts = json.loads(reports[-1])
        assert isinstance(texts, list) and len(texts) == len(expressions)
        return [_FAILED if text is None else json.loads(text) for text in texts]
    except (IndexError, AssertionError, TypeError, ValueError):
        return [_FAILED] * len(expressions)


@functools.lru_cache(maxsize=1024)
def expected_values(expressions: tuple[str, ...]) -> list:
    """The EXPECTED sides' values, computed in a jail that holds no program (cached: tasks
    repeat)."""
    return evaluate("", list(expressions))


def same(claimed, expected) -> bool:
    """Equal as Python compares plain data, except that a bool equals only a bool (a program that
    makes every value True must not pass the tests expecting 1)."""
    if isinstance(claimed, bool) or isinstance(expected, bool):
        return claimed is expected
    if isinstance(claimed, list) and isinstance(expected, list):
        pairs = zip(claimed, expected, strict=False)
        return len(claimed) == len(expected) and all(same(a, b) for a, b in pairs)
    if isinstance(claimed, dict) and isinstance(expected, dict):
        keys_match = claimed.keys() == expected.keys()
        return keys_match and all(same(claimed[key], expected[key]) for key in expected)
    return claimed is not _FAILED and claimed == expected


def tests_passed(code: str, tests: list[str]) -> int:
    """How many of `tests` hold for `code`: its calls' values from its own jail, compared here with
    the expected values from another (see the module docstring)."""
    calls = [split_test(test)[0] for test in tests]
    expected = expected_values(tuple(split_test(test)[1] for test in tests))
    claimed = evaluate(code, calls)
    return sum(same(value, want) for value, want in zip(claimed, expected, strict=True))


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
