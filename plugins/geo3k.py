"""Geometry3K as a multi-turn, tool-using vision-language Env: `molt-wb train +recipe=geo3k`.

The policy sees the diagram (an image content part) and the question; it may call
`python_executor(code=...)`, which runs the code in the sandbox (time and memory limits, no
network) and returns its stdout as a tool-response turn; the episode ends with a reply holding no
tool call, graded `0.9·accuracy + 0.1·format` with numeric equivalence (`<answer>…</answer>` or
`\\boxed{…}`). Data: `data.path` (the real set, see `molt-wb prepare geo3k`), else the synthetic
diagrams of `geo3k_data`. The warm start demonstrates the format on a noisy teacher: half its
episodes compute with the tool first, and its final answer is right half of the time.
"""

import json
import random
import re

from workbench.api import Env, Result, geo3k_reward, load_plugin, run_python

geo3k_data = load_plugin("geo3k_data")
SYSTEM = (
    "Solve the geometry problem shown in the diagram. "
    "You may run Python with the python_executor tool. "
    "Give the final answer as <answer>...</answer>."
)
PYTHON_EXECUTOR = {
    "type": "function",
    "function": {
        "name": "python_executor",
        "description": "Run Python code in a sandbox and return what it prints.",
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


def run_tool_call(action: str) -> str | None:
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
    return run_python(code, timeout_s=5.0, memory_mb=256).tool_text()


class Geo3kEnv(Env):
    system_prompt = SYSTEM
    tools = [PYTHON_EXECUTOR]

    def reset(self, sample: dict) -> list[dict]:
        self.sample = sample
        self.tool_calls = 0
        return user_content(sample)

    def step(self, action: str) -> Result:
        response = run_tool_call(action)
        if response is not None:
            self.tool_calls += 1
            return Result(
                observation=response,
                role="tool",
                terminated=False,
                info={"tool_calls": self.tool_calls},
            )
        reward, info = geo3k_reward(action, self.sample["answer"], self.sample.get("choices"))
        return Result(reward=reward, info=dict(info, tool_calls=self.tool_calls))


AgentRunner = Geo3kEnv


def make_dataset(size: int, seed: int) -> list[dict]:
    return geo3k_data.make_dataset(size, seed)


def load_dataset(path: str) -> list[dict]:
    return geo3k_data.load_dataset(path)


def program(sample: dict) -> str | None:
    """Python that computes a synthetic sample's answer from its drawn values (None for other
    samples)."""
    v = sample.get("values") or {}
    kind = sample.get("kind")
    if kind == "triangle_angle":
        return f"print(180 - {v['a']} - {v['b']})"
    if kind == "right_triangle":
        return f"print(({v['a']}**2 + {v['b']}**2) ** 0.5)"
    if kind == "circle" and v["asked"] == "area":
        return f"print({v['r']}**2)"
    if kind == "circle":
        return f"print(2 * {v['r']})"
    if kind == "parallel_lines" and v["relation"] == "same-side interior":
        return f"print(180 - {v['g']})"
    if kind == "parallel_lines":
        return f"print({v['g']})"
    if kind == "rectangle" and v["asked"] == "area":
        return f"print({v['w']} * {v['h']})"
    if kind == "rectangle":
        return f"print(2 * ({v['w']} + {v['h']}))"
    return None


def warm_start(sample: dict, rng: random.Random):
    """A noisy teacher's episode: reasoning, then the answer, right half of the time (else a wrong
    choice); half of them compute it with the tool first and, when right, answer what the tool
    printed."""
    wrong = [c for c in sample.get("choices") or [] if c != sample["answer"]]
    right = rng.random() < 0.5 or not wrong
    answer = sample["answer"] if right else rng.choice(wrong)
    code = program(sample)
    if code is None or rng.random() < 0.5:
        return f"I read the values off the diagram. <answer>{answer}</answer>"
    call = json.dumps({"name": "python_executor", "arguments": {"code": code}})
    # our own arithmetic: what the sandbox would print
    output = str(eval(code.removeprefix("print(")[:-1]))
    final = answer
    if right:
        # circles: answers in units of π
        final = output + "\\pi" * sample["answer"].endswith("\\pi")
    return [
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": output + "\n"},
        {"role": "assistant", "content": f"The program printed {output}. <answer>{final}</answer>"},
    ]
