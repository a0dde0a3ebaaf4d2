"""The geo3k task as a ChatAgent: the stock OpenAI SDK, the diagram as an image content block,
`python_executor` as an OpenAI tool run in the sandbox (with the question's `values` and
`final_answer`), up to `MAX_TURNS` requests per episode.

It is the same task as plugins/geo3k.py (same data, grader and warm start) with the agent owning
the loop; the loopback server behind `ctx.base_url` records every sampled token.
"""

import base64
import json

from openai import OpenAI

from workbench.api import ChatAgent, ChatContext, Result, geo3k_reward, load_plugin

geo3k = load_plugin("geo3k")
MAX_TURNS = 3


def openai_content(sample: dict) -> list[dict]:
    """The problem as OpenAI content parts, images inline as data URLs."""
    parts = []
    for part in geo3k.user_content(sample):
        if part["type"] == "image":
            url = "data:image/png;base64," + base64.b64encode(part["image"]).decode()
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append(part)
    return parts


class Geo3kChat(ChatAgent):
    def run(self, ctx: ChatContext) -> Result:
        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        messages = [
            {"role": "system", "content": geo3k.SYSTEM},
            {"role": "user", "content": openai_content(ctx.sample)},
        ]
        for _ in range(MAX_TURNS):
            reply = (
                client.chat.completions.create(
                    model=ctx.model,
                    messages=messages,
                    tools=[geo3k.PYTHON_EXECUTOR],
                    max_tokens=ctx.max_tokens,
                    temperature=ctx.temperature,
                )
                .choices[0]
                .message
            )
            if not reply.tool_calls:
                reward, info = geo3k_reward(
                    reply.content or "", ctx.label, ctx.sample.get("choices")
                )
                return Result(reward=reward, info=info)
            messages.append(reply.model_dump(exclude_none=True))
            for call in reply.tool_calls:
                code = str(json.loads(call.function.arguments or "{}").get("code", ""))
                output = geo3k.run_program(code, ctx.sample)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
                # the program submitted its answer with final_answer
                graded = geo3k.grade(code, output, ctx.sample)
                if graded is not None:
                    return Result(reward=graded[0], info=graded[1])
        # the turn budget ran out before a final answer
        return Result(reward=0.0, truncated=True)


AgentRunner = Geo3kChat
make_dataset = geo3k.make_dataset
load_dataset = geo3k.load_dataset
# the same demonstrations (the Env renders them token-exactly as this agent's traffic), one cached
# checkpoint
WARM_START_AS = geo3k
