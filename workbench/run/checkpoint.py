"""Checkpoints and resume: a resumed run holds each row of its checkpointed prefix exactly once.

A checkpoint is written whole under `step-NNNNNN.tmp` and renamed into place, so the latest one is
never half-written. At a checkpoint the writer flushes and records how many shards each table
holds (its high-water marks); a resume deletes every shard past those marks before the writer
reopens the run, so rows written after the checkpoint are dropped and written again by the resumed
steps, with the same data, rollout ids and weight versions. A run with no checkpoint yet resumes
from step 0: every shard is deleted, as a fresh start with the same seed would find its folder. A
`.tmp` folder a death left behind is never a checkpoint, and a resume deletes it.

    runs/<id>/checkpoints/step-NNNNNN/  NNNNNN = optimizer steps done (the learner version)
      policy/      save_pretrained of the policy + its tokenizer / processor files
                   (loads like model.path; `molt-wb export` copies it)
      state/       model and optimizer state, torch.distributed.checkpoint: each learner rank
                   writes its shards; it loads into any number of ranks
      trainer.pt   learner version, loop step, data position, RNG states (python, numpy, torch)
      writer.json  Parquet shards per table at the checkpoint
"""

import json
import os
import random
import shutil
import socket
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from workbench.config import Config, ConfigError, validate
from workbench.run.window import batches
from workbench.store.query import _alive, resolve_run, run_row, run_seconds
from workbench.store.schema import TABLES


def saved(run_dir):
    """The complete checkpoints of a run, oldest first (a `.tmp` folder never counts)."""
    return sorted(Path(run_dir, "checkpoints").glob("step-" + "[0-9]" * 6))


def latest(run_dir):
    """The newest complete checkpoint of a run, or None."""
    done = saved(run_dir)
    return done[-1] if done else None


# ---- save: the learner writes its state (models/state.py); the driver names, publishes and prunes


def maybe_save(cfg, run_dir: Path, step, learner, store, data_state):
    """After loop step `step`: every `trainer.checkpoint_every` rollout batches and at the last
    one."""
    import ray

    every = cfg.trainer.checkpoint_every
    if not every or ((step + 1) % every and step + 1 != batches(cfg)):
        return None
    temporary = Path(run_dir, "checkpoints", f"step-{step:06d}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    # after this step's rows: the store runs its calls in order
    marks = store.checkpoint.remote()
    driver = {
        "step": step,
        "data": data_state,
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
    }
    version = ray.get(learner.save_checkpoint.remote(str(temporary), driver))
    return commit(cfg, run_dir, temporary, version, ray.get(marks))


def commit(cfg, run_dir: Path, temporary: Path, version, marks):
    """The checkpoint the learner wrote into `temporary`, with the writer's shard `marks`, renamed
    into place after its learner `version`; the oldest beyond `trainer.keep_checkpoints` deleted."""
    (temporary / "writer.json").write_text(json.dumps(marks))
    final = temporary.with_name(f"step-{version:06d}")
    # written before a crash and now again by the resumed run
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    # a resumed run keeps the checkpoint it started from: a rollout worker Ray restarts loads it
    # (the store wrote the row when it started, before this step's marks)
    started_from = run_row(run_dir).get("resumed_from")
    for old in saved(run_dir)[: -cfg.trainer.keep_checkpoints]:
        if old.name != started_from:
            shutil.rmtree(old)
    return final


# ---- resume


def resume_config(run_id: str, overrides: list[str]) -> DictConfig:
    """The saved config of run `run_id` with `overrides` on top, set to resume from its latest
    checkpoint, or from step 0 when it has none yet; ConfigError says why not."""
    root = next((o.split("=", 1)[1] for o in overrides if o.startswith("run.root=")), "runs")
    try:
        run_dir = resolve_run(run_id, root)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    checkpoint = latest(run_dir)
    row = run_row(run_dir)
    _refuse_resume(run_dir, checkpoint, row)
    try:
        cfg = saved_config(run_dir, overrides)
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"Bad override for a resume ({str(error).splitlines()[0]}): give key=value pairs of "
            f"the run's config."
        ) from None
    # resume continues with RL steps, which would take the supervised loss for its own
    if cfg.algo.policy_loss == "sft":
        start = f" with model.path={checkpoint}/policy" if checkpoint else ""
        raise ConfigError(
            f"Run {run_dir.name} is a molt-wb sft run, which resume cannot continue: start a new "
            f"one{start}."
        )
    cfg.run.id = run_dir.name
    cfg.run.root = root
    cfg.run.resume = True
    done = int(checkpoint.name.split("-")[1]) if checkpoint else 0
    if cfg.trainer.steps <= done:
        raise ConfigError(
            f"Run {run_dir.name} already has {done} of trainer.steps={cfg.trainer.steps} steps "
            f"checkpointed: resume it with a larger trainer.steps."
        )
    validate(cfg)
    return cfg


