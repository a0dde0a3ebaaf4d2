"""The run store: one writer per run folder, DuckDB views for every reader. A table or column
changes in schema.py (with its description in docs/gen/reference.py)."""

from workbench.store.query import list_runs, open_run, resolve_run

__all__ = ["open_run", "list_runs", "resolve_run"]
