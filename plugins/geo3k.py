"""Geometry3K as a multi-turn, tool-using vision-language Env: `molt-wb train +recipe=geo3k`.

The policy sees the diagram (an image content part) and the question; it may call
`python_executor(code=...)`, which runs the code in the sandbox (time and memory limits, no
network) and returns its stdout as a tool-response turn. The episode ends with a reply holding no
tool call, or with a program that calls `final_answer(x)`; either is graded
`0.9·accuracy + 0.1·format` with numeric equivalence (`<answer>…</answer>` or `\\boxed{…}`).
Data: `data.path` (the real set, see `molt-wb prepare geo3k`), else the synthetic diagrams of
`geo3k_data`.

Every problem is computable by the tool from what the question states: the sandbox runs a
program after `prelude`, which defines `values` (the numbers in the question, in order), `hypot`,
`pi` and `final_answer`. A synthetic problem's program is one line the same for every problem of
its kind (`final_answer(180 - sum(values))`) and copies no number: a 2-layer policy learns it,
where it does not learn to copy digits (or even one letter) from the question or the tool's
output. The warm start's teacher (`warm_start`) computes with the tool on `TOOL_SHARE` of its
episodes, always rightly (it prints the expression, then submits it), and otherwise answers a
value "read off the diagram", always wrongly: the warm-started policy calls the tool on a few of
its episodes, and RL learns that calling it pays (conf/recipe/geo3k.yaml; README: "The geo3k
recipe").
"""

import contextlib
import io
import json
import random
import re

from workbench.api import Env, Result, geo3k_reward, load_plugin, run_python

geo3k_data = load_plugin("geo3k_data")
# the share of the warm-start teacher's episodes that compute with the tool
TOOL_SHARE = 0.3
SYSTEM = (
    "Solve the geometry problem shown in the diagram. "
    "You may run Python with the python_executor tool. "
    "Give the final answer as <answer>...</answer>."
)
PYTHON_EXECUTOR = {
    "type": "function",
    "function": {
        "name": "python_executor",
        "description": (
            "Run Python code in a sandbox and return what it prints. `values` holds the "
            "numbers the question states; final_answer(x) submits x as the answer."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}


def user_content(sample: dict) -> list[dict]:
    """The problem as content parts: each `<image>` marker replaced by the next image (leftovers
    go first)."""
    pieces = sample["problem"].split("<image>")
    images = list(sample["images"])
    parts = [{"type": "image", "image": image} for image in images[len(pieces) - 1 :]]
    for index, text in enumerate(pieces):
        if index and index - 1 < len(images):
            parts.append({"type": "image", "image": images[index - 1]})
        if text.strip():
            parts.append({"type": "text", "text": text.strip()})
    return parts


def stated_values(sample: dict) -> list:
    """The numbers the question states, in order (ints where whole): `values` in the sandbox."""
    numbers = re.findall(r"\d+(?:\.\d+)?", sample["problem"])
    return [float(n) if "." in n else int(n) for n in numbers]


def prelude(sample: dict) -> str:
    """The lines the sandbox runs before a program: `values` (the question's numbers, so a program
    need not copy them), `hypot`, `pi`, and `final_answer(x)`, which submits x as the answer."""
    return (
        "from math import hypot, pi\n"
        f"values = {stated_values(sample)!r}\n"
        "def final_answer(x):\n"
        "    print(f'<answer>{x}</answer>')\n"
    )


def run_program(code: str, sample: dict) -> str:
    """What python_executor answers: the code's output, run in the sandbox after the prelude."""
    return run_python(prelude(sample) + code, timeout_s=5.0, memory_mb=256).tool_text()


def run_tool_call(action: str, sample: dict) -> str | None:
    """The tool response to the reply's python_executor call, or None when it holds no tool call."""
    call = re.search(r"<tool_call>(.*?)</tool_call>", action, re.DOTALL)
    if not call:
        return None
    try:
        request = json.loads(call.group(1))
        assert request["name"] == "python_executor"
        code = str(request["arguments"]["code"])
    except (ValueError, KeyError, TypeError, AssertionError):
        return (
            "Error: call python_executor as "
            '{"name": "python_executor", "arguments": {"code": "print(...)"}}'
        )
    return run_program(code, sample)


def grade(action: str, response: str | None, sample: dict) -> tuple[float, dict] | None:
    """The reward of a final step: a reply without a tool call, or one whose program called
    final_answer (graded as the reply followed by what it submitted); None for any other step."""
    if response is not None and "<answer>" not in response:
        return None
    text = action if response is None else f"{action}\n{response}"
    return geo3k_reward(text, sample["answer"], sample.get("choices"))


class Geo3kEnv(Env):
    system_prompt = SYSTEM
    tools = [PYTHON_EXECUTOR]

    def reset(self, sample: dict) -> list[dict]:
        self.sample = sample
        self.tool_calls = 0
        return user_content(sample)

    def step(self, action: str) -> Result:
        response = run_tool_call(action, self.sample)
        self.tool_calls += response is not None
        graded = grade(action, response, self.sample)
        if graded is None:
            return Result(
                observation=response,
                role="tool",
                terminated=False,
                info={"tool_calls": self.tool_calls},
            )
        reward, info = graded
        return Result(reward=reward, info=dict(info, tool_calls=self.tool_calls))


AgentRunner = Geo3kEnv


def make_dataset(size: int, seed: int) -> list[dict]:
    return geo3k_data.make_dataset(size, seed)


def load_dataset(path: str) -> list[dict]:
    return geo3k_data.load_dataset(path)


# a synthetic problem's answer, computed from the question's `values`: one expression per kind
EXPRESSIONS = {
    "triangle_angle": "180 - sum(values)",
    "right_triangle": "hypot(*values)",
    "circle area": "pi * values[0]**2",
    "circle circumference": "2 * pi * values[0]",
    "parallel_lines same-side interior": "180 - values[0]",
    "parallel_lines": "values[0]",
    "rectangle area": "values[0] * values[1]",
    "rectangle perimeter": "2 * sum(values)",
}


def expression(sample: dict) -> str | None:
    """Python that computes a synthetic sample's answer from the question's `values` (None for
    other samples)."""
    v = sample.get("values") or {}
    kind = sample.get("kind")
    detail = v.get("asked") or v.get("relation")
    return EXPRESSIONS.get(f"{kind} {detail}") or EXPRESSIONS.get(kind)


def printed(code: str, sample: dict) -> str:
    """What a program prints, run here as the sandbox runs it (the teacher's own programs)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(prelude(sample) + code, {})
    return output.getvalue().strip()


def tool_turn(code: str) -> dict:
    call = json.dumps({"name": "python_executor", "arguments": {"code": code}})
    return {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"}


def warm_start(sample: dict, rng: random.Random):
    """The teacher's episode: `TOOL_SHARE` of them print the right expression, then submit it
    with final_answer; the others answer a value read off the picture without computing,
    wrongly."""
    found = expression(sample)
    wrong = [c for c in sample.get("choices") or [] if c != sample["answer"]]
    if found is None or not wrong or rng.random() >= TOOL_SHARE:
        guess = rng.choice(wrong or [sample["answer"]])
        return f"I read the values off the diagram. <answer>{guess}</answer>"
    return [
        tool_turn(f"print({found})"),
        {"role": "tool", "content": printed(f"print({found})", sample) + "\n"},
        tool_turn(f"final_answer({found})"),
    ]
