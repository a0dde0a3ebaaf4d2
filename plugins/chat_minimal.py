"""The arith task as a ChatAgent: the agent owns the loop and calls the stock OpenAI SDK.

Nothing in it knows about training: it gets a base URL and key, asks its question, and grades the
reply. The loopback server behind the URL records every token the policy sampled.
"""

import re

from openai import OpenAI

from workbench.api import ChatAgent, ChatContext, Result, load_plugin

arith = load_plugin("arith")


class ArithChat(ChatAgent):
    def run(self, ctx: ChatContext) -> Result:
        client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=ctx.model,
            messages=[{"role": "user", "content": ctx.prompt}],
            max_tokens=ctx.max_tokens,
            temperature=ctx.temperature,
        )
        match = re.search(r"-?\d+", reply.choices[0].message.content or "")
        return Result(reward=float(match is not None and int(match.group()) == int(ctx.label)))


AgentRunner = ArithChat
make_dataset = arith.make_dataset
warm_start = arith.warm_start
