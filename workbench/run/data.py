"""The data order: which samples a run trains on and in what order; a new data format, a check of a
data set, or a change to how each step's prompts are drawn goes here.

Samples are drawn in epochs, each in a seeded order, and the position in that order is what a
checkpoint saves, so a resumed run draws the same prompts as an uninterrupted one.
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from workbench.api import ChatAgent, load_plugin
from workbench.config import ConfigError
from workbench.rollout.worker import Job


class Prompts:
    """Epochs over the data in a seeded order; each step gets `prompts_per_step` groups of jobs.
    A data set that is empty or that the plugin cannot read is refused here, before anything
    starts."""

    def __init__(self, cfg):
        plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs)
        try:
            if cfg.data.path:
                # the plugin's own reader when it has one (images, real-set layouts), else
                # plain rows
                reader = getattr(plugin, "load_dataset", load_samples)
                self.samples = reader(cfg.data.path)
            else:
                self.samples = plugin.make_dataset(cfg.data.size, cfg.seed)
        # the plugin's readers and load_samples name the problem
        except ValueError as error:
            raise ConfigError(str(error)) from None
        check_samples(self.samples, plugin, cfg.data.path or f"{cfg.agent.plugin}.make_dataset")
        self.rng = random.Random(cfg.seed)
        self.order = []
        self.cursor = 0
        self.per_step = cfg.trainer.prompts_per_step
        self.group_size = cfg.trainer.group_size
        self.next_group = 0
        self.next_rollout = 0

    def next_jobs(self, workers):
        """This step's jobs, split into one list per worker (a group never straddles two
        workers)."""
        jobs = [[] for _ in range(workers)]
        for index in range(self.per_step):
            if self.cursor == len(self.order):
                self.order = self.rng.sample(range(len(self.samples)), len(self.samples))
                self.cursor = 0
            sample = self.samples[self.order[self.cursor]]
            self.cursor += 1
            rollout_ids = range(self.next_rollout, self.next_rollout + self.group_size)
            # the groups go round the workers
            jobs[index % workers] += [
                Job(sample, self.next_group, rollout_id) for rollout_id in rollout_ids
            ]
            self.next_group += 1
            self.next_rollout += self.group_size
        return jobs

    def state(self):
        """The data position (what a checkpoint saves): order of sample indices, cursor, next ids,
        RNG."""
        return {
            "rng": self.rng.getstate(),
            "order": list(self.order),
            "cursor": self.cursor,
            "next_group": self.next_group,
            "next_rollout": self.next_rollout,
        }

    def restore(self, state):
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
        self.cursor = state["cursor"]
        self.next_group = state["next_group"]
        self.next_rollout = state["next_rollout"]


def check_samples(samples, plugin, where):
    """Refuse an empty data set, or one whose first row the plugin cannot start an episode on."""
    if not samples:
        raise ConfigError(f"Data set {where} has no samples: give a file with at least one row.")
    if not all(isinstance(sample, dict) for sample in samples):
        raise ConfigError(
            f"Data set {where} holds rows that are not objects: give one JSON object (or table "
            f"row) per sample."
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


def load_samples(path):
    """Rows of a local .parquet or .jsonl file (validate() has checked it exists); ValueError names
    a bad file."""
    if path.endswith(".parquet"):
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
