"""The rollout worker: drives a plugin's Env episodes on an engine and returns Segment records.

Episodes of one call advance together, one batched `generate` per turn, so a worker's engine
always sees a full batch. Weight pushes may arrive (on another thread) while a call runs: with
`rollout.partial` they take effect between token steps, otherwise after the call. Rewards are
summed over an episode's turns; every segment of an episode carries the episode's reward, and its
reward of each turn.

An exception in a plugin's code (Env.reset / Env.step, ChatAgent.run, its reward) fails that episode
only: it comes back as a `failed_episodes` row with its traceback, and none of its segments reach
the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hashlib
import inspect
import math
import numbers
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from workbench.api import ChatAgent, ChatContext, Env, Result, load_plugin, use_isolation
from workbench.engines import make_engine
from workbench.engines.base import SamplingParams, derived_seed, from_wire
from workbench.invariants.token_identity import (
    SegmentTokens,
    TokenAccumulator,
    reply_text,
    retokenize_drift,
)
from workbench.segment import Batch, Segment
from workbench.server.loopback import LoopbackServer

if TYPE_CHECKING:
    import ray
    import torch
    from omegaconf import DictConfig

    from workbench.config import EvalConfig

# threads that run a batch's Env steps side by side: thread k steps every STEP_THREADS-th Env
STEP_THREADS = 8


@dataclass
class Job:
    """One episode to run: a data sample, its group (same prompt) and a run-unique rollout id."""

    sample: dict
    group_id: int
    rollout_id: int


class RolloutWorker:
    def __init__(self, cfg: DictConfig, model_path: str, worker_index: int = 0):
        from transformers import AutoTokenizer

        from workbench.engines.torch_engine import set_threads

        self.run_id = cfg.run.id
        self.max_turns = cfg.agent.max_turns
        self.history_rewrite = cfg.agent.history_rewrite
        self.worker_index = worker_index
        self.seed = cfg.seed * 1000 + worker_index
        # the policy's code runs in this process's sandbox as the run's config says
        use_isolation(cfg.sandbox.isolation, cfg.sandbox.warm)
        self.engine = make_engine(cfg, model_path, seed=self.seed)
        set_threads(cfg, getattr(self.engine, "model", None))
        # one rollout at a time; weight pushes arrive on another thread
        self.lock = threading.Lock()
        # Env steps (tools, a sandbox) run side by side
        self.pool = ThreadPoolExecutor(max_workers=STEP_THREADS)
        self._server: LoopbackServer | None = None
        # the collective transport's weights by version, kept until a batch loads them: a new
        # group (a worker restarted) keeps them for the batches in flight
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        # first prompts rendered and encoded, by messages: data repeats each epoch
        self.openings: OrderedDict[bytes, TokenAccumulator] = OrderedDict()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # a segment's round-trip audit and reply text, by its ids: a group's samples repeat them
        # (64 kept: a batch's repeats, not many long episodes' ids)
        self.drift = functools.lru_cache(64)(functools.partial(retokenize_drift, self.tokenizer))
        self.decoded = functools.lru_cache(64)(self.tokenizer.decode)
        self.plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs, cfg.agent.reward)
        self.params = SamplingParams(
            max_tokens=cfg.engine.max_tokens,
            temperature=cfg.engine.temperature,
            top_p=cfg.engine.top_p,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        # the sampling settings of the call under way: each call sets them, holding `lock`, before
        # its episodes start; its ChatAgents read them on the episode pool's threads (`_run_agent`)
        # and its Env turns on the call's thread (`_seeded`), all before the call releases `lock`
        self.active: SamplingParams = self.params

    def load_weights(self, weights: dict[str, Any]) -> int:
        """Adopt the learner's weights (`state_dict`, in `to_wire` form, or received beforehand by
        the collective transport) and their `version`."""
        version = weights["version"]
        if weights["state_dict"] is None:
            state_dict = self.received[version]
            # a newer version is loaded: the older ones are no batch's any more
            for older in [v for v in self.received if v < version]:
                del self.received[older]
        else:
            state_dict = from_wire(weights["state_dict"])
        self.engine.load_weights(state_dict, version)
        return version

    def join_weight_group(
        self,
        address: tuple[str, int],
        world: int,
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
        cfg: DictConfig,
    ) -> None:
        """Join the collective weight transport's group as rank worker_index + 1."""
        from workbench.learner.transport import WeightGroup

        rank = self.worker_index + 1
        self.weight_group = WeightGroup(address, rank, world, cfg.trainer.timeout_s)
        self.layout = layout
        self.bucket_bytes = cfg.ray.weight_bucket_mb * 2**20

    def receive_weights(self) -> int:
        """The weights learner rank 0 broadcasts next, kept until the batch that starts on them
        loads them (`load_weights`); their version."""
        state_dict, version = self.weight_group.receive(self.layout, self.bucket_bytes)
        self.received[version] = state_dict
        return version

    def rollout(
        self,
        jobs: list[Job],
        params: SamplingParams | None = None,
        weights: dict[str, Any] | None = None,
    ) -> Batch:
        """Run the episodes of `jobs` to the end.

        With `params`, else the training sampling settings; on `weights` when given, else the
        engine's. Without partial rollout, one weight version serves them all.
        """
        return self.rollout_with_failures(jobs, params, weights)[0]

    def evaluate(
        self, jobs: list[Job], settings: EvalConfig, weights: dict[str, Any] | None = None
    ) -> list[float]:
        """The reward of each held-out episode, sampled with the `eval.*` settings (its max_tokens,
        else the training one, and its temperature).

        Nothing of it is trained.
        """
        max_tokens = settings.max_tokens or self.params.max_tokens
        params = replace(self.params, max_tokens=max_tokens, temperature=settings.temperature)
        return list({s.rollout_id: s.reward for s in self.rollout(jobs, params, weights)}.values())

    def rollout_with_failures(
        self,
        jobs: list[Job],
        params: SamplingParams | None = None,
        weights: dict[str, Any] | None = None,
        after: list[ray.ObjectRef] | None = None,
    ) -> tuple[Batch, list[dict[str, Any]]]:
        """(segments of ended episodes, a failure row for each episode whose plugin code raised).

        `weights` (as `load_weights` takes them) travel with the call, so the batch starts on
        exactly them whenever Ray starts it; the loop sends each batch the weights async_depth
        versions behind. `after`: the ticket of the batch the driver sent this worker before this
        one (a Ray reference to its result), which this one waits for.
        """
        # batches run in the order the driver sent them: Ray hands this threaded actor's calls to
        # its threads in order, but which thread then takes the lock first is a race. The ticket
        # is done when that batch ended, or failed with a worker that died before this one.
        if after:
            import ray

            ray.wait(after, fetch_local=False)
        chat = isinstance(self.plugin.AgentRunner, type) and issubclass(
            self.plugin.AgentRunner, ChatAgent
        )
        # episode index -> its failure row
        failures: dict[int, dict[str, Any]] = {}
        with self.lock:
            if weights is not None and weights["version"] != self.engine.version:
                self.load_weights(weights)
            with contextlib.nullcontext() if self.engine.partial else self.engine.hold():
                generated = getattr(self.engine, "compute_s", None)
                self.active = params or self.params
                if chat:
                    segments = self._chat_rollout(jobs, failures)
                else:
                    segments = self._env_rollout(jobs, failures)
        # this call's generation seconds, for the learner's perf/generate_s
        if segments and generated is not None:
            segments[0].generate_s = self.engine.compute_s - generated
        return Batch(segments), list(failures.values())

    def _failed(self, job: Job, kind: str, error: BaseException) -> dict[str, Any]:
        trace = "".join(traceback.format_exception(error))
        return failure_row(job, self.worker_index, kind, f"{type(error).__name__}: {error}", trace)

    def server(self) -> LoopbackServer:
        """This worker's loopback server, started on first use."""
        if self._server is None:
            self._server = LoopbackServer(
                self.engine,
                self.tokenizer,
                self.params,
                seed=self.seed,
                history_rewrite=self.history_rewrite,
            )
        return self._server

    def _chat_rollout(self, jobs: list[Job], failures: dict[int, dict[str, Any]]) -> list[Segment]:
        """Every job's ChatAgent runs at once on its own session; requests share engine calls."""
        server = self.server()
        sessions = [server.open_session(job.rollout_id) for job in jobs]
        # judge calls: same engine, never trained
        judges = [server.open_session(job.rollout_id, stream=1) for job in jobs]
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(
                pool.map(lambda *args: _caught(self._run_agent, *args), jobs, sessions, judges)
            )
        segments = []
        episodes = zip(jobs, sessions, judges, results, strict=True)
        for index, (job, session, judge, result) in enumerate(episodes):
            server.close_session(judge["session"])
            pieces, requests = server.close_session(session["session"])
            runner = f"{self.plugin.AgentRunner.__name__}.run"
            turns = sum(len(piece.turn_spans) for piece in pieces)
            counted = isinstance(result, Result) and result.turn_rewards is not None
            result = finite_reward(result, runner)
            if counted and len(result.turn_rewards) != turns:
                result = ValueError(
                    f"{runner} returned {len(result.turn_rewards)} turn_rewards for {turns} "
                    f"policy calls: give one reward per call."
                )
            if not isinstance(result, Result):
                failures[index] = self._failed(job, "agent_error", _episode_error(result, runner))
                continue
            episode = self._segments(
                job,
                pieces,
                result.reward,
                pieces[-1].finish if pieces else "",
                result.info,
                result.turn_rewards,
            )
            if episode:
                episode[0].requests = requests
            segments += episode
        return segments

    def _run_agent(self, job: Job, session: dict[str, str], judge: dict[str, str]) -> Any:
        ctx = ChatContext(
            base_url=session["openai_base_url"],
            anthropic_base_url=session["anthropic_base_url"],
            api_key=session["api_key"],
            model="policy",
            prompt=job.sample.get("prompt", job.sample.get("problem", "")),
            label=job.sample.get("answer"),
            sample=job.sample,
            max_tokens=self.active.max_tokens,
            temperature=self.active.temperature,
            judge={"base_url": judge["openai_base_url"], "api_key": judge["api_key"]},
        )
        result = self.plugin.AgentRunner().run(ctx)
        return asyncio.run(result) if inspect.iscoroutine(result) else result

    def _start_env(self, job: Job) -> tuple[Env, TokenAccumulator]:
        env = self.plugin.AgentRunner()
        messages = opening_messages(env, job.sample)
        # a digest: an image's bytes are not kept twice
        key = hashlib.sha256(repr((messages, env.tools)).encode()).digest()
        # a group's episodes open on the same prompt, and so does each epoch: render it once
        if key in self.openings:
            self.openings.move_to_end(key)
        else:
            # its own copy: later episodes fork it
            self.openings[key] = TokenAccumulator(
                self.tokenizer,
                copy.deepcopy(messages),
                tools=copy.deepcopy(env.tools),
                codec=self.engine.codec,
                rewrite=self.history_rewrite,
            )
            if len(self.openings) > 4096:
                self.openings.popitem(last=False)
        return env, self.openings[key].fork()

    def _env_rollout(self, jobs: list[Job], failures: dict[int, dict[str, Any]]) -> list[Segment]:
        envs: dict[int, Env] = {}
        episodes: dict[int, TokenAccumulator] = {}
        # each episode's reward of each turn
        rewards: list[list[float]] = [[] for _ in jobs]
        infos = [{} for _ in jobs]
        for index, job in enumerate(jobs):
            started = _caught(self._start_env, job)
            if isinstance(started, BaseException):
                failures[index] = self._failed(job, "env_error", started)
            else:
                envs[index], episodes[index] = started
        open_ = list(episodes)
        for turn in range(self.max_turns):
            if not open_:
                break
            generations = self.engine.generate(
                [episodes[i].token_ids for i in open_],
                self._seeded(jobs, turn),
                [episodes[i].open.images for i in open_],
            )
            texts = [reply_text(self.tokenizer, g.token_ids, g.finish_reason) for g in generations]
            results = [
                finite_reward(r, "Env.step") for r in self._steps([envs[i] for i in open_], texts)
            ]
            still_open = []
            for i, generation, text, result in zip(open_, generations, texts, results, strict=True):
                if not isinstance(result, Result):
                    failures[i] = self._failed(
                        jobs[i], "env_error", _episode_error(result, "Env.step")
                    )
                    continue
                episodes[i].add_sampled(
                    generation.token_ids,
                    generation.logprobs,
                    generation.versions,
                    {"role": "assistant", "content": text},
                    generation.finish_reason,
                    generation.extras.get("routed_experts"),
                    raw_logprobs=generation.extras.get("raw_logprobs"),
                )
                rewards[i].append(result.reward)
                infos[i] = result.info
                if not (result.terminated or result.truncated) and turn + 1 < self.max_turns:
                    episodes[i].add_messages(
                        [{"role": result.role, "content": result.observation or ""}]
                    )
                    still_open.append(i)
            open_ = still_open
        segments = []
        for i, episode in episodes.items():
            if i not in failures:
                pieces = episode.finish()
                segments += self._segments(
                    jobs[i], pieces, sum(rewards[i], 0.0), episode.last_finish, infos[i], rewards[i]
                )
        return segments

    def _steps(self, envs: list[Env], actions: list[str]) -> list[Any]:
        """Each Env's `step` result (or the exception it raised), side by side in the pool's
        threads: a thread takes every STEP_THREADS-th (eighth), so 64 quick steps wake 8 threads,
        not 64."""

        def run(k: int) -> list[Any]:
            return [
                _caught(env.step, action)
                for env, action in zip(envs[k::STEP_THREADS], actions[k::STEP_THREADS], strict=True)
            ]

        results: list[Any] = [None] * len(envs)
        for k, done in enumerate(self.pool.map(run, range(min(STEP_THREADS, len(envs))))):
            results[k::STEP_THREADS] = done
        return results

    def _seeded(self, jobs: list[Job], turn: int) -> SamplingParams:
        """The sampling settings of one engine call, seeded by the batch (its first episode id)
        and turn: a run samples the same whichever order its queued batches reach the worker, and
        after a resume."""
        if self.active.seed is not None:
            return self.active
        # held-out episodes have ids < 0
        return replace(self.active, seed=derived_seed(self.seed, jobs[0].rollout_id, turn))

    def _segments(
        self,
        job: Job,
        pieces: list[SegmentTokens],
        reward: float,
        finish_reason: str,
        info: dict | None = None,
        turn_rewards: list[float] | None = None,
    ) -> list[Segment]:
        """Segment records of one episode, each audited: are its sampled ids intact, and would
        its text round-trip? `turn_rewards`: one per sampled turn; None: `reward` at the last."""
        turns = sum(len(piece.turn_spans) for piece in pieces)
        if turn_rewards is None:
            turn_rewards = [0.0] * (turns - 1) + [reward]
        first_turn = 0
        segments = []
        for index, piece in enumerate(pieces):
            prompt_end = piece.turn_spans[0][0] if piece.turn_spans else len(piece.token_ids)
            ids = tuple(piece.token_ids)
            response = self.decoded(ids[prompt_end:])
            drift = self.drift(ids)
            segments.append(
                Segment(
                    self.run_id,
                    job.rollout_id,
                    index,
                    job.group_id,
                    **piece.arrays(),
                    reward=reward,
                    turn_spans=piece.turn_spans,
                    turn_rewards=turn_rewards,
                    first_turn=first_turn,
                    finish_reason=finish_reason,
                    seal_reason=piece.seal_reason,
                    images=piece.images,
                    display={"prompt": piece.prompt_text, "response": response, "info": info or {}},
                    audit={"identity": piece.identity_holds(), "retokenize_drift": drift},
                )
            )
            first_turn += len(piece.turn_spans)
        return segments


