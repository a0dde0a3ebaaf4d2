"""Ray and the run's actors: how Ray starts, where the learner and the rollout workers are placed,
and how every actor starts and stops change here.

The store, the learner and the rollout workers are Ray actors; `ray.*` keys give each its
resources, and `ray.colocate` packs them on one node in a placement group that shares its GPUs.
"""

import contextlib
import logging
import math
import os
import signal
import threading
from pathlib import Path

from workbench.config import REPO_ROOT, ConfigError
from workbench.learner.transport import free_address, join_weight_group
from workbench.models.tiny import cache_root
from workbench.rollout.worker import RolloutWorker
from workbench.run import model_paths
from workbench.run.faults import died, run_failed
from workbench.store.actor import StoreActor


def init_ray(cfg, sized_for: list | None = None):
    """Start Ray (a local one sized for the largest of `sized_for`, or join `ray.address`) unless it
    runs, and refuse a run it cannot hold; SIGTERM then stops a run like Ctrl-C."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray runs its workers at nice 15, so any other busy process on the machine starves the
    # learner and the rollout workers (two busy loops made a 22 s step take 594 s); the run's
    # actors compete at the driver's priority instead
    os.environ.setdefault("RAY_worker_niceness", "0")
    if not ray.is_initialized():
        _start_ray(cfg, ray_cpus(sized_for or [cfg]))
    # a cluster (ray.address) may grow: nodes join, an autoscaler adds them
    if not joined(cfg):
        _refuse_too_big(cfg, ray.cluster_resources())
    # after ray.init, which sets its own handler
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def joined(cfg) -> str:
    """The address of the Ray a run joins: `ray.address`, else RAY_ADDRESS (the variable Ray's own
    tools read); empty when the run starts a local Ray of its own."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS", "")


def asked(cfg):
    """The CPUs and GPUs one run's learner and rollout workers ask Ray for."""
    r = cfg.ray
    return {
        "CPU": r.learner_cpus * r.learner_workers + r.rollout_cpus * r.rollout_workers,
        "GPU": r.learner_gpus * r.learner_workers + r.rollout_gpus * r.rollout_workers,
    }


def ray_cpus(configs: list):
    """CPUs for a local Ray: the machine's, or enough for `sweep.parallel` of the largest run."""
    largest = max(asked(cfg)["CPU"] for cfg in configs)
    return configs[0].ray.num_cpus or max(
        os.cpu_count() or 1, math.ceil(largest * configs[0].sweep.parallel)
    )


def _refuse_too_big(cfg, resources: dict):
    # a local Ray queues an actor it has no room for forever: a run larger than it never starts
    for name, amount in asked(cfg).items():
        has = resources.get(name, 0)
        if amount > has:
            raise ConfigError(
                f"This run asks Ray for {amount:g} {name}s (ray.learner_* x ray.learner_workers "
                f"+ ray.rollout_* x ray.rollout_workers) but the Ray this process started has "
                f"{has:g}: start it in a new process, or lower ray.rollout_workers."
            )


def _interrupt(signum, frame):
    # SIGTERM stops a run like Ctrl-C: flushed, marked interrupted
    raise KeyboardInterrupt


def actor_env():
    """The environment every actor starts with: the driver's repository and model cache."""
    return {
        "PYTHONPATH": str(REPO_ROOT),
        "MOLT_WB_CACHE": str(cache_root()),
        # idle OpenMP threads sleep instead of spinning: actors share the cores (bench/README.md)
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    }


def _start_ray(cfg, cpus: int):
    import ray

    # a cluster's nodes share the repository and the model cache at the same paths
    where = {"address": joined(cfg)}
    if not where["address"]:
        where = dict(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=cfg.ray.object_store_mb * 2**20,
        )
    ray.init(
        **where,
        log_to_driver=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": actor_env()},
    )


def placement(cfg):
    """Ray options of each learner rank (first) and each rollout worker: resources by config; with
    `ray.colocate` one bundle each in a STRICT_PACK placement group (one node, shared GPUs), else
    several learner ranks one bundle each in a PACK group (as few nodes as they fit)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    r = cfg.ray
    learner = {"num_cpus": r.learner_cpus, "num_gpus": r.learner_gpus}
    worker = {
        "num_cpus": r.rollout_cpus,
        "num_gpus": r.rollout_gpus,
        "resources": dict(r.rollout_resources),
    }
    options = [learner] * r.learner_workers + [worker] * r.rollout_workers
    grouped = len(options)
    strategy = "STRICT_PACK"
    if not r.colocate:
        grouped = r.learner_workers if r.learner_workers > 1 else 0
        strategy = "PACK"
    if not grouped:
        return options
    bundles = [_bundle(o) for o in options[:grouped]]
    group = ray.util.placement_group(bundles, strategy=strategy, name=f"molt-wb-{cfg.run.id}")
    ray.get(group.ready(), timeout=600)
    return [
        dict(
            o,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i
            ),
        )
        for i, o in enumerate(options[:grouped])
    ] + options[grouped:]


def _bundle(options: dict):
    """The placement-group bundle of one actor's Ray options: the resources it asks for."""
    asked = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options.get("resources", {})}
    return {name: amount for name, amount in asked.items() if amount}


