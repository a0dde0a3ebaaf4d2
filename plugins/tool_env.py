"""A multi-turn tool-use Env: the policy may call add(a, b) before it answers.

The tool is listed in the system turn by the chat template (`tools`); a reply holding
<tool_call>{"name": "add", "arguments": {"a": .., "b": ..}}</tool_call> gets the result back as a
<tool_response> turn, and the episode goes on; any other reply is the final answer, graded 1/0.
"""

import json
import re

from workbench.api import Env, Result, load_plugin

arith = load_plugin("arith")
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}


class ToolEnv(Env):
    tools = [ADD]

    def reset(self, sample: dict) -> str:
        self.answer = int(sample["answer"])
        return sample["problem"]

    def step(self, action: str) -> Result:
        call = re.search(r"<tool_call>(.*?)</tool_call>", action, re.DOTALL)
        if call:
            try:
                arguments = json.loads(call.group(1))["arguments"]
                result = str(int(arguments["a"]) + int(arguments["b"]))
            except (ValueError, KeyError, TypeError):
                result = "error: call add with integer arguments a and b"
            return Result(observation=f"<tool_response>{result}</tool_response>", terminated=False)
        match = re.search(r"-?\d+", action)
        return Result(reward=float(match is not None and int(match.group()) == self.answer))


AgentRunner = ToolEnv
make_dataset = arith.make_dataset
warm_start = arith.warm_start
