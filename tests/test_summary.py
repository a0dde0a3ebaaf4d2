"""The run summary: its figures are what SQL on the run store gives, and `molt-wb train` and
`molt-wb runs RUN_ID` print it."""

import subprocess
import sys
from collections import defaultdict

import pytest

from workbench.run.summary import figures, render, sparkline
from workbench.store import open_run

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


# what a run does before its first step (progress.StartClock)
STARTUP = ("model_build", "warm_start", "actor_start")


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # other: the wall time outside the start's phases, rollout and train
    train = numbers["sums"]["perf/train_s"]
    start = sum(numbers["sums"][f"perf/{phase}_s"] for phase in STARTUP)
    assert f"other {numbers['wall_s'] - start - rollout - train:.1f} s" in text
    # printed at the end of `molt-wb train` and by `molt-wb runs RUN_ID` (a prefix is enough)
    assert text in train_output
    listed = molt_wb("runs", "summ", "--root", root)
    assert listed.returncode == 0 and text.splitlines()[1] in listed.stdout


def numbers_of(wall_s: float, **seconds: float) -> dict:
    """A finished run's summary figures: `wall_s` and the sum of each `perf/<phase>_s`."""
    sums = defaultdict(float, {f"perf/{phase}_s": value for phase, value in seconds.items()})
    run = {"run_id": "r", "status": "finished", "steps_done": 2, "steps": 2}
    return dict(
        run=run, folder="runs/r", rewards=[], sums=sums, means=defaultdict(float), wall_s=wall_s
    )


@pytest.mark.parametrize(
    "seconds, line",
    [
        # an empty model cache: the model is built and warm-started before the first step
        (
            dict(model_build=120, warm_start=110, actor_start=14, rollout=52.7, train=37.3),
            "time       model build 120.0 s (36%), warm start 110.0 s (33%), actor start 14.0 s "
            "(4%), rollout 52.7 s (16%), train 37.3 s (11%), other 2.7 s (1%)",
        ),
        # both cached by an earlier run: not shown
        (
            dict(model_build=0.01, warm_start=0.02, actor_start=14, rollout=152.7, train=167.3),
            "time       actor start 14.0 s (4%), rollout 152.7 s (45%), train 167.3 s (50%), "
            "other 2.7 s (1%)",
        ),
    ],
)
def test_the_time_line_names_the_model_build_warm_start_and_actor_start(seconds, line):
    text = render(numbers_of(336.7, **seconds))
    assert line in text.splitlines()


@pytest.mark.slow
def test_the_first_step_carries_the_start_phases_and_no_other_step_does(run):
    root, _ = run
    db = open_run("summed", root)
    keys = ", ".join(f"'perf/{phase}_s'" for phase in STARTUP)
    carried = db.execute(
        f"select key, step, value from metrics where key in ({keys}) order by key"
    ).fetchall()
    # (model.warm_start_steps=0: no warm start)
    assert [(key, step) for key, step, _ in carried] == [
        ("perf/actor_start_s", 0),
        ("perf/model_build_s", 0),
    ]
    # Ray and its actors, each loading the policy, take time; the model was cached by conftest
    seconds = {key: value for key, _, value in carried}
    assert seconds["perf/actor_start_s"] > 0
    assert figures("summed", root)["sums"]["perf/actor_start_s"] == seconds["perf/actor_start_s"]


@pytest.mark.slow
def test_runs_refuses_an_unknown_run_in_one_sentence(run):
    root, _ = run
    result = molt_wb("runs", "nope", "--root", root)
    assert result.returncode == 2 and "No run 'nope'" in result.stderr


@pytest.mark.slow
def test_the_summary_names_the_runs_peak_memory_over_ray_processes(run):
    root, _ = run
    db = open_run("summed", root)
    peaks = [
        value
        for (value,) in db.execute(
            "select value from metrics where key = 'memory/pss_peak_bytes' order by step"
        ).fetchall()
    ]
    # sampled at every step; a peak so far only grows
    assert len(peaks) == 6 and peaks == sorted(peaks) and peaks[0] > 0
    processes = db.execute("select max(value) from metrics where key = 'memory/processes'")
    # the driver, Ray's GCS and raylet, the store, the learner and a rollout worker at least
    count = processes.fetchone()[0]
    assert count >= 5
    line = f"memory     peak PSS {peaks[-1] / 1e9:.1f} GB (driver + {count - 1:.0f} processes"
    assert line in render(figures("summed", root), root)
