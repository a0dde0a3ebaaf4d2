"""Test-wide settings: one model cache for the whole session (subprocesses included), quiet Ray."""

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


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most slow tests first, each file's tests in their own order: `-n 2
    --dist loadfile` (the README's test command) hands whole files to its two workers in this
    order, so the long files start early and the short ones fill in beside them at the end."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)
