"""Rollout faults: every dispatched episode reaches the training batch or the `failed_episodes` table, once.

A plugin exception fails one episode (the worker reports it, rollout.py). A worker whose process
dies is restarted by Ray (`rollout.max_restarts`); one that does not answer within
`rollout.timeout_s` (a hung engine or agent) is killed and restarted. Either way every episode it
held becomes a failure row, the restarted worker gets the learner's current weights and version,
and the run goes on; a batch that lost every episode is drawn again, at most three times in a row.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


@dataclass
class Rollout:
    """One rollout batch in flight: per worker its jobs and the futures of (segments, failure rows)."""

    jobs: list[list]
    segments: list
    failures: list
    data_state: dict  # the data position before this batch was drawn: what a checkpoint saves
    weights: object = (
        None  # the learner's weights (a Ray reference) the batch starts on; None: the engines' own
    )


def submit(workers, prompts, weights=None) -> Rollout:
    """Start the next batch of episodes, shared among the workers, on `weights` when given."""
    data_state = prompts.state()
    jobs = prompts.next_jobs(len(workers))
    futures = [
        w.rollout_with_failures.options(num_returns=2).remote(j, None, weights)
        for w, j in zip(workers, jobs)
    ]
    return Rollout(jobs, [f[0] for f in futures], [f[1] for f in futures], data_state, weights)


def collect(rollout: Rollout, step: int, cfg, store, learner, workers, prompts) -> list:
    """The segment futures of the workers that delivered; each episode that did not is recorded as failed."""
    import ray

    for _ in range(3):
        ready, _ = ray.wait(
            rollout.failures, num_returns=len(rollout.failures), timeout=cfg.rollout.timeout_s
        )
        delivered, rows = [], []
        for index, (worker, jobs, segments, failures) in enumerate(
            zip(workers, rollout.jobs, rollout.segments, rollout.failures)
        ):
            try:
                if failures not in ready:
                    ray.kill(worker, no_restart=False)  # Ray starts it again (rollout.max_restarts)
                    raise TimeoutError(
                        f"rollout worker {index} gave no result within rollout.timeout_s="
                        f"{cfg.rollout.timeout_s:g} s (a hung engine or agent); it was restarted"
                    )
                rows += ray.get(failures)
                delivered.append(segments)
            except (ray.exceptions.RayError, TimeoutError) as error:
                kind = (
                    "timeout"
                    if isinstance(error, TimeoutError)
                    else "worker_died"
                    if isinstance(error, ray.exceptions.RayActorError)
                    else "worker_error"
                )
                message = (
                    str(error).strip().splitlines()[0]
                    if str(error).strip()
                    else type(error).__name__
                )
                rows += [
                    {
                        "rollout_id": job.rollout_id,
                        "group_id": job.group_id,
                        "worker": index,
                        "kind": kind,
                        "error": message,
                        "traceback": str(error),
                        "time": time.time(),
                    }
                    for job in jobs
                ]
                _push_when_back(
                    worker, learner.weights.remote()
                )  # the restart loaded the first weights
        if rows:
            store.write_failures.remote(step, rows)
            kinds = sorted({row["kind"] for row in rows})
            print(
                f"step {step}: {len(rows)} episode(s) failed ({', '.join(kinds)}); see the failed_episodes table",
                file=sys.stderr,
                flush=True,
            )
        if len(rows) < sum(len(jobs) for jobs in rollout.jobs):
            return delivered
        rollout = submit(workers, prompts, rollout.weights)
    from workbench.runtime import RunFailed

    raise RunFailed(
        f"Step {step}: three rollout batches in a row lost every episode; the failed_episodes table "
        f"holds each error: fix the agent, its data or the engine."
    )


def _push_when_back(worker, weights, seconds: float = 300.0) -> None:
    """Give a (restarting) worker the current weights, once Ray has it running again."""
    import ray

    deadline = time.monotonic() + seconds
    while True:
        try:
            ray.get(worker.load_weights.remote(weights))
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
