"""What every tracking sink is: the `Sink` protocol and the run statuses its `close` accepts.

A backend's sink (wandb_sink.py, mlflow_sink.py) maps each status to its own run states.
"""

from typing import Protocol


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int): ...

    def close(self, status: str = "finished"):
        """End the run; `status` is one of finished, failed, interrupted."""
