"""Multi-turn tool use through the stock OpenAI SDK: `molt-wb train +recipe=tool_use`.

A ChatAgent asks "(a + b) * c" with two tools the environment implements, add and multiply. Each
tool call the policy makes (parsed by the loopback server into `tool_calls`) is run here and
answered with a tool message; the first reply without a tool call is the final answer, graded 1/0.
"""

import json
import random
import re

from openai import OpenAI

from workbench.api import ChatAgent, ChatContext, Result

MAX_CALLS = 3


def schema(name: str, description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


TOOLS = [schema("add", "Add two integers."), schema("multiply", "Multiply two integers.")]
IMPLEMENTATIONS = {"add": lambda a, b: a + b, "multiply": lambda a, b: a * b}


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        return str(IMPLEMENTATIONS[name](int(args["a"]), int(args["b"])))
    except (ValueError, KeyError, TypeError):
        return (
            f"error: call add or multiply with integer arguments a and b, not {name}({arguments})"
        )


class ToolUseAgent(ChatAgent):
    def run(self, ctx: ChatContext) -> Result:
        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": ctx.prompt}]
        calls = 0
        for _ in range(MAX_CALLS + 1):
            reply = (
                client.chat.completions.create(
                    model=ctx.model,
                    messages=messages,
                    tools=TOOLS,
                    max_tokens=ctx.max_tokens,
                    temperature=ctx.temperature,
                )
                .choices[0]
                .message
            )
            if not reply.tool_calls or calls == MAX_CALLS:
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": reply.content or "",
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {
                                "name": c.function.name,
                                "arguments": c.function.arguments,
                            },
                        }
                        for c in reply.tool_calls
                    ],
                }
            )
            for call in reply.tool_calls:
                calls += 1
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": run_tool(call.function.name, call.function.arguments),
                    }
                )
        match = re.search(r"-?\d+", reply.content or "")
        correct = match is not None and int(match.group()) == int(ctx.label)
        return Result(
            reward=float(correct), info={"tool_calls": calls, "pred": match and match.group()}
        )


AgentRunner = ToolUseAgent


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        a = rng.randrange(10)
        b = rng.randrange(10)
        c = rng.randrange(2, 10)
        samples.append(
            {
                "id": index,
                "prompt": f"What is ({a} + {b}) * {c}? Use the tools.",
                "answer": (a + b) * c,
            }
        )
    return samples


def eval_dataset(size: int, seed: int) -> list[dict]:
    return make_dataset(size, seed + 7919)
