"""Evaluation: the held-out split scored with its own sampling settings, during training or from
a checkpoint.

Each evaluation is one row of the run's `eval` table (run, step, checkpoint, split, n, mean reward,
accuracy) and the metrics `eval/reward` and `eval/accuracy` at that step. Nothing an evaluation
samples is trained on or stored as a segment.
"""

import os
import re
import time
from pathlib import Path

import pyarrow.parquet as pq

from workbench.api import load_plugin
from workbench.config import validate
from workbench.rollout.worker import Job, RolloutWorker
from workbench.run.checkpoint import latest, saved, saved_config
from workbench.run.data import load_samples
from workbench.run.model_paths import policy_path
from workbench.store.actor import eval_tables
from workbench.store.query import resolve_run


def eval_samples(cfg):
    """(split name, held-out samples): eval.path, else the plugin's eval_dataset, else make_dataset
    on another seed."""
    plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs)
    if cfg.eval.path:
        reader = getattr(plugin, "load_dataset", load_samples)
        return Path(cfg.eval.path).name, reader(cfg.eval.path)[: cfg.eval.size]
    if hasattr(plugin, "eval_dataset"):
        return "eval_dataset", plugin.eval_dataset(cfg.eval.size, cfg.seed)
    return "make_dataset", plugin.make_dataset(cfg.eval.size, cfg.seed + 7919)


def eval_jobs(cfg, samples, workers):
    """`eval.samples` episodes per held-out sample, split among the workers."""
    jobs = [
        Job(sample, -1 - g, -1 - (g * cfg.eval.samples + k))
        for g, sample in enumerate(samples)
        for k in range(cfg.eval.samples)
    ]
    return [jobs[w::workers] for w in range(workers)]


def score(rewards, threshold):
    """n, mean reward and accuracy (the fraction of episodes whose reward is at least
    `threshold`)."""
    n = len(rewards)
    return {
        "n": n,
        "mean_reward": sum(rewards) / max(n, 1),
        "accuracy": sum(r >= threshold for r in rewards) / max(n, 1),
    }


def at_step(cfg, workers, store, step, weights):
    """During training: every `eval.every` steps, score the step's `weights` on the held-out
    split."""
    import ray

    if not cfg.eval.every or (step + 1) % cfg.eval.every:
        return
    split, samples = eval_samples(cfg)
    rewards = ray.get(
        [
            w.evaluate.remote(jobs, cfg.eval, weights)
            for w, jobs in zip(workers, eval_jobs(cfg, samples, len(workers)), strict=True)
        ]
    )
    scored = score([r for worker in rewards for r in worker], cfg.eval.threshold)
    store.write_eval.remote(step, dict(scored, checkpoint="live", split=split))


def resolve_checkpoint(run_dir: Path, checkpoint):
    """(policy folder, learner version) of a checkpoint given as a folder, a version number
    (step-NNNNNN) or nothing (the latest one); (None, 0) when the run has no checkpoint and none
    was asked for (the starting policy)."""
    if checkpoint is None:
        found = latest(run_dir)
        if found is None:
            return None, 0
        path = found / "policy"
    elif checkpoint.isdigit():
        path = run_dir / "checkpoints" / f"step-{int(checkpoint):06d}" / "policy"
        if not path.exists():
            steps = ", ".join(str(int(p.name[5:])) for p in saved(run_dir)) or "none"
            raise ValueError(
                f"Run {run_dir.name} has no checkpoint at step {checkpoint} (saved steps: "
                f"{steps}); give one of those."
            )
    else:
        path = Path(checkpoint)
        if (path / "policy").is_dir():
            path = path / "policy"
        # a LoRA checkpoint's policy is its adapter (models/lora.py)
        if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
            raise ValueError(
                f"Checkpoint {checkpoint} is not a Hugging Face checkpoint folder (no "
                f"config.json): give a checkpoints/step-NNNNNN/policy folder or a step number."
            )
    match = re.search(r"step-(\d{6})", str(path))
    return path, int(match.group(1)) if match else 0


def from_checkpoint(run_id, checkpoint=None, root="runs", overrides=()):
    """`molt-wb eval`: score a checkpoint of a run on its held-out split, without training; the
    result joins the run's store."""
    run_dir = resolve_run(run_id, root)
    cfg = saved_config(run_dir, list(overrides))
    validate(cfg)
    path, version = resolve_checkpoint(run_dir, checkpoint)
    # the loop step whose weights these are; -1 = the starting policy
    step = version // cfg.trainer.minibatches - 1
    model_path = str(path) if path else policy_path(cfg)
    split, samples = eval_samples(cfg)
    adapter = path and Path(path, "adapter_model.safetensors")
    if adapter and adapter.exists():
        from safetensors.torch import load_file

        # a LoRA checkpoint: the run's base, the adapter pushed onto it
        worker = RolloutWorker(cfg, policy_path(cfg))
        worker.engine.load_weights(load_file(adapter), version)
    else:
        worker = RolloutWorker(cfg, model_path)
    rewards = worker.evaluate(eval_jobs(cfg, samples, 1)[0], cfg.eval)
    row = dict(score(rewards, cfg.eval.threshold), checkpoint=model_path, split=split, step=step)
    # a shard of its own, written whole; not part-*: the writer and resume leave it be
    for name, table in eval_tables(run_dir.name, step, row).items():
        final = run_dir / name / f"eval-{time.time_ns()}.parquet"
        final.parent.mkdir(exist_ok=True)
        pq.write_table(table, final.with_name(f".{final.name}.tmp"))
        os.replace(final.with_name(f".{final.name}.tmp"), final)
    return row
