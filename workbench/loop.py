"""The RL loop: generate, score, gate, train, sync, log — one rollout batch per iteration.

Data flows one way (rollout -> learner -> store); only weights and their version flow back.
With `trainer.async_depth=d`, up to d+1 rollout batches are in flight (a bounded window of Ray
futures), so rollout runs up to d versions ahead of the learner and the version gate corrects
for it; d=0 is strictly on-policy. All mechanics live in runtime.py, rollout.py, learner.py and
store/; this file is the list of calls. Faults (failed episodes, dead or hung workers) are handled
in faults.py, checkpoints and resume in checkpoint.py.
"""

from __future__ import annotations

from collections import deque

from workbench import checkpoint, evaluate, faults, runtime


def train(cfg) -> str:
    """Run one training run to the end; return its run id."""
    import ray

    prompts = runtime.Prompts(cfg)  # a bad data set is refused before anything starts
    run_dir, run_row = runtime.start_run(
        cfg
    )  # or, resuming, the run cut back to its latest checkpoint
    cfg = runtime.plain(cfg)  # final from here on, and read every step by every process
    model_path = runtime.policy_path(cfg)
    runtime.init_ray(cfg)
    store, learner, workers = runtime.start_actors(cfg, model_path, run_dir, run_row)
    progress, status = runtime.Progress(cfg), "failed"
    start, batches = (
        checkpoint.restore(cfg, run_dir, learner, workers, prompts),
        cfg.trainer.steps // cfg.trainer.minibatches,
    )
    in_flight = deque(
        faults.submit(workers, prompts)
        for _ in range(min(cfg.trainer.async_depth + 1, batches - start))
    )
    try:
        for step in range(start, batches):
            clock = runtime.StepClock()
            # ---- generate and score: the oldest batch in flight, sampled by up to async_depth older versions
            segments = faults.collect(
                in_flight.popleft(), step, cfg, store, learner, workers, prompts
            )
            clock.lap("rollout")
            # ---- gate and train: recompute log-probs, version gate, advantages, PPO steps (version += minibatches)
            # ---- sync: the step's new weights and version travel with the next batch, which Ray starts once they
            # exist and which starts on exactly them: a batch is exactly async_depth versions behind, and the driver
            # never waits on a push. Partial rollouts also take them mid-batch: the batch in flight gets them pushed
            metrics, rows, weights = learner.step.options(num_returns=3).remote(*segments)
            if cfg.rollout.partial:
                ray.get([w.load_weights.remote(weights) for w in workers])
            if step + len(in_flight) + 1 < batches:
                in_flight.append(faults.submit(workers, prompts, weights))
            metrics = ray.get(metrics, timeout=cfg.trainer.timeout_s)
            clock.lap("train")  # the learner's step
            # ---- log: the single writer stores segments, tokens, gate decisions and metrics
            metrics = clock.metrics(metrics)
            store.write_step.remote(step, metrics, rows, *segments)
            checkpoint.maybe_save(
                cfg,
                run_dir,
                step,
                learner,
                store,
                in_flight[0].data_state if in_flight else prompts.state(),
            )
            progress.update(metrics)
            # ---- evaluate: every eval.every steps, the held-out split under its own sampling settings
            evaluate.at_step(cfg, workers, store, step, weights)
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except (
        ray.exceptions.RayActorError
    ) as error:  # the learner or the store died (a rollout worker's death: faults.py)
        raise runtime.died(error, cfg.run.id, store, learner) from error
    except ray.exceptions.GetTimeoutError as error:
        raise runtime.run_failed(
            f"Step {step}: the learner gave no result within trainer.timeout_s="
            f"{cfg.trainer.timeout_s:g} s (hung, or steps longer than that)",
            cfg.run.id,
            "raise trainer.timeout_s if steps take longer, then ",
        ) from error
    finally:
        progress.close()
        runtime.stop_actors(cfg.run.id, status, store, learner, workers)
    return cfg.run.id
