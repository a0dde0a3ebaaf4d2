"""What a one-step run spends on Ray's start: the same `molt-wb train` (arith, one step of 4x4)
run starting its own Ray, joining a running head (`RAY_ADDRESS`), and joining a head that starts
no idle workers ahead of each run (`RAY_enable_worker_prestart=0`), alternating the three.

CPU seconds are the machine's busy core-seconds while the run lasts (/proc/stat), so run it on an
idle machine: another job's work would count. Ratios are against the run with its own Ray.

    python bench/ray_start.py [--quick] [--repeats 3]
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = [
    "+recipe=arith",
    "trainer.steps=1",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
]


def busy_seconds() -> float:
    """Core-seconds every CPU of the machine has spent busy since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def one_run(root: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, machine CPU seconds) of one run."""
    command = [sys.executable, "-m", "workbench.cli", "train", *RUN, f"run.root={root}"]
    cpu, wall = busy_seconds(), time.monotonic()
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
    return time.monotonic() - wall, busy_seconds() - cpu


def start_head(temp: str, prestart: bool) -> tuple[subprocess.Popen, str]:
    """A Ray head on loopback (8 CPUs, as the tests' one_ray) and its address, once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RAY_worker_niceness="0", RAY_enable_worker_prestart=str(int(prestart)))
    env.pop("RAY_ADDRESS", None)
    ray_cli = str(Path(sys.executable).parent / "ray")
    flags = ["--node-ip-address=127.0.0.1", "--num-cpus=8", "--include-dashboard=false"]
    head = subprocess.Popen(
        [ray_cli, "start", "--head", f"--port={port}", *flags, f"--temp-dir={temp}", "--block"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    up = f"import ray; ray.init(address='{address}', logging_level='ERROR')"
    subprocess.run([sys.executable, "-c", up], env=env, check=True, timeout=120)
    return head, address


def stop_head(head: subprocess.Popen, temp: str) -> None:
    """End the head's process group (SIGKILL 3 s after SIGTERM: `ray start --block` can take
    over 30 s to end) and remove its temp dir, logs and spilled objects with it."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=3)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
    shutil.rmtree(temp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run each way")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    own_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    figures: dict[str, list[tuple[float, float]]] = {
        "own Ray": [],
        "joined": [],
        "joined, no prestart": [],
    }
    root = tempfile.mkdtemp(prefix="ray-start-")
    heads = {}
    try:
        for name, prestart in (("joined", True), ("joined, no prestart", False)):
            temp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
            heads[name] = (*start_head(temp, prestart), temp)
        # a first run fills the model cache and the page cache; it is not counted
        one_run(root, own_env)
        for _ in range(repeats):
            figures["own Ray"].append(one_run(root, own_env))
            for name, (_, address, _) in heads.items():
                figures[name].append(one_run(root, dict(own_env, RAY_ADDRESS=address)))
    finally:
        for head, _, temp in heads.values():
            stop_head(head, temp)
        shutil.rmtree(root, ignore_errors=True)
    base_wall = statistics.median(w for w, _ in figures["own Ray"])
    base_cpu = statistics.median(c for _, c in figures["own Ray"])
    print(f"one-step arith run, median of {repeats}, {os.cpu_count()} cores")
    print(f"{'':22} {'wall s':>8} {'CPU s':>8} {'wall ratio':>11} {'CPU ratio':>10}")
    for name, runs in figures.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"{name:22} {wall:8.1f} {cpu:8.1f} {wall / base_wall:11.2f} {cpu / base_cpu:10.2f}")


if __name__ == "__main__":
    main()
