"""The store actor: the single writer of `runs/<id>/` during training and the fan-out to W&B /
MLflow; what a step, a failure or an evaluation writes to the store changes here.

It runs as a Ray actor that takes no CPU slot; the driver sends it each step's records without
waiting, and it runs its calls in order, so a checkpoint's shard marks follow that step's rows.
"""

import time

from workbench.store import nonfinite
from workbench.store.alarms import Alarms, health_metrics, stored_metrics
from workbench.store.schema import ALARMS, EVAL, FAILED_EPISODES, METRICS, rows_table, step_tables
from workbench.store.writer import RunWriter
from workbench.tracking import make_sinks


def eval_tables(run_id, step, row):
    """The `eval` row of one evaluation and its two metrics rows."""
    now = time.time()
    metrics = {"eval/reward": row["mean_reward"], "eval/accuracy": row["accuracy"]}
    metric_rows = [{"key": key, "value": value, "time": now} for key, value in metrics.items()]
    return {
        "eval": rows_table(EVAL, run_id, step, [dict(row, time=now)]),
        "metrics": rows_table(METRICS, run_id, step, metric_rows),
    }


class StoreActor:
    """The single writer of runs/<id>/ and the fan-out to W&B / MLflow."""

    def __init__(self, cfg, run_dir, run_row):
        self.run_id = cfg.run.id
        self.writer = RunWriter(run_dir, run_row, cfg.run.flush_rows, cfg.run.flush_seconds)
        if cfg.run.flush_seconds > 0:
            self.writer.flush_every(cfg.run.flush_seconds)
        self.sinks = make_sinks(
            cfg.tracking, run_dir, cfg.run.id, run_row["config"], group=cfg.run.sweep_id
        )
        self.cpu_mark = time.process_time()
        # the keys that held a non-finite value so far: each is warned about once
        self.nonfinite_keys = set()
        # the run-health rules, over the metrics stored so far (a resumed run's) and each step's
        self.alarm = cfg.alarm
        self.max_tokens = cfg.engine.max_tokens
        self.alarms = Alarms(cfg.alarm, stored_metrics(run_dir))

    def write_step(self, step, metrics, rows, *worker_segments):
        # perf/store_cpu_s: this process's CPU seconds (every thread) since the last step's: taking
        # in the step's records, building rows, flushing shards, the tracking sinks. Off the
        # step's path, but on its cores
        cpu_mark = time.process_time()
        metrics = metrics | {"perf/store_cpu_s": cpu_mark - self.cpu_mark}
        self.cpu_mark = cpu_mark
        segments = [s for batch in worker_segments for s in batch]
        self.writer.save_images([image for s in segments for image in s.images])
        # the alarms' derived metrics: turn lengths, and what plugins report of their episodes
        episodes = [
            {
                "rollout_id": s.rollout_id,
                "segment_idx": s.segment_idx,
                "turn_spans": s.turn_spans,
                "info": s.display.get("info"),
            }
            for s in segments
        ]
        metrics |= health_metrics(episodes, self.max_tokens, self.alarm.correctness_key)
        tables = step_tables(self.run_id, step, rows["learner_version"], segments, rows)
        # no silent NaN: every metric and float column counted as it is written
        counts = nonfinite.count(metrics, tables)
        metrics = metrics | nonfinite.audit_metrics(counts)
        # each key once, as an alarm the driver prints
        warned = [
            nonfinite.firing(key, counts[key])
            for key in sorted(counts.keys() - self.nonfinite_keys)
        ]
        self.nonfinite_keys |= counts.keys()
        self._append(tables)
        self.log(step, metrics, warned)
        self.writer.update_run(
            at_flush=True,
            steps_done=int(metrics["train/version"]),
            reward_mean=metrics.get("reward/mean"),
        )
        self.writer.maybe_flush()

    def write_failures(self, step, rows):
        self.writer.append("failed_episodes", rows_table(FAILED_EPISODES, self.run_id, step, rows))
        self.writer.maybe_flush()

    def checkpoint(self):
        """Flush, then the shards per table: a resume from this checkpoint deletes every shard past
        them."""
        self.writer.flush()
        return dict(self.writer.next_shard)

    def log(self, step, metrics, warned=()):
        """One step's metrics to the store and the sinks; the alarms they fire, and the `warned`
        ones (nonfinite), as rows of the alarms table."""
        now = time.time()
        rows = [{"key": key, "value": float(value), "time": now} for key, value in metrics.items()]
        self.writer.append("metrics", rows_table(METRICS, self.run_id, step, rows))
        for sink in self.sinks:
            sink.log(metrics, step)
        # each alarm once, where its condition starts to hold: a row of the alarms table
        fired = [*warned, *self.alarms.observe(step, metrics)]
        if fired:
            alarm_rows = [dict(vars(firing), time=now) for firing in fired]
            self.writer.append("alarms", rows_table(ALARMS, self.run_id, step, alarm_rows))
            # on disk now: the driver prints each new row as the run goes (alarms.Announcer)
            self.writer.flush()

    def write_eval(self, step, row):
        """One held-out evaluation: a row of the `eval` table and the metrics eval/reward,
        eval/accuracy."""
        self._append(eval_tables(self.run_id, step, row))
        for sink in self.sinks:
            sink.log({"eval/reward": row["mean_reward"], "eval/accuracy": row["accuracy"]}, step)

    def _append(self, tables):
        for name, table in tables.items():
            self.writer.append(name, table)

    def close(self, status):
        self.writer.close(status)
        for sink in self.sinks:
            sink.close(status)
