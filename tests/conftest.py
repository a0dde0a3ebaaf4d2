"""Test-wide settings: one model cache for the whole session (subprocesses included), quiet Ray."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from workbench.models.tiny import tiny_model_path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("MOLT_WB_CACHE", str(REPO / ".pytest_cache" / "molt-wb"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


# each test file's seconds (setup, call and teardown of its tests) in a measured whole-suite run:
# the order `-n 2 --dist loadfile` hands files out in; `--record-durations` rewrites it
DURATIONS = REPO / "tests" / "durations.json"
# this run's seconds per file, counted as each test's report arrives
FILE_SECONDS: Counter = Counter()


def recorded_durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write the seconds of each test file run to tests/durations.json",
    )


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first, each file's tests in their own order: `-n 2 --dist loadfile` (the
    README's test command) hands whole files to its two workers in this order, so the long files
    start early and the short ones fill in beside them at the end. A file not yet measured counts
    a minute per slow test."""
    seconds = recorded_durations()
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))

    def measured(item) -> float:
        return seconds.get(item.path.relative_to(REPO).as_posix(), 60.0 * slow[item.path])

    items.sort(key=lambda item: -measured(item))


def pytest_configure(config) -> None:
    # xdist would hand out the files with the most tests first, whatever this order says
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_runtest_logreport(report) -> None:
    # on the controller, xdist's workers' reports arrive here too
    FILE_SECONDS[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session) -> None:
    config = session.config
    # an xdist worker's share is counted by the controller, which writes the file once
    if not config.getoption("--record-durations") or hasattr(config, "workerinput"):
        return
    # a run of some files updates theirs and keeps the others'
    seconds = recorded_durations()
    seconds.update({path: round(total, 1) for path, total in FILE_SECONDS.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_head():
    """One Ray head on loopback for this pytest process (each xdist worker has its own), started
    by the first module that needs it and ended with the session: a head's start and stop cost a
    module seconds of wall and CPU, 20-odd times a suite. Eight CPUs, so a sharded or multi-worker
    run fits beside the leftover actors of a killed one; its workers at the driver's priority, as
    init_ray asks."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="one-ray-", dir="/tmp")
    # no idle workers started ahead for each run that joins: eight of them, one per CPU, cost a
    # one-step run more CPU seconds than Ray's own start saves (bench/ray_start.py)
    env = dict(os.environ, RAY_worker_niceness="0", RAY_enable_worker_prestart="0")
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=8",
            "--include-dashboard=false",
            f"--object-store-memory={512 * 2**20}",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
            "--block",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        up = f"import ray; ray.init(address='{address}', logging_level='ERROR')"
        subprocess.run([sys.executable, "-c", up], env=env, check=True, timeout=120)
        yield address
    finally:
        # the head's process group: raylet, GCS, agents and workers (`ray start --block` took
        # longer than 30 s to end on SIGTERM)
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def one_ray(request):
    """The Ray head every run of a module joins (RAY_ADDRESS, inherited by the `molt-wb train`
    subprocesses), so the runs skip Ray's own start: its GCS, raylet and agents cost a one-step
    run a seventh of its CPU seconds (bench/ray_start.py). None where the module runs none of its
    slow tests (the fast loop): its fast tests train nothing long enough to share a Ray for."""
    selected = [item for item in request.session.items if item.module is request.module]
    if not any(item.get_closest_marker("slow") for item in selected):
        yield None
        return
    address = request.getfixturevalue("ray_head")
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        if before is not None:
            os.environ["RAY_ADDRESS"] = before
