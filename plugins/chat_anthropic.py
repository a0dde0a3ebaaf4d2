"""A two-turn ChatAgent on the async Anthropic SDK: answer, then answer again when asked "Sure?".

The second request repeats the whole conversation, as SDK users do; the loopback server sees
that it extends the first and continues from the exact ids sampled in turn one. The reward is the
final answer's.
"""

import re

from anthropic import AsyncAnthropic

from workbench.api import ChatAgent, ChatContext, Result, load_plugin

arith = load_plugin("arith")


class SureChat(ChatAgent):
    async def run(self, ctx: ChatContext) -> Result:
        client = AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": ctx.prompt}]
        for _ in range(2):
            reply = await client.messages.create(
                model=ctx.model,
                max_tokens=ctx.max_tokens,
                messages=messages,
                extra_body={"temperature": ctx.temperature},
            )
            text = "".join(block.text for block in reply.content if block.type == "text")
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Sure?"},
            ]
        match = re.search(r"-?\d+", text)
        return Result(reward=float(match is not None and int(match.group()) == int(ctx.label)))


AgentRunner = SureChat
make_dataset = arith.make_dataset
warm_start = arith.warm_start
