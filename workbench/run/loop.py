"""The RL loop: generate, score, gate, train, sync, log — one rollout batch per iteration. Data
flows one way (rollout -> learner -> store); only weights and their version flow back, to rollouts
up to `trainer.async_depth` versions behind (window.py; the version gate corrects for it)."""

from workbench.config import Config
from workbench.run import checkpoint, cluster, evaluate, faults, model_paths, recovery, run_folder
from workbench.run.data import Prompts
from workbench.run.progress import Progress, StartClock
from workbench.run.window import PendingStep, Trailing, Window


def train(cfg: Config) -> str:
    """Run one training run to the end, restarted if its learner or store dies; its run id."""
    return recovery.supervise(cfg, _run)


def _run(cfg: Config) -> str:
    import ray

    startup = StartClock()  # the first step's perf/model_build_s, warm_start_s, actor_start_s
    prompts = Prompts(cfg)  # bad data fails first
    run_dir, run_row = run_folder.start_run(cfg)  # resuming: cut back to its checkpoint
    cfg = run_folder.plain(cfg)  # final from here on
    model_path = model_paths.policy_path(cfg, startup)
    with startup.timed("actor_start"):  # Ray, then its actors, each loading the policy
        store, learner, workers = cluster.start_actors(cfg, model_path, run_dir, run_row)
    progress = Progress(cfg)
    status = "failed"
    try:
        start = checkpoint.restore(cfg, run_dir, learner, workers, prompts)
        window = Window(cfg, workers, prompts, start)

        def log(step: int, metrics: dict[str, float], sent: PendingStep) -> None:
            # ---- log: the single writer stores segments, tokens, gate decisions and metrics
            store.write_step.remote(step, startup.into(metrics), sent.rows, *sent.segment_refs)
            faults.nonfinite_loss(cfg, step, metrics)  # stops the run before a checkpoint
            evaluate.at_step(cfg, workers, store, step, sent.weights)  # ---- before the checkpoint
            checkpoint.maybe_save(cfg, run_dir, step, learner, store, window.data_state())
            progress.update(metrics)

        trailing = Trailing(cfg, log)  # logs a step once its metrics are in, as the next trains
        for step in window.steps():
            # ---- generate and score: the oldest batch, sampled up to async_depth versions ago
            oldest = trailing.before(window.oldest())
            with trailing.timed("rollout"):
                segment_refs = faults.collect(oldest, step, cfg, store, learner, workers, prompts)
            # ---- gate, train (version += minibatches), sync the new weights to the next batch
            metrics, rows, weights = learner.step.options(num_returns=3).remote(*segment_refs)
            trailing.after(step, metrics, rows, segment_refs, window.sync(weights, learner))
        trailing.flush()
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except ray.exceptions.RayActorError as error:  # learner or store died; workers: faults.py
        raise faults.died(error, cfg.run.id, store, learner) from error
    finally:
        progress.close()
        cluster.stop_actors(cfg.run.id, status, store, learner, workers)
    return cfg.run.id
