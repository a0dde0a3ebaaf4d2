"""One way to name a run folder on every command: `--root DIR` and `run.root=DIR` work alike on
train, resume, runs, sweeps, inspect, eval, export and compare."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from workbench import cli
from workbench.store import list_runs

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

RUN = [
    "+recipe=arith",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
    "engine.max_tokens=4",
    "trainer.steps=2",
    "trainer.checkpoint_every=2",
]


def molt_wb(*args: str) -> tuple[int, str]:
    """`molt-wb ARGS` in this process: its exit code and output."""
    result = CliRunner().invoke(cli.app, list(args))
    return result.exit_code, result.output


def both_ways(root: Path) -> dict[str, list[str]]:
    """The two ways to name the folder `root` on a command line."""
    return {"option": ["--root", str(root)], "override": [f"run.root={root}"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder with a 2-step run trained with each way of naming it: by-option, by-override."""
    import ray

    root = tmp_path_factory.mktemp("runs")
    for way, named in both_ways(root).items():
        code, output = molt_wb("train", *RUN, f"run.id=by-{way}", *named)
        assert code == 0, output
    yield root
    ray.shutdown()


@pytest.mark.slow
def test_train_and_resume_name_the_folder_either_way(root):
    assert sorted(row["run_id"] for row in list_runs(str(root))) == ["by-option", "by-override"]
    for way, named in both_ways(root).items():
        code, output = molt_wb("resume", f"by-{way}", *named, "trainer.steps=3")
        assert code == 0, output
    assert [row["steps_done"] for row in list_runs(str(root))] == [3, 3]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["runs"],
        ["runs", "by-option"],
        ["sweeps"],
        ["compare", "by-option", "by-override", "--csv"],
        ["eval", "by-option", "eval.samples=1"],
        # a prefix of a run in DIR: its close match is named (the TUI itself: tests/tui)
        ["inspect", "by-optionx"],
    ],
)
def test_a_reader_names_the_folder_either_way_alike(root, command):
    by_option, by_override = (molt_wb(*command, *named) for named in both_ways(root).values())
    assert by_option == by_override
    code, output = by_option
    if command[0] == "inspect":
        assert code == 2 and f"under {root}/. Close matches: by-option" in output
    else:
        assert code == 0, output
        assert "by-option" in output or command == ["sweeps"]


@pytest.mark.slow
def test_export_names_the_folder_either_way(root, tmp_path):
    for way, named in both_ways(root).items():
        code, output = molt_wb("export", "by-option", str(tmp_path / way), *named)
        assert code == 0, output
    exported = [sorted(p.name for p in (tmp_path / way).iterdir()) for way in both_ways(root)]
    assert exported[0] == exported[1] and "config.json" in exported[0]
