"""Every metric a run logs reaches each configured sink once, under its namespaced key, at its step.

A sink is anything with `log(metrics, step)` and `close(status)` (`sink.py`); `make_sinks` turns the
`tracking` config into the list the training loop fans out to. wandb and mlflow are imported
only inside their sink constructors, so importing this package stays cheap.
"""

WANDB_MODES = ("offline", "online", "disabled")


def make_sinks(tracking, run_dir: str, run_id: str, config: dict, group: str | None = None):
    """Build one sink per enabled backend; `tracking` is read through attributes only."""
    sinks = []
    mode = tracking.wandb.mode
    if mode not in WANDB_MODES:
        raise ValueError(f"tracking.wandb.mode is {mode!r}; use one of {', '.join(WANDB_MODES)}.")
    if mode != "disabled":
        from workbench.tracking.wandb_sink import WandbSink

        sinks.append(WandbSink(tracking.wandb, run_dir, run_id, config, group))
    if tracking.mlflow.enabled:
        from workbench.tracking.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(tracking.mlflow, run_dir, run_id, config, group))
    return sinks
