"""Test-wide settings: one model cache for the whole session (subprocesses included), quiet Ray."""

import json
import os
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
