"""The `molt-wb bundle` and `molt-wb replay` commands (workbench/cli.py registers them): one
training step written to one file, and re-run on the CPU with a diff of every output
(workbench/run/replay.py does the work)."""

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


@contextlib.contextmanager
def _one_sentence() -> Iterator[None]:
    """A mistake the user can fix (a ValueError) ends the command with its sentence, exit 2."""
    try:
        yield
    except ValueError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None


def bundle(
    run_id: Annotated[str, typer.Argument(help="Run id (a unique prefix is enough).")],
    step: Annotated[int, typer.Argument(help="The training step to bundle.")],
    root: str = typer.Option("runs", help="Folder of run folders (run.root)."),
    rows: int = typer.Option(0, "--rows", help="Keep the batch's first N rows (0: all)."),
    out: str = typer.Option("", "--out", help="The file to write (default RUN-step-STEP.zip)."),
    max_mb: float = typer.Option(
        64, "--max-mb", help="Weights larger than this go in as their path and hash."
    ),
) -> None:
    """Write one training step to one file: its rows as the learner saw them (ids, masks,
    behavior log-probs, versions, routes, images), the resolved config, the learner's weights at
    that step and its recorded outputs; `molt-wb replay FILE` re-runs it."""
    from workbench.run.replay import make_bundle

    with _one_sentence():
        meta = make_bundle(run_id, step, root, out, rows or None, max_mb)
    size = os.path.getsize(meta["path"])
    # a large policy's weights stay where they are: the bundle names them and their hash
    where = []
    for name, weights in meta["weights"].items():
        place = "embedded"
        if "path" in weights:
            place = f"at {weights['path']}, sha256 {weights['sha256'][:12]}"
        where.append(f"{name} {place}")
    typer.echo(
        f"wrote {meta['path']} ({size / 2**10:,.0f} KB): run {meta['run_id']} step {step}, "
        f"{meta['rows']} of {meta['batch_rows']} rows, weights version "
        f"{meta['learner_version']} ({'; '.join(where)})"
    )


def replay(
    path: Annotated[str, typer.Argument(help="A bundle file written by molt-wb bundle.")],
    atol: float = typer.Option(1e-4, help="Absolute tolerance of every value."),
    rtol: float = typer.Option(1e-4, help="Relative tolerance (IS weights, ratios, metrics)."),
) -> None:
    """Re-run a bundle's step on the CPU and diff every output of the learner (π_old, entropies,
    IS weights, gate decisions, advantages, loss, gradient norm, the step's metrics) against the
    recorded one; exits 1 when any differs beyond the tolerance."""
    from workbench.run.replay import replay as replayed

    with _one_sentence():
        meta, diffs = replayed(path, atol, rtol)
    table = Table("output", "values", "max |diff|", "tolerance", "result")
    for diff in diffs:
        result = "ok" if diff.ok else "[red]DIFFERS[/red]"
        if diff.note:
            result += f" ({diff.note})"
        table.add_row(
            diff.name, str(diff.values), f"{diff.max_abs_diff:.3g}", f"{diff.tolerance:g}", result
        )
    # piped output gets wide lines, so names are never cut
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    failed = [diff.name for diff in diffs if not diff.ok]
    head = f"run {meta['run_id']} step {meta['step']}: "
    if failed:
        typer.echo(f"{head}{len(failed)} outputs differ beyond the tolerance ({', '.join(failed)})")
        raise typer.Exit(1)
    typer.echo(f"{head}every output replays within the tolerance ({len(diffs)} compared)")
