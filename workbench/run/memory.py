"""The memory a run takes: the proportional set size (PSS) of the driver and every process it
started (Ray's GCS and raylet, the actors, idle workers), read from Linux's /proc once per step.

PSS shares each page among the processes that map it, so torch's libraries and Ray's object store
count once for the run, not once per actor. A sample between steps would miss a learner's
backward, whose activations are freed before its metrics arrive; so each process counts at its own
peak within the step: its PSS when sampled plus its resident high-water mark above its resident
size then (`VmHWM - VmRSS`, what it held at its peak and has freed since, private memory). Each
sample then resets the high-water marks to the resident sizes (`/proc/PID/clear_refs`), and so does
the start of the loop: the loading of the weights (their file pages mapped while being copied) is
not counted as a peak of the run. The sum over processes is an upper bound on the run's
simultaneous peak (two processes need not peak at once: rollout and learner take turns). Elsewhere
than Linux nothing is measured.
"""

import os
from pathlib import Path

PROC = Path("/proc")


def descendants(root: int) -> list[int]:
    """`root` and every process below it (children, their children, ...), from /proc's parent
    ids; [] where /proc is absent."""
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            # the command name in parentheses may hold spaces: the fields after its ')' are fixed
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # a process that ended while being read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    if not children:
        return []
    found = [root]
    for pid in found:
        found.extend(children.get(pid, []))
    return found


def reset_peak(pid: int) -> None:
    """Reset process `pid`'s resident high-water mark to its resident size now (nothing where it
    ended or may not be written)."""
    try:
        (PROC / str(pid) / "clear_refs").write_text("5")
    except OSError:
        pass


def peak_kib(pid: int) -> int | None:
    """Process `pid`'s peak PSS estimate in KiB (its PSS now plus its resident high-water mark
    above its resident size now); None when it ended or cannot be read."""
    try:
        rollup = (PROC / str(pid) / "smaps_rollup").read_text()
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    values = {}
    for line in [*rollup.splitlines(), *status.splitlines()]:
        key, _, rest = line.partition(":")
        if key in ("Pss", "VmHWM", "VmRSS"):
            values[key] = int(rest.split()[0])
    if "Pss" not in values:
        return None
    return values["Pss"] + max(values.get("VmHWM", 0) - values.get("VmRSS", 0), 0)


class MemoryPeak:
    """The run's peak memory so far: the largest sum of its processes' peak estimates over the
    samples taken (`sample`, once per step), each since the one before."""

    def __init__(self, root: int | None = None):
        self.root = root or os.getpid()
        self.peak_bytes = 0
        # processes counted in the largest sample, the driver included
        self.processes = 0
        # the peaks of loading (actors reading the weights) are no peak of the steps
        for pid in descendants(self.root):
            reset_peak(pid)

    def sample(self) -> dict[str, float]:
        """The `memory/` metrics after one more sample: `memory/pss_peak_bytes` and
        `memory/processes` (the driver and the processes it started); {} where /proc is absent."""
        pids = descendants(self.root)
        peaks = [peak_kib(pid) for pid in pids]
        for pid in pids:
            reset_peak(pid)
        counted = [kib for kib in peaks if kib is not None]
        if not counted:
            return {}
        total = sum(counted) * 1024
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.processes = len(counted)
        return {"memory/pss_peak_bytes": self.peak_bytes, "memory/processes": self.processes}


def summary_line(peak_bytes: float, processes: float) -> str:
    """The summary's memory line; '' for a run that logged no memory figure."""
    if not peak_bytes:
        return ""
    others = int(processes) - 1
    return (
        f"memory     peak PSS {peak_bytes / 1e9:.1f} GB (driver + {others} processes it started, "
        f"each at its own peak in a step)"
    )
