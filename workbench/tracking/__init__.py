"""Every metric a run logs reaches each configured sink once, under its namespaced key, at its step.

A sink is anything with `log(metrics, step)` and `close(status)`, `status` one of finished, failed,
interrupted, which each backend's sink (wandb_sink.py, mlflow_sink.py) maps to its own run states;
`make_sinks` turns the `tracking` config into the list the training loop fans out to. wandb and
mlflow are imported only inside their sink constructors, so importing this package stays cheap.
"""


def make_sinks(tracking, run_dir, run_id, config, group=None):
    """Build one sink per enabled backend; `tracking` is read through attributes only (validated:
    config.validate refuses an unknown wandb mode)."""
    sinks = []
    if tracking.wandb.mode != "disabled":
        from workbench.tracking.wandb_sink import WandbSink

        sinks.append(WandbSink(tracking.wandb, run_dir, run_id, config, group))
    if tracking.mlflow.enabled:
        from workbench.tracking.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(tracking.mlflow, run_dir, run_id, config, group))
    return sinks
