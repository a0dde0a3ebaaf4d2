"""What the loop stands on: the run folder, the policy checkpoint, Ray, the actors and the data.

Everything with a side effect that `loop.py` calls lives here, so the loop itself reads as the
list of calls it is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from workbench.config import REPO_ROOT, ConfigError
from workbench.rollout import Job


class RunFailed(RuntimeError):
    """A fault the run cannot ride out (its learner or store died, every rollout batch lost): one sentence
    naming it and the way on; the run is marked failed and keeps what it wrote."""


def run_failed(cause: str, run_id: str, fix: str = "") -> RunFailed:
    """`cause`, then what became of the run and how it goes on (`fix` first, when given)."""
    return RunFailed(
        f"{cause}: the run is marked failed and keeps every step it wrote; {fix}continue it from its "
        f"latest checkpoint with: molt-wb resume {run_id}"
    )


def died(error, run_id: str, store, learner) -> RunFailed:
    """The `RunFailed` of an actor's death (`error`, a RayActorError) that the loop cannot ride out."""
    role = {store._actor_id.hex(): "The store", learner._actor_id.hex(): "The learner"}.get(
        error.actor_id, "A rollout worker"
    )
    return run_failed(
        f"{role} process died (killed, out of memory or crashed; Ray's worker logs say which)",
        run_id,
    )


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def code_version() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def start_run(cfg) -> tuple[Path, dict]:
    """Give the run an id, create its folder, save the resolved config; return (folder, runs row)."""
    from omegaconf import OmegaConf, open_dict

    if cfg.run.resume:
        from workbench.checkpoint import reopen

        return reopen(cfg)
    with open_dict(cfg):
        cfg.run.id = cfg.run.id or new_run_id()
    run_dir = Path(cfg.run.root) / cfg.run.id
    if (run_dir / "run.json").exists():
        raise ConfigError(
            f"Run {cfg.run.id} already exists under {cfg.run.root}/: pick another run.id or leave it unset."
        )
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    row = {
        "run_id": cfg.run.id,
        "recipe": cfg.recipe,
        "status": "running",
        "created": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "code_version": code_version(),
        "sweep_id": cfg.run.sweep_id,
        "swept": dict(cfg.run.swept),
        "steps_done": 0,
        "steps": cfg.trainer.steps,
        "reward_mean": None,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    return run_dir, row


def plain(cfg):
    """The run's final config as its `Config` dataclasses: an OmegaConf node's attribute read costs
    ~20 us, about 1 ms a step each in the driver and the learner (bench/README.md)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def record_refused(cfg, error: str) -> None:
    """A sweep job refused before it started still gets its run row (status failed, with the sentence)."""
    from workbench.store.writer import write_json_atomic

    with contextlib.suppress(ConfigError, OSError):  # a run that started has its row already
        run_dir, row = start_run(cfg)
        write_json_atomic(run_dir / "run.json", row | {"status": "failed", "error": error})


def policy_path(cfg) -> str:
    """The checkpoint every actor loads: model.path, or the tiny model (warm-started if the recipe says so)."""
    from workbench.api import load_plugin
    from workbench.models.tiny import tiny_model_path
    from workbench.models.warm_start import warm_started_path

    if cfg.run.resume:
        from workbench.checkpoint import latest

        return str(latest(Path(cfg.run.root) / cfg.run.id) / "policy")
    if cfg.model.path:
        return str(cfg.model.path)
    path = tiny_model_path(cfg.model.name)
    if cfg.model.warm_start_steps:
        plugin = load_plugin(cfg.agent.plugin)
        plugin = getattr(
            plugin, "WARM_START_AS", plugin
        )  # a ChatAgent plugin names the Env plugin it shares demos with
        path = warm_started_path(
            path,
            plugin,
            Path(plugin.__file__).read_text(),
            cfg.model.warm_start_steps,
            cfg.model.warm_start_lr,
            cfg.seed,
            cfg.model.warm_start_batch,
        )
    return str(path)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops a run like Ctrl-C: flushed, marked interrupted


def teacher_path(cfg) -> str:
    """The frozen teacher of on-policy distillation: algo.teacher_path, or the tiny base model warm-started
    `algo.teacher_warm_start_steps` steps on the plugin (it shares the policy's tokenizer)."""
    from workbench.api import load_plugin
    from workbench.models.tiny import tiny_model_path
    from workbench.models.warm_start import warm_started_path

    if cfg.algo.teacher_path:
        return str(cfg.algo.teacher_path)
    plugin = load_plugin(cfg.agent.plugin)
    return str(
        warm_started_path(
            tiny_model_path(cfg.model.name),
            plugin,
            Path(plugin.__file__).read_text(),
            cfg.algo.teacher_warm_start_steps,
            cfg.model.warm_start_lr,
            cfg.seed,
        )
    )


def init_ray(cfg) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        _start_ray(cfg)
    if (
        threading.current_thread() is threading.main_thread()
    ):  # after ray.init, which sets its own handler
        signal.signal(signal.SIGTERM, _interrupt)


def _start_ray(cfg) -> None:
    import ray

    runtime_env = {
        "env_vars": {
            "PYTHONPATH": str(REPO_ROOT),
            "MOLT_WB_CACHE": os.environ.get("MOLT_WB_CACHE", ""),
            # idle OpenMP threads sleep instead of spinning: actors share the cores (bench/README.md)
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
    }
    if (
        cfg.ray.address
    ):  # a cluster's nodes share the repository and the model cache at the same paths
        ray.init(
            address=cfg.ray.address,
            log_to_driver=False,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
        )
        return
    cpus = cfg.ray.num_cpus or max(
        os.cpu_count() or 1, (cfg.ray.rollout_workers + 1) * cfg.sweep.parallel
    )
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.WARNING,
        _node_ip_address="127.0.0.1",
        object_store_memory=cfg.ray.object_store_mb * 2**20,
        runtime_env=runtime_env,
    )


class StoreActor:
    """The single writer of runs/<id>/ and the fan-out to W&B / MLflow."""

    def __init__(self, cfg, run_dir: str, run_row: dict):
        from workbench.store.writer import RunWriter
        from workbench.tracking import make_sinks

        self.run_id = cfg.run.id
        self.writer = RunWriter(run_dir, run_row, cfg.run.flush_rows, cfg.run.flush_seconds)
        if cfg.run.flush_seconds > 0:
            self.writer.flush_every(cfg.run.flush_seconds)
        self.sinks = make_sinks(
            cfg.tracking, run_dir, cfg.run.id, run_row["config"], group=cfg.run.sweep_id
        )
        self.cpu_mark = time.process_time()

    def write_step(self, step: int, metrics: dict, rows: dict, *worker_segments) -> None:
        from workbench.store.schema import step_tables

        # perf/store_cpu_s: this process's CPU seconds (every thread) since the last step's: taking in the step's
        # records, building rows, flushing shards, the tracking sinks. Off the step's path, but on its cores
        cpu, self.cpu_mark = self.cpu_mark, time.process_time()
        metrics = dict(metrics, **{"perf/store_cpu_s": self.cpu_mark - cpu})
        segments = [s for batch in worker_segments for s in batch]
        self.writer.save_images([image for s in segments for image in s.images])
        for name, table in step_tables(
            self.run_id, step, rows["learner_version"], segments, rows
        ).items():
            self.writer.append(name, table)
        self.log(step, metrics)
        self.writer.update_run(
            at_flush=True,
            steps_done=int(metrics["train/version"]),
            reward_mean=metrics.get("reward/mean"),
        )
        self.writer.maybe_flush()

    def write_failures(self, step: int, rows: list[dict]) -> None:
        from workbench.store.schema import FAILED_EPISODES, rows_table

        self.writer.append("failed_episodes", rows_table(FAILED_EPISODES, self.run_id, step, rows))
        self.writer.maybe_flush()

    def checkpoint(self) -> dict[str, int]:
        """Flush, then the shards per table: a resume from this checkpoint deletes every shard past them."""
        self.writer.flush()
        return dict(self.writer.next_shard)

    def log(self, step: int, metrics: dict) -> None:
        import pyarrow as pa

        now = time.time()
        self.writer.append(
            "metrics",
            pa.table(
                {
                    "run_id": [self.run_id] * len(metrics),
                    "step": [step] * len(metrics),
                    "key": list(metrics),
                    "value": [float(v) for v in metrics.values()],
                    "time": [now] * len(metrics),
                }
            ),
        )
        for sink in self.sinks:
            sink.log(metrics, step)

    def write_eval(self, step: int, row: dict) -> None:
        """One held-out evaluation: a row of the `eval` table and the metrics eval/reward, eval/accuracy."""
        from workbench.evaluate import eval_tables

        for name, table in eval_tables(self.run_id, step, row).items():
            self.writer.append(name, table)
        for sink in self.sinks:
            sink.log({"eval/reward": row["mean_reward"], "eval/accuracy": row["accuracy"]}, step)

    def close(self, status: str) -> None:
        self.writer.close(status)
        for sink in self.sinks:
            sink.close(status)


def placement(cfg) -> list[dict]:
    """Ray options of the learner (first) and each rollout worker: resources by config, and with
    `ray.colocate` one bundle each in a STRICT_PACK placement group (one node, shared GPUs)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    r = cfg.ray
    learner = {"num_cpus": r.learner_cpus, "num_gpus": r.learner_gpus}
    worker = {
        "num_cpus": r.rollout_cpus,
        "num_gpus": r.rollout_gpus,
        "resources": dict(r.rollout_resources),
    }
    options = [learner] + [worker] * r.rollout_workers
    if not r.colocate:
        return options
    bundles = [
        {
            k: v
            for k, v in {
                "CPU": o["num_cpus"],
                "GPU": o["num_gpus"],
                **o.get("resources", {}),
            }.items()
            if v
        }
        for o in options
    ]
    group = ray.util.placement_group(bundles, strategy="STRICT_PACK", name=f"molt-wb-{cfg.run.id}")
    ray.get(group.ready(), timeout=600)
    return [
        dict(
            o,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i
            ),
        )
        for i, o in enumerate(options)
    ]


def start_actors(cfg, model_path: str, run_dir: Path, run_row: dict):
    """(store, learner, rollout workers) as Ray actors, placed by `ray.*`; the store takes no CPU slot.
    The run row records the node of each (`placement`)."""
    import ray

    from workbench.learner import Learner
    from workbench.rollout import RolloutWorker

    store = ray.remote(num_cpus=0)(StoreActor).remote(cfg, str(run_dir), run_row)
    learner_options, *worker_options = placement(cfg)
    learner = ray.remote(Learner).options(**learner_options).remote(cfg, model_path)
    worker_cls = ray.remote(
        max_concurrency=cfg.trainer.async_depth + 2, max_restarts=cfg.rollout.max_restarts
    )(RolloutWorker)  # + weight pushes
    workers = [
        worker_cls.options(**options).remote(cfg, model_path, i)
        for i, options in enumerate(worker_options)
    ]
    nodes = ray.get(
        [
            a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            for a in (learner, *workers)
        ]
    )
    ray.get(
        store.__ray_call__.remote(
            lambda s: s.writer.update_run(
                placement={"learner": nodes[0], "rollout_workers": nodes[1:]}
            )
        )
    )
    return store, learner, workers


def stop_actors(run_id: str, status: str, store, learner, workers) -> None:
    """Close the store (flush, final status), then free every actor's slot for the next run."""
    import ray

    try:
        ray.get(store.close.remote(status), timeout=120)
    except (
        ray.exceptions.RayActorError
    ) as error:  # the store died; when the run failed already, that error stands
        if status != "failed":
            raise died(error, run_id, store, learner) from error
    finally:
        group = None
        with contextlib.suppress(Exception):  # a dead learner has no group to report
            group = ray.get(
                learner.__ray_call__.remote(lambda _: ray.util.get_current_placement_group()),
                timeout=60,
            )
        for actor in (store, learner, *workers):
            ray.kill(actor)
        if group is not None:  # a colocated run's placement group
            ray.util.remove_placement_group(group)


class Prompts:
    """Epochs over the data in a seeded order; each step gets `prompts_per_step` groups of jobs.
    A data set that is empty or that the plugin cannot read is refused here, before anything starts."""

    def __init__(self, cfg):
        from workbench.api import load_plugin

        plugin = load_plugin(cfg.agent.plugin)
        try:
            if cfg.data.path:  # the plugin's own reader when it has one (images, real-set layouts), else plain rows
                self.samples = (
                    plugin.load_dataset(cfg.data.path)
                    if hasattr(plugin, "load_dataset")
                    else load_samples(cfg.data.path)
                )
            else:
                self.samples = plugin.make_dataset(cfg.data.size, cfg.seed)
        except ValueError as error:  # the plugin's readers and load_samples name the problem
            raise ConfigError(str(error)) from None
        check_samples(self.samples, plugin, cfg.data.path or f"{cfg.agent.plugin}.make_dataset")
        self.rng, self.order, self.cursor = random.Random(cfg.seed), [], 0
        self.per_step, self.group_size = cfg.trainer.prompts_per_step, cfg.trainer.group_size
        self.next_group = self.next_rollout = 0

    def next_jobs(self, workers: int) -> list[list[Job]]:
        """This step's jobs, split into one list per worker (a group never straddles two workers)."""
        groups = []
        for _ in range(self.per_step):
            if self.cursor == len(self.order):
                self.order, self.cursor = (
                    self.rng.sample(range(len(self.samples)), len(self.samples)),
                    0,
                )
            sample, self.cursor = self.samples[self.order[self.cursor]], self.cursor + 1
            groups.append(
                [
                    Job(sample, self.next_group, self.next_rollout + k)
                    for k in range(self.group_size)
                ]
            )
            self.next_group, self.next_rollout = (
                self.next_group + 1,
                self.next_rollout + self.group_size,
            )
        return [[job for group in groups[w::workers] for job in group] for w in range(workers)]

    def state(self) -> dict:
        """The data position (what a checkpoint saves): order of sample indices, cursor, next ids, RNG."""
        return {
            "rng": self.rng.getstate(),
            "order": list(self.order),
            "cursor": self.cursor,
            "next_group": self.next_group,
            "next_rollout": self.next_rollout,
        }

    def restore(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order, self.cursor = list(state["order"]), state["cursor"]
        self.next_group, self.next_rollout = state["next_group"], state["next_rollout"]


def check_samples(samples: list, plugin, where: str) -> None:
    """Refuse an empty data set, or one whose first row the plugin cannot start an episode on."""
    from workbench.api import ChatAgent

    if not samples:
        raise ConfigError(f"Data set {where} has no samples: give a file with at least one row.")
    if not all(isinstance(sample, dict) for sample in samples):
        raise ConfigError(
            f"Data set {where} holds rows that are not objects: give one JSON object (or table row) per sample."
        )
    runner = plugin.AgentRunner
    if isinstance(runner, type) and issubclass(runner, ChatAgent):
        if not any(key in samples[0] for key in ("prompt", "problem")):
            raise ConfigError(
                f"Data set {where} has no prompt or problem column that a ChatAgent reads: add one."
            )
        return
    try:
        runner().reset(samples[0])
    except KeyError as error:
        raise ConfigError(
            f"Data set {where} has no {error} column, which plugin {plugin.__name__} reads: "
            f"add it to every row or choose the matching agent.plugin."
        ) from None


def load_samples(path: str) -> list[dict]:
    """Rows of a local .parquet or .jsonl file (validate() has checked it exists); ValueError names a bad file."""
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (OSError, pa.ArrowException) as error:
            raise ValueError(
                f"Data set {path} is not a readable Parquet file ({error}): rewrite it."
            ) from None
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(
            f"Data set {path} is not JSON lines ({error}): write one JSON object per line."
        ) from None


class StepClock:
    """Wall time of the phases of a step, as `perf/` metrics."""

    def __init__(self):
        self.start = self.mark = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self.mark = now - self.mark, now

    def metrics(self, metrics: dict) -> dict:
        total = time.perf_counter() - self.start
        perf = {f"perf/{phase}_s": seconds for phase, seconds in self.phases.items()}
        perf.update(
            {
                "perf/step_s": total,
                "perf/tokens_per_s": metrics.get("rollout/sampled_tokens", 0) / max(total, 1e-9),
            }
        )
        return dict(metrics, **perf)


class Progress:
    """A rich progress bar with step, reward and tokens/s; one line per step when not a terminal; nothing when off."""

    def __init__(self, cfg):
        import sys

        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as Bar,
        )

        self.bar, self.enabled = None, cfg.run.progress
        if self.enabled and sys.stdout.isatty():
            self.bar = Bar(
                TextColumn(f"[bold]{cfg.run.id}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self.task = self.bar.add_task("train", total=cfg.trainer.steps, info="")
            self.bar.start()
        self.done = 0

    def update(self, metrics: dict) -> None:
        self.done = int(metrics["train/version"])
        info = f"reward {metrics['reward/mean']:.3f}  {metrics['perf/tokens_per_s']:.0f} tok/s"
        if self.bar:
            self.bar.update(self.task, completed=self.done, info=info)
        elif self.enabled:
            print(f"step {self.done}: {info}", flush=True)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
