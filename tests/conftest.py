"""Test-wide settings: one model cache for the whole session (subprocesses included), quiet Ray."""

import os
from pathlib import Path

import pytest

from workbench.models.tiny import tiny_model_path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("MOLT_WB_CACHE", str(REPO / ".pytest_cache" / "molt-wb"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return str(tiny_model_path())


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)
