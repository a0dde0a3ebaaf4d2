"""Readers of the run store: DuckDB views over a run's Parquet shards, live or finished."""

import datetime
import difflib
import json
import os
import socket
import time
from pathlib import Path

from workbench.store.schema import TABLES
from workbench.store.writer import write_json_atomic

# a run's (step, reward/mean) pairs, in order
REWARD_CURVE = "select step, value from metrics where key = 'reward/mean' order by step"
NO_RECOVERIES = (
    "SELECT NULL::VARCHAR AS died, NULL::BIGINT AS steps_done, NULL::VARCHAR AS checkpoint, "
    "NULL::DOUBLE AS time WHERE false"
)


def root_option(root: str) -> str:
    """` --root DIR`, the option a suggested command needs to find a run under `root`; empty for
    the default runs/."""
    return f" --root {root}" if str(root) != "runs" else ""


def run_row(run_dir):
    """The `runs` row of a run folder: its run.json."""
    return json.loads(Path(run_dir, "run.json").read_text())


def run_seconds(row: dict) -> float:
    """The seconds a run has run: from its start, or from its latest resume plus what it ran
    before (`ran_s`): the time between two sessions is no run time."""
    since = row.get("resumed_at", row.get("created", 0))
    return row.get("ran_s", 0.0) + row.get("updated", time.time()) - since


def cell(value, missing="-"):
    """A value as a table shows it (`molt-wb compare`, `molt-wb inspect`): a float to 4 significant
    digits, `missing` for none."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return missing
    return str(value)


RUN_COLUMNS = ("id", "recipe", "status", "steps", "reward", "created", "sweep")


def run_cells(row, created_format):
    """A `runs` row as the cells under RUN_COLUMNS (`molt-wb runs` and `molt-wb inspect`)."""
    reward = row.get("reward_mean")
    return [
        row["run_id"],
        str(row.get("recipe") or "-"),
        row.get("status", "?"),
        f"{row.get('steps_done', 0)}/{row.get('steps', '?')}",
        "-" if reward is None else f"{reward:.3f}",
        datetime.datetime.fromtimestamp(row.get("created", 0)).strftime(created_format),
        row.get("sweep_id") or "",
    ]


def list_runs(root="runs", mark_crashed=True):
    """The `runs` rows of every run under `root`, newest first. A run still marked `running` whose
    process (on this host) is gone was killed without a chance to say so: it is marked `crashed`,
    unless `mark_crashed` is false (a reader that rewrites nothing: the TUI)."""
    rows = []
    for path in Path(root).glob("*/run.json"):
        try:
            row = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            # a folder that is not (yet) a run
            continue
        if (
            mark_crashed
            and row.get("status") == "running"
            and row.get("host") == socket.gethostname()
            and not _alive(row.get("pid"))
        ):
            row["status"] = "crashed"
            write_json_atomic(path, row)
        rows.append(row)
    return sorted(rows, key=lambda row: row.get("created", 0), reverse=True)


def _alive(pid):
    if not pid:
        # unknown: do not guess
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_run(run_id, root="runs"):
    """The folder of the run whose id is `run_id` or starts with it (a unique prefix is enough)."""
    ids = sorted(path.parent.name for path in Path(root).glob("*/run.json"))
    if run_id in ids:
        return Path(root) / run_id
    matches = [i for i in ids if i.startswith(run_id)]
    if len(matches) == 1:
        return Path(root) / matches[0]
    if matches:
        raise ValueError(
            f"Run id {run_id!r} is ambiguous under {root}/: it starts "
            f"{', '.join(matches[:5])}; give more of it."
        )
    close = difflib.get_close_matches(run_id, ids, n=3, cutoff=0.3)
    listing = "molt-wb runs" if str(root) == "runs" else f"molt-wb runs --root {root}"
    hint = f" `{listing}` lists them."
    if close:
        hint = f" Close matches: {', '.join(close)}."
    raise ValueError(f"No run {run_id!r} under {root}/.{hint}")


def connect():
    """A DuckDB connection on one thread: floats summed in one order, so every reader of the same
    store reads the same figures every time (on several threads compare's tokens/s changed in its
    last digit from call to call)."""
    # duckdb is imported on first query: it would double the import time of workbench.store
    import duckdb

    return duckdb.connect(config={"threads": 1})


def open_run(run_id, root="runs"):
    """An in-memory DuckDB connection with the run's tables as views (`runs`, `segments`,
    `tokens`, ...).

    Views read the shards present at query time, so a reader sees a live run grow.
    """
    folder = resolve_run(run_id, root).resolve()
    connection = connect()
    for name, schema in TABLES.items():
        source = f"read_parquet('{folder / name}/*.parquet', union_by_name = true)"
        # a run older than a table, or one whose writer has not written it yet, lacks it: empty
        if not any(folder.glob(f"{name}/*.parquet")):
            connection.register(f"empty_{name}", schema.empty_table())
            source = f"empty_{name}"
        connection.execute(f"CREATE VIEW {name} AS SELECT * FROM {source}")
    connection.execute(f"CREATE VIEW runs AS SELECT * FROM read_json_auto('{folder / 'run.json'}')")
    # one row per recovery from a dead learner or store (recovery.py)
    recoveries = "SELECT unnest(recoveries, recursive := true) FROM runs"
    if not run_row(folder).get("recoveries"):
        recoveries = NO_RECOVERIES
    connection.execute(f"CREATE VIEW recoveries AS {recoveries}")
    return connection
