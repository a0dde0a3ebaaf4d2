"""The `molt-wb check-template` command and `molt-wb train`'s start-up check (workbench/cli.py
registers and calls them); workbench/run/preflight.py plays the cases."""

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def command(
    model: Annotated[
        str,
        typer.Argument(
            help="A checkpoint folder, a .gguf file or a built-in model's name (tiny, "
            "smollm2-135m, ...)."
        ),
    ],
) -> None:
    """Drive MODEL's own chat template and response parser through the cases that break token
    identity (multi-turn prefixes, dropped reasoning, tool-call round trips, whitespace, stop
    strings, a default system prompt) under both agent.history_rewrite modes, and recommend one.
    Renders and parses only: no weights are loaded. Exits 1 when a case fails under the
    recommended mode."""
    from workbench.run.preflight import check, load_tokenizer

    try:
        report = check(load_tokenizer(model))
    except ValueError as error:
        typer.secho(f"error: {error}", fg="red", err=True)
        raise typer.Exit(2) from None
    table = Table("case", "seal", "bridge", "what happened")
    for case, seal, bridge, detail in report.rows():
        table.add_row(case, seal, bridge, detail)
    Console(width=None if typer.get_text_stream("stdout").isatty() else 200).print(table)
    typer.echo(report.advice())
    if report.failing(report.recommended):
        raise typer.Exit(1)


def warn_at_start(configs: list) -> None:
    """One warning per case the policy's template fails under the run's agent.history_rewrite,
    once per (model, mode) among `configs` (rendering only: no forward)."""
    from workbench.run.preflight import startup_warnings

    policies = {
        (c.model.path or c.model.name, c.agent.history_rewrite, calls_tools(c)) for c in configs
    }
    for model, mode, tools in sorted(policies):
        for sentence in startup_warnings(model, mode, tools):
            typer.secho(f"warning: {sentence}", fg="yellow", err=True)


def calls_tools(cfg) -> bool:
    """Whether the run's policy may call tools: False only for an Env plugin that lists none (a
    ChatAgent's client may send tools with any request; a plugin that does not load is checked in
    full and fails later with its own sentence)."""
    from workbench.api import Env, load_plugin

    try:
        runner = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs).AgentRunner
    except Exception:
        return True
    return not (isinstance(runner, type) and issubclass(runner, Env)) or bool(runner.tools)
