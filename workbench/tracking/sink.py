"""What every tracking sink is: the `Sink` protocol and the run statuses its `close` accepts.

The package's `make_sinks` and each backend's sink import this module; it imports neither of them.
"""

from __future__ import annotations

from typing import Protocol

STATUSES = ("finished", "failed", "interrupted")


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, status: str = "finished") -> None:
        """End the run; `status` is one of STATUSES."""


def check_status(status: str) -> str:
    if status not in STATUSES:
        raise ValueError(f"Sink.close status is {status!r}; use one of {', '.join(STATUSES)}.")
    return status
