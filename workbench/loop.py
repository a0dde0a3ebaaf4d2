"""The RL loop: generate, score, train, sync, log — one rollout batch per iteration.

Data flows one way (rollout -> learner -> store); only weights and their version flow back.
All mechanics live in runtime.py, rollout.py, learner.py and store/; this file is the list of calls.
"""

from __future__ import annotations

from workbench import runtime


def train(cfg) -> str:
    """Run one training run to the end; return its run id."""
    import ray

    run_dir, run_row = runtime.start_run(cfg)
    model_path = runtime.policy_path(cfg)
    runtime.init_ray(cfg)
    store, learner, workers = runtime.start_actors(cfg, model_path, run_dir, run_row)
    prompts, progress, status = runtime.Prompts(cfg), runtime.Progress(cfg), "failed"
    try:
        for step in range(cfg.trainer.steps // cfg.trainer.minibatches):
            clock = runtime.StepClock()
            # ---- generate and score: every worker runs its share of this step's episodes
            segments = [w.rollout.remote(jobs) for w, jobs in zip(workers, prompts.next_jobs(len(workers)))]
            ray.wait(segments, num_returns=len(segments))
            clock.lap("rollout")
            # ---- train: recompute log-probs, advantages, PPO-clip steps (version += minibatches)
            metrics, rows = learner.train.options(num_returns=2).remote(*segments)
            metrics = ray.get(metrics)
            clock.lap("train")
            # ---- sync: push the new weights and their version to every engine
            weights = learner.weights.remote()
            ray.get([w.load_weights.remote(weights) for w in workers])
            clock.lap("sync")
            # ---- log: the single writer stores segments, tokens and metrics
            metrics = clock.metrics(metrics)
            store.write_step.remote(step, metrics, rows, *segments)
            progress.update(metrics)
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        progress.close()
        runtime.stop_actors(status, store, learner, workers)
    return cfg.run.id
