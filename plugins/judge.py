"""LLM-as-judge reward: `molt-wb train +recipe=judge`.

The policy answers a question through the OpenAI SDK; then a judge, the same engine through the
loopback server (`ctx.judge`: a session that is never trained), compares the answer with a reference
and replies YES or NO. Reward = 1 for YES. The judge's prompt and verdict go into `Result.info`,
which the store keeps beside the segment (`segments.info`, JSON).
"""

import random

from openai import OpenAI

from workbench.api import ChatAgent, ChatContext, Result

JUDGE = (
    "You grade answers. Question: {question}\nReference answer: {reference}\n"
    "Student answer: {answer}\nIs the student answer correct? Reply YES or NO."
)


class JudgedAgent(ChatAgent):
    def run(self, ctx: ChatContext) -> Result:
        policy = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        answer = (
            policy.chat.completions.create(
                model=ctx.model,
                messages=[{"role": "user", "content": ctx.prompt}],
                max_tokens=ctx.max_tokens,
                temperature=ctx.temperature,
            )
            .choices[0]
            .message.content
        )
        judge = OpenAI(base_url=ctx.judge["base_url"], api_key=ctx.judge["api_key"], max_retries=0)
        prompt = JUDGE.format(question=ctx.prompt, reference=ctx.label, answer=answer)
        verdict = (
            judge.chat.completions.create(
                model=ctx.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=4,
                temperature=ctx.temperature,
            )
            .choices[0]
            .message.content
            or ""
        )
        score = float("YES" in verdict.upper())
        return Result(
            reward=score, info={"judge_prompt": prompt, "verdict": verdict, "score": score}
        )


AgentRunner = JudgedAgent


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    samples = []
    for index in range(size):
        a = rng.randrange(10)
        b = rng.randrange(10)
        samples.append({"id": index, "prompt": f"What is {a} + {b}?", "answer": a + b})
    return samples


def eval_dataset(size: int, seed: int) -> list[dict]:
    return make_dataset(size, seed + 7919)
