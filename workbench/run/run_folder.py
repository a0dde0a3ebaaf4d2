"""The run folder and its `runs` row: how a run is named, what its folder holds when it starts
and what its row records change here.

`start_run` gives a run its id, creates `runs/<id>/` with the resolved config and returns the row
the store writes as `run.json`; a resumed run is reopened by checkpoint.py instead.
"""

import contextlib
import os
import secrets
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from workbench.config import REPO_ROOT, ConfigError
from workbench.run.checkpoint import reopen
from workbench.store.writer import write_json_atomic


def new_run_id():
    """A run id that sorts by start time: YYYYMMDD-HHMMSS-xxxx."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def code_version() -> str:
    """The commit the code runs at (`-dirty` when tracked files differ from it) in a checkout of
    molt-wb; an installed package's `molt-wb VERSION` (site-packages may lie inside the user's own
    repository, whose commit says nothing of this code); else unknown."""
    if not (REPO_ROOT / ".git").exists():
        return f"molt-wb {metadata.version('molt-wb')}"
    # the short commit hash, never a tag's name (5 s at most)
    command = ["git", "describe", "--always", "--dirty", "--exclude=*"]
    try:
        run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return run.stdout.strip() or "unknown"


def start_run(cfg: DictConfig) -> tuple[Path, dict]:
    """Give the run an id, create its folder, save the resolved config; return (folder, row)."""
    with open_dict(cfg):
        cfg.run.id = cfg.run.id or new_run_id()
    # absolute: the actors may run in another working directory (a Ray they join)
    run_dir = (Path(cfg.run.root) / cfg.run.id).absolute()
    if cfg.run.resume:
        row = reopen(run_dir)
    elif (run_dir / "run.json").exists():
        raise ConfigError(
            f"Run {cfg.run.id} already exists under {cfg.run.root}/: pick another run.id or "
            f"leave it unset."
        )
    else:
        run_dir.mkdir(parents=True)
        row = {
            "run_id": cfg.run.id,
            "recipe": cfg.recipe,
            "created": time.time(),
            "code_version": code_version(),
            "sweep_id": cfg.run.sweep_id,
            "swept": dict(cfg.run.swept),
            "steps_done": 0,
            "reward_mean": None,
        }
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    row = row | {
        "status": "running",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "steps": cfg.trainer.steps,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    # the row from the start: a run whose actors die before the store writes it can still be
    # recovered (recovery.py) and resumed
    write_json_atomic(run_dir / "run.json", row)
    return run_dir, row


def plain(cfg):
    """The run's final config as its `Config` dataclasses: an OmegaConf node's attribute read costs
    ~20 us, about 1 ms a step each in the driver and the learner (bench/README.md)."""
    return OmegaConf.to_object(cfg)


def record_refused(cfg, error):
    """A sweep job refused before it started still gets its run row: status failed, and why."""
    # a run that started has its row already
    with contextlib.suppress(ConfigError, OSError):
        run_dir, row = start_run(cfg)
        write_json_atomic(run_dir / "run.json", row | {"status": "failed", "error": error})
