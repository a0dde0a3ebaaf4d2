"""The RL loop: generate, score, gate, train, sync, log — one rollout batch per iteration. Data
flows one way (rollout -> learner -> store); only weights and their version flow back, to rollouts
up to `trainer.async_depth` versions behind (window.py; the version gate corrects for it)."""

from workbench import checkpoint, cluster, evaluate, faults, model_paths, recovery, run_folder
from workbench.data import Prompts
from workbench.progress import Progress, StepClock
from workbench.window import Window


def train(cfg):
    """Run one training run to the end, restarted if its learner or store dies; its run id."""
    return recovery.supervise(cfg, _run)


def _run(cfg):
    import ray

    prompts = Prompts(cfg)  # bad data fails first
    run_dir, run_row = run_folder.start_run(cfg)  # resuming: cut back to its checkpoint
    cfg = run_folder.plain(cfg)  # final from here on
    model_path = model_paths.policy_path(cfg)
    cluster.init_ray(cfg)
    store, learner, workers = cluster.start_actors(cfg, model_path, run_dir, run_row)
    progress = Progress(cfg)
    status = "failed"
    # the step whose metrics the driver waits on
    finishing = None
    try:
        start = checkpoint.restore(cfg, run_dir, learner, workers, prompts)
        window = Window(cfg, workers, prompts, start)
        clock = StepClock()

        def finish(step, phases, outputs, segments, weights):
            """Fetch a step's metrics, store its records, checkpoint and evaluate when due."""
            nonlocal finishing
            finishing = step
            with clock.timed(phases, "train"):  # the learner
                metrics = ray.get(outputs[0], timeout=cfg.trainer.timeout_s)
            metrics = clock.metrics(metrics, phases)
            # ---- log: the single writer stores segments, tokens, gate decisions and metrics
            store.write_step.remote(step, metrics, outputs[1], *segments)
            checkpoint.maybe_save(cfg, run_dir, step, learner, store, window.data_state())
            progress.update(metrics)
            evaluate.at_step(cfg, workers, store, step, weights)  # ---- every eval.every steps

        # a step is finished once the next one's batch went to the learner, which so never waits
        # on the driver, or while that batch is not there yet; at once when it checkpoints or
        # evaluates (or is the last)
        pending = None
        for step in window.steps():
            phases = {}
            rollout = window.oldest()
            if pending and not rollout.delivered():
                finish(*pending)
                pending = None
            # ---- generate and score: the oldest batch, sampled up to async_depth versions ago
            with clock.timed(phases, "rollout"):
                segments = faults.collect(rollout, step, cfg, store, learner, workers, prompts)
            # ---- gate, train (version += minibatches), sync the new weights to the next batch
            outputs = learner.step.options(num_returns=3).remote(*segments)
            weights = window.sync(outputs[2], learner)
            if pending:
                finish(*pending)
            pending = (step, phases, outputs, segments, weights)
            if due(cfg, step) or step + 1 == window.end:
                finish(*pending)
                pending = None
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except ray.exceptions.RayActorError as error:  # learner or store died; workers: faults.py
        raise faults.died(error, cfg.run.id, store, learner) from error
    except ray.exceptions.GetTimeoutError as error:
        raise faults.learner_timeout(finishing, cfg) from error
    finally:
        progress.close()
        cluster.stop_actors(cfg.run.id, status, store, learner, workers)
    return cfg.run.id


def due(cfg, step):
    """Does loop step `step` checkpoint or evaluate?"""
    every = (cfg.trainer.checkpoint_every, cfg.eval.every)
    return any(n and (step + 1) % n == 0 for n in every)
