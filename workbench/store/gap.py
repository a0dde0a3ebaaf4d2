"""The off-policy gap as the run store holds it: each sampled token's parts (the `gap_*` columns of
`tokens`, written by models/gap.py), summed up for the run summary."""

from typing import Any

# the parts, in the order of models/gap.py's PARTS (not imported: torch)
PARTS = ("staleness", "routing", "sampler", "numerics")

# over the sampled tokens whose parts were measured: their count, the mean |δ|, each part's mean
# magnitude; and every sampled token's count
SIZES = (
    "select count(gap_numerics), avg(abs(train_logprob - behavior_logprob)) "
    "filter (where gap_numerics is not null), "
    + ", ".join(f"avg(abs(gap_{name}))" for name in PARTS)
    + ", count(*) from tokens where loss_mask = 1"
)


def gap_sizes(db: Any) -> dict[str, float] | None:
    """The run's gap over its measured tokens (a DuckDB connection from `open_run`): `measured`
    and `sampled` token counts, `delta` (mean |δ|) and each part's mean magnitude; None for a run
    older than the gap's columns or with no measured token."""
    import duckdb

    try:
        row = db.execute(SIZES).fetchone()
    except duckdb.BinderException:
        # a run older than the gap's columns
        return None
    if not row[0]:
        return None
    sizes = dict(zip(PARTS, row[2:6], strict=True))
    return sizes | {"measured": row[0], "delta": row[1], "sampled": row[6]}


def gap_line(sizes: dict[str, float] | None) -> list[str]:
    """The summary's line: the mean |δ| of the measured tokens, each part's mean magnitude, and
    the largest; none for a run without measured tokens."""
    if not sizes:
        return []
    largest = max(PARTS, key=lambda name: sizes[name])
    parts = ", ".join(f"{name} {sizes[name]:.2e}" for name in PARTS)
    share = sizes["measured"] / max(sizes["sampled"], 1)
    return [
        f"gap        |δ| {sizes['delta']:.2e} on {share:.0%} of sampled tokens: {parts}; "
        f"largest {largest}"
    ]