def _refuse_resume(run_dir: Path, checkpoint: Path | None, row: dict) -> None:
    """ConfigError when run `run_dir` (its latest `checkpoint` or None, its runs `row`) cannot be
    resumed: still running, no saved config, or finished (or a serve recording) with no
    checkpoint, which a start from step 0 would overwrite."""
    name = run_dir.name
    if row.get("status") == "running" and row.get("host") == socket.gethostname():
        if _alive(row.get("pid")):
            raise ConfigError(
                f"Run {name} is still running (pid {row.get('pid')}): stop it before resuming it."
            )
    if not (run_dir / "config.yaml").exists():
        raise ConfigError(
            f"Run {name} has no config.yaml in {run_dir}, so it cannot be resumed: start a new run."
        )
    if checkpoint is None and (row.get("status") == "finished" or row.get("recipe") == "serve"):
        raise ConfigError(
            f"Run {name} finished with no checkpoint in {run_dir}/checkpoints, so there is no "
            f"step to continue from: start a new run with trainer.checkpoint_every=N."
        )


def saved_config(run_dir: Path, overrides):
    """The config a run saved, with `overrides` (key=value) on top."""
    return OmegaConf.merge(
        OmegaConf.structured(Config),
        OmegaConf.load(run_dir / "config.yaml"),
        OmegaConf.from_dotlist(overrides),
    )


def reopen(run_dir: Path) -> dict:
    """Cut the run folder back to its latest checkpoint (shards past the writer's marks deleted;
    every shard when it has none yet) and drop the checkpoint writes a death cut short; its runs
    row, as of that checkpoint."""
    checkpoint = latest(run_dir)
    # no checkpoint yet: the run starts again from step 0, as a fresh start finds its folder
    marks = dict.fromkeys(TABLES, 0)
    if checkpoint:
        marks = json.loads((checkpoint / "writer.json").read_text())
    for table, count in marks.items():
        for shard in Path(run_dir, table).glob("*part-*"):
            if shard.name.startswith(".") or int(shard.name[5:11]) >= count:
                shard.unlink()
    # a write killed before its rename is never a checkpoint
    for partial in Path(run_dir, "checkpoints").glob("step-*.tmp"):
        shutil.rmtree(partial)
    row = run_row(run_dir)
    # a later session's resume: what the run ran so far is kept, and the time between the two
    # sessions left out of its wall time; an in-process recovery (the same pid) is run time
    if row.get("pid") != os.getpid():
        row = row | {"ran_s": run_seconds(row), "resumed_at": time.time()}
    return row | {
        "steps_done": int(checkpoint.name.split("-")[1]) if checkpoint else 0,
        "resumes": row.get("resumes", 0) + 1,
        "resumed_from": checkpoint.name if checkpoint else None,
    }


def restore(cfg, run_dir: Path, learner, workers, prompts) -> int:
    """The first loop step to run: 0 for a new run or one resumed before its first checkpoint;
    for a resumed one, the step after its checkpoint, with the learner's optimizer, version and
    RNG, the engines' weights and version, and the data position restored."""
    import ray
    import torch

    checkpoint = cfg.run.resume and latest(run_dir)
    if not checkpoint:
        return 0
    state = torch.load(checkpoint / "trainer.pt", weights_only=False, mmap=True)
    ray.get(learner.load_checkpoint.remote(str(checkpoint)))
    weights = learner.weights.remote()
    ray.get([worker.load_weights.remote(weights) for worker in workers])
    prompts.restore(state["data"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    return state["step"] + 1
