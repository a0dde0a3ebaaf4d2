"""Readers of the run store: DuckDB views over a run's Parquet shards, live or finished."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from workbench.store.schema import TABLES


def list_runs(root: str = "runs") -> list[dict]:
    """The `runs` rows of every run under `root`, newest first."""
    rows = []
    for path in Path(root).glob("*/run.json"):
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a folder that is not (yet) a run
    return sorted(rows, key=lambda row: row.get("created", 0), reverse=True)


def resolve_run(run_id: str, root: str = "runs") -> Path:
    """The folder of the run whose id is `run_id` or starts with it (a unique prefix is enough)."""
    ids = sorted(path.parent.name for path in Path(root).glob("*/run.json"))
    if run_id in ids:
        return Path(root) / run_id
    matches = [i for i in ids if i.startswith(run_id)]
    if len(matches) == 1:
        return Path(root) / matches[0]
    if matches:
        raise ValueError(f"Run id {run_id!r} is ambiguous under {root}/: it starts {', '.join(matches[:5])}; give more of it.")
    close = difflib.get_close_matches(run_id, ids, n=3, cutoff=0.3)
    hint = f" Close matches: {', '.join(close)}." if close else " `molt-wb runs` lists them."
    raise ValueError(f"No run {run_id!r} under {root}/.{hint}")


def open_run(run_id: str, root: str = "runs"):
    """An in-memory DuckDB connection with the run's tables as views (`runs`, `segments`, `tokens`, ...).

    Views read the shards present at query time, so a reader sees a live run grow.
    """
    import duckdb

    folder = resolve_run(run_id, root).resolve()
    connection = duckdb.connect()
    for name in TABLES:
        connection.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{folder / name}/*.parquet', union_by_name = true)")
    connection.execute(f"CREATE VIEW runs AS SELECT * FROM read_json_auto('{folder / 'run.json'}')")
    return connection
