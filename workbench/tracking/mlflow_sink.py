"""An mlflow sink: a run named after the workbench run id, in a sqlite store beside the run folders
by default."""

import os
import time
from collections.abc import Mapping

from workbench.extras import needs

# mlflow >= 3 fetches a telemetry config over HTTP when imported; only this variable stops it.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
try:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient
    from mlflow.utils import validation as limits
except ImportError as error:
    # config validation refuses this first, before anything starts
    raise RuntimeError(needs("tracking.mlflow.enabled=true", "mlflow")) from error

RUN_STATUSES = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def flatten(config: Mapping, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    flat = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MlflowSink:
    def __init__(self, mlflow_config, run_dir, run_id, config, group):
        runs_root = os.path.dirname(os.path.abspath(run_dir))
        uri = mlflow_config.tracking_uri or f"sqlite:///{os.path.join(runs_root, 'mlflow.db')}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(mlflow_config.experiment)
        if experiment:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(mlflow_config.experiment)
        tags = {"workbench.run_id": run_id}
        if group:
            tags["workbench.group"] = group
            # the runs of a sweep are children of one parent run named after the sweep
            tags["mlflow.parentRunId"] = self._parent(experiment_id, group)
        # a resumed run continues its mlflow run; its params stand (mlflow never changes a param)
        found = self.client.search_runs(
            [experiment_id], f"tags.`workbench.run_id` = '{run_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run_id, tags=tags).info.run_id
        params = [
            Param(key[: limits.MAX_ENTITY_KEY_LENGTH], str(value)[: limits.MAX_PARAM_VAL_LENGTH])
            for key, value in flatten(config).items()
        ]
        # log_batch splits what it is given into batches of mlflow's sizes
        self.client.log_batch(self.run_id, params=params)

    def _parent(self, experiment_id, group):
        found = self.client.search_runs(
            [experiment_id], f"tags.`workbench.sweep` = '{group}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        return self.client.create_run(
            experiment_id, run_name=group, tags={"workbench.sweep": group}
        ).info.run_id

    def log(self, metrics, step):
        timestamp_ms = int(time.time() * 1000)
        entries = [Metric(key, float(value), timestamp_ms, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=entries)

    def close(self, status="finished"):
        self.client.set_terminated(self.run_id, status=RUN_STATUSES[status])