def opening_messages(env: Env, sample: dict) -> list[dict]:
    """The messages an Env episode opens with: its system prompt, if any, and its first
    observation."""
    system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    return system + [{"role": "user", "content": env.reset(sample)}]


def _episode_error(result: Any, call: str) -> BaseException:
    """The exception a plugin's `call` raised, or a TypeError saying its value is not a Result."""
    if isinstance(result, BaseException):
        return result
    return TypeError(f"{call} returned {type(result).__name__}, not a Result")


def failure_row(job: Job, worker: int, kind: str, error: str, trace: str) -> dict[str, Any]:
    """The `failed_episodes` row of the episode `job` of rollout worker `worker`."""
    return {
        "rollout_id": job.rollout_id,
        "group_id": job.group_id,
        "worker": worker,
        "kind": kind,
        "error": error,
        "traceback": trace,
        "time": time.time(),
    }


def finite_reward(result: Result | BaseException, where: str) -> Result | BaseException:
    """`result`, or the ValueError of a reward (or turn reward) that is NaN or infinite: that
    episode fails, and no NaN reaches the advantages and the loss."""
    if not isinstance(result, Result):
        return result
    for reward in [result.reward, *(result.turn_rewards or [])]:
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            return ValueError(
                f"{where} returned the reward {reward}: a reward must be a finite number."
            )
    return result


def _caught(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, or the exception a plugin's code raised in it (one episode fails, not
    the worker)."""
    try:
        return function(*args)
    except Exception as error:
        return error
