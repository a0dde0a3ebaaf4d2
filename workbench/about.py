"""What this install of molt-wb is and what it found: `molt-wb --version` and `molt-wb plugins`.

The commands are registered on the CLI's app by workbench/cli.py; where configs and plugins are
found is workbench/locate.py's.
"""

import sys
from importlib import metadata

import typer
from rich.console import Console
from rich.table import Table

from workbench.locate import ENTRY_POINT_GROUP, PLUGIN_PACKAGE, registered_plugins, shipped_folder


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