def start_actors(cfg, model_path: str, run_dir: Path, run_row: dict):
    """(store, learner, rollout workers) as Ray actors, placed by `ray.*`; the store takes no CPU
    slot. The run row records the node of each (`placement`); Ray is started first if it is not
    up."""
    import ray

    init_ray(cfg)
    store = ray.remote(num_cpus=0)(StoreActor).remote(cfg, str(run_dir), run_row)
    options = placement(cfg)
    learner = start_learner(cfg, model_path, options[: cfg.ray.learner_workers])
    # the batches in flight (at most async_depth + 1) and the weight pushes; a restarted worker
    # joins a new collective weight group (faults.collect, window.sync)
    worker_cls = ray.remote(
        max_concurrency=cfg.trainer.async_depth + 2, max_restarts=cfg.rollout.max_restarts
    )(RolloutWorker)
    workers = [
        worker_cls.options(**placed).remote(cfg, model_path, i)
        for i, placed in enumerate(options[cfg.ray.learner_workers :])
    ]
    nodes = ray.get(
        [
            a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            for a in (*learner_actors(learner), *workers)
        ]
    )
    if cfg.ray.weight_transport == "collective":
        join_weight_group(cfg, learner, workers)
    ray.get(
        store.__ray_call__.remote(
            lambda s: s.writer.update_run(
                placement={
                    "learner": nodes[0],
                    "learner_ranks": nodes[: cfg.ray.learner_workers],
                    "rollout_workers": nodes[cfg.ray.learner_workers :],
                }
            )
        )
    )
    return store, learner, workers


def start_learner(cfg, model_path: str, options: list[dict]):
    """The learner actor; with several ranks, their actors joined in one process group at a free
    port of rank 0's node, answering as one (`LearnerRanks`)."""
    import ray

    from workbench.learner.learner import Learner

    # built here, once for every rank
    teacher = model_paths.teacher_path(cfg)
    if len(options) == 1:
        return ray.remote(Learner).options(**options[0]).remote(cfg, model_path, teacher=teacher)
    # several ranks are always placed in a group (`placement`)
    where = options[0]["scheduling_strategy"]
    address = ray.get(
        ray.remote(num_cpus=0)(free_address).options(scheduling_strategy=where).remote()
    )
    actors = [
        ray.remote(Learner).options(**rank_options).remote(cfg, model_path, rank, address, teacher)
        for rank, rank_options in enumerate(options)
    ]
    return LearnerRanks(actors, cfg)


def learner_actors(learner):
    """The learner's actors: its ranks, or the one."""
    return getattr(learner, "actors", [learner])


def stop_actors(run_id: str, status: str, store, learner, workers):
    """Close the store (flush, final status), then free every actor's slot for the next run."""
    import ray

    try:
        ray.get(store.close.remote(status), timeout=120)
    # the store died; when the run failed already, that error stands
    except ray.exceptions.RayActorError as error:
        if status != "failed":
            raise died(error, run_id, store, learner) from error
    finally:
        for actor in (store, *learner_actors(learner), *workers):
            ray.kill(actor)
        # a run with a placement group (`placement`)
        with contextlib.suppress(ValueError):
            ray.util.remove_placement_group(ray.util.get_placement_group(f"molt-wb-{run_id}"))


class LearnerRanks:
    """The learner's N Ray actors as one handle: `ranks.method.remote(...)` calls it on every
    rank (they run its collectives together) and answers with rank 0's result once the others
    have answered: another rank's exception stops the run at once (rank 0 would wait for that rank
    in a collective until trainer.timeout_s)."""

    def __init__(self, actors: list, cfg):
        self.actors = actors
        self.cfg = cfg

    def __getattr__(self, name: str):
        return _EveryRank(self, name, {})


class _EveryRank:
    def __init__(self, ranks: LearnerRanks, name: str, options: dict):
        self.ranks = ranks
        self.name = name
        self.options_ = options

    def options(self, **options):
        return _EveryRank(self.ranks, self.name, options)

    def remote(self, *args, **kwargs):
        import ray

        refs = [
            getattr(actor, self.name).options(**self.options_).remote(*args, **kwargs)
            for actor in self.ranks.actors
        ]
        firsts = [ref[0] if isinstance(ref, list) else ref for ref in refs]
        pending = firsts
        # the others wait on nothing but rank 0, which may wait on the driver's next calls (the
        # collective transport's receivers)
        while firsts[0] in pending and len(pending) > 1:
            # not pulled to this node while waiting: rank 0's answer may be the weights
            ready, pending = ray.wait(
                pending, timeout=self.ranks.cfg.trainer.timeout_s, fetch_local=False
            )
            if not ready:
                break
            try:
                ray.get(ready)
            except ray.exceptions.RayTaskError as error:
                cause = f"{type(error.cause).__name__}: {error.cause}"
                rank = firsts.index(ready[0])
                raise run_failed(
                    f"Learner rank {rank} raised {cause}", self.ranks.cfg.run.id
                ) from error
        return refs[0]
