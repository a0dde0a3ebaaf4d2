"""Searched sweeps: `molt-wb tune` runs an Optuna study whose trials are runs tagged with its sweep
id, keeps the study beside them, stops a trial whose reward curve falls behind, and resumes."""

import json
import sqlite3
import subprocess
import sys

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from workbench.config import ConfigError
from workbench.run.tune import Tuner, search_space
from workbench.store import list_runs, open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

FAST = [
    "+recipe=arith",
    "trainer.steps=30",
    "tracking=none",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
]
CURVE = "select step, value from metrics where key = 'reward/mean' order by step"


def smoothed(curve):
    """Each step's reward/mean averaged over the 10 steps up to it (fewer at the start)."""
    means = []
    for index, (step, _) in enumerate(curve):
        window = [reward for _, reward in curve[max(0, index - 9) : index + 1]]
        means.append((step, sum(window) / len(window)))
    return means


def molt_wb(*args):
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=900
    )


def test_a_tune_line_splits_into_fixed_overrides_and_optuna_distributions():
    line = [
        "+recipe=arith",
        "gate.band.0=interval(0.3,0.99)",
        "gate.max_staleness=int(interval(0,3))",
        "trainer.lr=tag(log,interval(1e-4,1e-2))",
        "gate.level=token,geo",
        "seed=range(0,3)",
    ]
    fixed, space = search_space(line)
    assert fixed == ["+recipe=arith"]
    assert space == {
        "gate.band.0": FloatDistribution(0.3, 0.99),
        "gate.max_staleness": IntDistribution(0, 3),
        "trainer.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "gate.level": CategoricalDistribution(["token", "geo"]),
        "seed": CategoricalDistribution(["0", "1", "2"]),
    }


@pytest.mark.parametrize(
    ("line", "sentence"),
    [
        (
            ["gate.band.0=interval(0.9,0.3)"],
            "gate.band.0=interval(0.9,0.3) cannot be searched: `low <= high` must hold, but got "
            "(low=0.9, high=0.3).",
        ),
        (
            ["trainer.lr=tag(log,interval(0,1))"],
            "trainer.lr=tag(log,interval(0,1)) cannot be searched: `low > 0` must hold for "
            "`log=True`, but got (low=0.0, high=1.0).",
        ),
        (
            ["data.path=glob(*)"],
            "data.path=glob(*) cannot be searched: only choice(), range() and interval() are "
            "searched.",
        ),
        (
            ["gate.band.0=interval(0.3"],
            "Bad override (no viable alternative at input 'interval(0.3'); see `molt-wb tune "
            "--help`.",
        ),
        (
            ["+recipe=arith", "trainer.steps=5"],
            "Nothing to search: give a key a range, e.g. 'gate.band.0=interval(0.3,0.99)' or "
            "'gate.max_staleness=int(interval(0,3))'.",
        ),
    ],
)
def test_a_bad_search_space_is_refused_with_one_sentence(line, sentence):
    with pytest.raises(ConfigError) as refused:
        search_space(line)
    assert str(refused.value) == sentence


def test_an_unknown_key_a_bad_metric_or_a_missing_study_is_refused_before_anything_starts(
    tmp_path,
):
    line = ["+recipe=arith", f"run.root={tmp_path}", "gate.bnd.0=interval(0.3,0.9)"]
    with pytest.raises(ConfigError, match=r"^gate\.bnd\.0 is not a config key: check it"):
        Tuner.new(line, "best", 4, 10)
    line[-1] = "gate.band.0=interval(0.3,0.9)"
    with pytest.raises(ConfigError, match=r"^--metric mean is not one of best, final, per_second"):
        Tuner.new(line, "mean", 4, 10)
    with pytest.raises(
        ConfigError, match=r"^No study .*nothing\.optuna\.db: give the \.optuna\.db"
    ):
        Tuner(str(tmp_path / "nothing.optuna.db"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_trials_are_runs_of_the_sweep_the_study_holds_their_rewards_and_a_laggard_is_pruned(
    tmp_path,
):
    # seed 0 draws 600 then 0: a warm-started run, then one from the random model that falls
    # behind it from the first steps
    searched = ["model.warm_start_steps=0,600", "--startup", "1", "--warmup", "2"]
    result = molt_wb("tune", *FAST, f"run.root={tmp_path}", *searched, "--trials", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    (study_file,) = tmp_path.glob("tune-*.optuna.db")
    sweep_id = study_file.name.removesuffix(".optuna.db")
    assert f"study {sweep_id}: 2 trials, 1 pruned, 0 failed" in result.stdout
    resumed = molt_wb("tune", "--resume", str(study_file), "--trials", "1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the resumed session draws its own point: pruned if it is the laggard again
    assert f"study {sweep_id}: 3 trials, " in resumed.stdout and "0 failed" in resumed.stdout

    runs = {row["run_id"]: row for row in list_runs(str(tmp_path))}
    assert len(runs) == 3 and {row["sweep_id"] for row in runs.values()} == {sweep_id}
    with sqlite3.connect(study_file) as study:
        trials = study.execute(
            "select t.trial_id, t.state, v.value, a.value_json from trials t "
            "join trial_user_attributes a on a.trial_id = t.trial_id and a.key = 'run_id' "
            "left join trial_values v on v.trial_id = t.trial_id order by t.number"
        ).fetchall()
        reported = {
            trial_id: study.execute(
                "select step, intermediate_value from trial_intermediate_values "
                "where trial_id = ? order by step",
                (trial_id,),
            ).fetchall()
            for trial_id, *_ in trials
        }
    assert [state for _, state, _, _ in trials][:2] == ["COMPLETE", "PRUNED"]
    assert len(trials) == 3
    for trial_id, state, value, run_json in trials:
        run = runs[json.loads(run_json)]
        curve = open_run(run["run_id"], str(tmp_path)).execute(CURVE).fetchall()
        # the pruner saw the run's own curve, smoothed, step by step as the store holds it (a
        # pruned run writes the steps it was in when it stopped)
        assert reported[trial_id] == smoothed(curve)[: len(reported[trial_id])]
        if state == "COMPLETE":
            # --metric best: the run's best reward/mean
            assert run["swept"] == {"model.warm_start_steps": "600"}
            assert reported[trial_id] == smoothed(curve)
            assert value == max(reward for _, reward in curve)
            assert run["status"] == "finished" and run["steps_done"] == 30
        else:
            # stopped as Ctrl-C stops a run: kept, interrupted, fewer steps than asked
            assert run["swept"] == {"model.warm_start_steps": "0"}
            assert value == reported[trial_id][-1][1]
            assert run["status"] == "interrupted" and run["steps_done"] < 30 and len(curve) < 30
            # it stopped at the very step its verdict came on, however fast it ran
            assert len(curve) == len(reported[trial_id])

    out = molt_wb("compare", sweep_id, "--root", str(tmp_path), "--json")
    rows = json.loads(out.stdout)
    assert sorted(row["run_id"] for row in rows) == sorted(runs)
    assert {row["model.warm_start_steps"] for row in rows} == {"0", "600"}
