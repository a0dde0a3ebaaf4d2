"""Sandbox throughput: calls/s and latency of a trivial program and of a geo3k-style tool call,
jailed (bubblewrap, with and without warm jails) versus the process isolation (the sandbox before
the jail), one call at a time and 8 at once.

    python bench/sandbox.py [--quick] [--calls 40] [--parallel 8]

The jail's cost is its median latency minus the process isolation's, one call at a time; the
`bare` row is the jail's own Python and prelude started without bwrap, what bwrap adds to.
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from workbench.api import load_plugin
from workbench.tools import jail
from workbench.tools.sandbox import PRELUDE, run_python, use_isolation

TRIVIAL = "print(1)"


def geo3k_call() -> str:
    """A geo3k tool call as the policy makes it: the plugin's prelude, then its one-line program."""
    geo3k = load_plugin("geo3k")
    sample = geo3k.make_dataset(1, 0)[0]
    return geo3k.prelude(sample) + "final_answer(180 - sum(values))"


def bare(code: str) -> None:
    """The jail's Python and prelude in a temporary directory, no jail: what bwrap adds to."""
    with tempfile.TemporaryDirectory() as workdir:
        subprocess.run(
            [jail.interpreter(), "-I", "-S", "-c", PRELUDE],
            input=f"\n{code}".encode(),
            cwd=workdir,
            env={},
            capture_output=True,
            check=True,
            # a session of its own, as the sandbox's processes have (the scheduler's autogroups)
            start_new_session=True,
        )


def timed(code: str, isolation: str) -> float:
    """Seconds one call takes; the call must succeed."""
    started = time.perf_counter()
    if isolation == "bare":
        bare(code)
    else:
        result = run_python(code, isolation=isolation)
        assert result.error is None, result
    return time.perf_counter() - started


def serial(code: str, isolation: str, calls: int) -> tuple[float, float]:
    """(median ms, calls/s) of `calls` calls one after another (one warm-up call first)."""
    timed(code, isolation)
    started = time.perf_counter()
    seconds = [timed(code, isolation) for _ in range(calls)]
    return statistics.median(seconds) * 1000, calls / (time.perf_counter() - started)


def parallel(code: str, isolation: str, calls: int, workers: int) -> float:
    """Calls/s of `calls` calls, `workers` at once."""
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda _: timed(code, isolation), range(workers)))
        started = time.perf_counter()
        list(pool.map(lambda _: timed(code, isolation), range(calls)))
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 calls per figure")
    parser.add_argument("--calls", type=int, default=40, help="calls per figure")
    parser.add_argument("--parallel", type=int, default=8, help="calls at once")
    args = parser.parse_args()
    calls = 8 if args.quick else args.calls
    # (label, isolation, warm jails)
    modes = [("process (the old sandbox)", "process", 0)]
    if jail.unavailable():
        print(f"no jail on this host, the process isolation only: {jail.unavailable()}")
    else:
        modes += [("bare (the jail's Python, no bwrap)", "bare", 0)]
        modes += [("jail, sandbox.warm=0", "jail", 0), ("jail, sandbox.warm=2", "jail", 2)]
        modes += [(f"jail, sandbox.warm={args.parallel}", "jail", args.parallel)]
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; {calls} calls a figure")
    print(f"| program | isolation | median ms | calls/s | calls/s, {args.parallel} at once |")
    print("| --- | --- | --- | --- | --- |")
    medians = {}
    for program, code in (("trivial", TRIVIAL), ("geo3k tool call", geo3k_call())):
        for label, isolation, warm in modes:
            use_isolation("process" if isolation == "bare" else isolation, warm)
            median_ms, rate = serial(code, isolation, calls)
            at_once = parallel(code, isolation, calls, args.parallel)
            medians[program, label] = median_ms
            print(f"| {program} | {label} | {median_ms:.1f} | {rate:.1f} | {at_once:.1f} |")
    use_isolation("jail")
    process = modes[0][0]
    for program, label in medians:
        if label.startswith("jail"):
            cost = medians[program, label] - medians[program, process]
            print(f"jail cost, {program}, {label}: {cost:+.1f} ms a call at the median")
            added = medians[program, label] - medians[program, modes[1][0]]
            print(f"  of which over the bare start of the jail's Python: {added:+.1f} ms")


if __name__ == "__main__":
    main()
