"""No silent NaN: every metric and every per-token float column of a run is checked as the store
writes it.

A non-finite value (NaN, +inf or -inf; NULL is no value) is counted per step and key: the metric
`audit/nonfinite` is the step's total, `audit/nonfinite/KEY` the count of one metric key or of one
table column (`tokens.entropy`). The store actor warns the first time a key has one, the run summary
and the TUI name each key and the step it started at. A non-finite loss or gradient norm
(`STOP_KEYS`) means the weights are no longer finite either: with `trainer.nonfinite=stop` (the
default) the driver stops the run at that step, before its checkpoint (run/faults.py
`nonfinite_loss`); measurements never stop it.
"""

import math

import pyarrow as pa
import pyarrow.compute as pc

from workbench.store.alarms import Firing

TOTAL = "audit/nonfinite"
# losses and gradients: a non-finite value here has reached (or is about to reach) the weights
STOP_KEYS = ("loss/policy", "loss/grad_norm")
# a run's non-finite keys: the key, its first step, the steps it was non-finite in, its values
FIRST_STEPS = (
    f"select substr(key, {len(TOTAL) + 2}) as name, min(step), count(*), sum(value) from metrics "
    f"where key like '{TOTAL}/%' and value > 0 group by key order by min(step), name"
)


def count(metrics: dict[str, float], tables: dict[str, pa.Table]) -> dict[str, int]:
    """The non-finite values of one step's records: per metric key, and per floating-point column
    of each table (as `table.column`); keys with none are left out."""
    counts = {key: 1 for key, value in metrics.items() if not math.isfinite(value)}
    for name, table in tables.items():
        for field in table.schema:
            if pa.types.is_floating(field.type):
                # is_finite is null for a null: sum counts only the false ones
                bad = pc.sum(pc.invert(pc.is_finite(table[field.name]))).as_py() or 0
                if bad:
                    counts[f"{name}.{field.name}"] = bad
    return counts


def audit_metrics(counts: dict[str, int]) -> dict[str, float]:
    """`audit/nonfinite` (the step's total, 0 when every value is finite) and
    `audit/nonfinite/KEY` for each key with any."""
    metrics = {TOTAL: float(sum(counts.values()))}
    for key, bad in counts.items():
        metrics[f"{TOTAL}/{key}"] = float(bad)
    return metrics


def firing(key: str, bad: int) -> Firing:
    """The `nonfinite` row of the alarms table the first time `key` has a non-finite value: the
    driver prints it as the run goes (alarms.Announcer; the store actor's own output goes to Ray's
    logs), the summary and the TUI list it."""
    return Firing(
        rule="nonfinite",
        metric=f"{TOTAL}/{key}",
        value=float(bad),
        threshold=0.0,
        evidence=(
            f"{key} has {bad} non-finite value(s) (NaN or inf); the run goes on and counts them "
            f"in {TOTAL}/{key}"
        ),
    )


def summary_line(rows: list[tuple[str, int, int, float]]) -> str:
    """The run summary's line: every key that held a non-finite value, from which step and how
    often (`rows` as FIRST_STEPS gives them)."""
    if not rows:
        return "finite     every metric and per-token value"
    named = [
        f"{key} from step {first} ({steps} steps, {values:.0f} values)"
        for key, first, steps, values in rows
    ]
    return f"NONFINITE  {'; '.join(named)}"


def scan(db) -> dict[str, int]:
    """Every non-finite value a run's store holds (`db`: `workbench.store.open_run`), named as
    `count` names them: per metric key and per floating-point column of each other table."""
    from workbench.store.schema import TABLES

    counts = dict(
        db.execute(
            "select key, count(*) from metrics where not isfinite(value) group by key"
        ).fetchall()
    )
    for name, schema in TABLES.items():
        floats = [field.name for field in schema if pa.types.is_floating(field.type)]
        for column in floats if name != "metrics" else []:
            sql = f"select count(*) from {name} where not isfinite({column})"
            bad = db.execute(sql).fetchone()[0]
            if bad:
                counts[f"{name}.{column}"] = bad
    return counts
