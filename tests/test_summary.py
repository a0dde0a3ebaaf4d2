"""The run summary: its figures are what SQL on the run store gives, and `molt-wb train` and
`molt-wb runs RUN_ID` print it."""

import subprocess
import sys

import pytest

from workbench.store import open_run
from workbench.summary import figures, render, sparkline

ARITH = [
    "+recipe=arith",
    "trainer.steps=6",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "run.id=summed",
]


def molt_wb(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    result = molt_wb("train", *ARITH, f"run.root={root}")
    assert result.returncode == 0, result.stderr[-2000:]
    return str(root), result.stdout


@pytest.mark.parametrize(
    "values, width, expected",
    [
        ([0.0, 1.0], 50, "▁█"),
        ([0.0, 0.5, 1.0], 50, "▁▅█"),
        # two values per character: means 0, 1, 0.5
        ([0.0, 0.0, 1.0, 1.0, 0.5, 0.5], 3, "▁█▅"),
        ([0.3, 0.3, 0.3], 50, "▁▁▁"),
        ([], 50, ""),
    ],
)
def test_sparkline_draws_each_bucket_mean_between_the_lowest_and_highest(values, width, expected):
    assert sparkline(values, width) == expected


def test_the_summary_figures_are_what_sql_on_the_run_store_gives(run):
    root, _ = run
    numbers = figures("summed", root)
    db = open_run("summed", root)

    def sql(query: str) -> float:
        return db.execute(query).fetchone()[0]

    rewards = db.execute(
        "select step, value from metrics where key = 'reward/mean' order by step"
    ).fetchall()
    assert numbers["rewards"] == rewards and len(rewards) == 6
    assert numbers["sums"]["identity/violations"] == sql(
        "select sum(value) from metrics where key = 'identity/violations'"
    )
    for key in ("identity/retokenize_drift", "gate/kept_frac", "mismatch/kl"):
        expected = sql(f"select avg(value) from metrics where key = '{key}'")
        assert numbers["means"][key] == pytest.approx(expected)
    for key in ("perf/rollout_s", "perf/train_s"):
        expected = sql(f"select sum(value) from metrics where key = '{key}'")
        assert numbers["sums"][key] == pytest.approx(expected) and expected > 0
    wall = sql("select updated - created from runs")
    assert numbers["wall_s"] == pytest.approx(wall)
    # a dense policy has no routes
    assert "routing/mismatch_token_frac" not in numbers["means"]


def test_the_summary_shows_curve_invariants_time_folder_and_inspect_command(run):
    root, train_output = run
    numbers = figures("summed", root)
    rewards = [reward for _, reward in numbers["rewards"]]
    text = render(numbers, root)
    best = max(rewards)
    rollout = numbers["sums"]["perf/rollout_s"]
    for shown in (
        "run summed finished: 6/6 steps",
        sparkline(rewards),
        f"first 3 steps {sum(rewards[:3]) / 3:.3f} -> last 3 {sum(rewards[3:]) / 3:.3f}",
        f"best {best:.3f} (step {rewards.index(best)})",
        "0 violations, retokenize drift",
        f"kept {numbers['means']['gate/kept_frac']:.3f}",
        f"rollout {rollout:.1f} s",
        f"folder     {numbers['folder']}",
        f"molt-wb inspect summed --root {root}",
    ):
        assert shown in text
    # overhead: the wall time outside rollout and train
    train = numbers["sums"]["perf/train_s"]
    assert f"overhead {numbers['wall_s'] - rollout - train:.1f} s" in text
    # printed at the end of `molt-wb train` and by `molt-wb runs RUN_ID` (a prefix is enough)
    assert text in train_output
    listed = molt_wb("runs", "summ", "--root", root)
    assert listed.returncode == 0 and text.splitlines()[1] in listed.stdout


def test_runs_refuses_an_unknown_run_in_one_sentence(run):
    root, _ = run
    result = molt_wb("runs", "nope", "--root", root)
    assert result.returncode == 2 and "No run 'nope'" in result.stderr
