"""Run-health alarms: each rule tripped by metrics built to trip it (the step it fires at worked
out by hand), left alone by metrics that must not trip it (a real geo3k run's among them), fed
through a real run store to its `alarms` table, summary and command line, kept from firing twice
across a resume, and one real training run whose learning rate collapses the policy's entropy."""

import json
import subprocess
import sys

import pytest
from pytest import approx
from typer.testing import CliRunner

from workbench.cli import app
from workbench.config import compose_config
from workbench.run import run_folder
from workbench.run.summary import figures, render
from workbench.store import open_run
from workbench.store.actor import StoreActor
from workbench.store.alarms import Alarms, Announcer, health_metrics
from workbench.tui.data import RunData

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

WINDOW = 3


def config(tmp_path, *overrides: str):
    return compose_config(
        ["tracking=none", f"run.root={tmp_path / 'runs'}", f"alarm.window={WINDOW}", *overrides]
    ).alarm


def fired(alarm_cfg, steps: list[dict[str, float]]) -> list[tuple[int, str]]:
    """(step, rule) of every firing as `steps` (one metrics dict per step) arrive."""
    alarms = Alarms(alarm_cfg)
    return [
        (step, f.rule) for step, metrics in enumerate(steps) for f in alarms.observe(step, metrics)
    ]


def series(**columns: list[float]) -> list[dict[str, float]]:
    """One metrics dict per step from per-key columns of equal length."""
    length = len(next(iter(columns.values())))
    return [
        {key.replace("__", "/"): values[step] for key, values in columns.items()}
        for step in range(length)
    ]


# (metrics per step, the firings expected): window 3, so a baseline of steps 0-2
TRIPPED = {
    # the rise over steps 6-8 (0.45 - 0.15 = 0.3) beats 2 x the rise before (0.15 - 0.1 = 0.05)
    "kl_acceleration": (
        series(loss__kl_ref=[0.1, 0.1, 0.1, 0.15, 0.15, 0.15, 0.45, 0.45, 0.45]),
        [(8, "kl_acceleration")],
    ),
    # entropy 0.8 -> 0.05: the last window's mean falls under 0.1 x 0.8 at step 5
    "entropy_collapse": (
        series(policy__entropy=[0.8, 0.8, 0.8, 0.05, 0.05, 0.05, 0.05]),
        [(5, "entropy_collapse")],
    ),
    # turns at half the cap, then at 95%: mean of steps 3-5 reaches 0.9 at step 5
    "length_drift": (
        series(health__turn_len_frac=[0.5, 0.5, 0.5, 0.95, 0.95, 0.95]),
        [(5, "length_drift")],
    ),
    # an agent that stops calling its tools: 1 call an episode -> 0 (floored at 0.1) < 1/3
    "tool_call_shift": (
        series(health__tool_calls=[1, 1, 1, 0, 0, 0], reward__mean=[0.5] * 6),
        [(5, "tool_call_shift")],
    ),
    # reward up 0.3 while the verifier's accuracy stays at 0.2
    "reward_without_correctness": (
        series(reward__mean=[0.2, 0.2, 0.2, 0.5, 0.5, 0.5], health__correctness=[0.2] * 6),
        [(5, "reward_without_correctness")],
    ),
    # 3 segments an episode at step 1 (2 seals each > 1); fires again once it cleared at step 2
    "seals": (
        series(identity__segments_per_episode=[1.0, 3.0, 1.0, 2.5, 2.5]),
        [(1, "seals"), (3, "seals")],
    ),
    "identity_violations": (series(identity__violations=[0, 0, 2]), [(2, "identity_violations")]),
}
# the same rules, the metrics just short of each threshold
HEALTHY = {
    "kl_acceleration": series(loss__kl_ref=[0.1, 0.1, 0.1, 0.15, 0.15, 0.15, 0.24, 0.24, 0.24]),
    "entropy_collapse": series(policy__entropy=[0.8, 0.8, 0.8, 0.09, 0.09, 0.09]),
    # already at the cap from the start: no drift
    "length_drift": series(health__turn_len_frac=[0.95] * 6),
    # calls multiply, and the reward rises with them: the calls pay
    "tool_call_shift": series(
        health__tool_calls=[0.3, 0.3, 0.3, 1.5, 1.5, 1.5],
        reward__mean=[0.2, 0.2, 0.2, 0.6, 0.6, 0.6],
    ),
    "reward_without_correctness": series(
        reward__mean=[0.2, 0.2, 0.2, 0.5, 0.5, 0.5],
        health__correctness=[0.2, 0.2, 0.2, 0.21, 0.21, 0.21],
    ),
    "seals": series(identity__segments_per_episode=[2.0] * 5),
    "identity_violations": series(identity__violations=[0] * 5),
}


@pytest.mark.parametrize("rule", list(TRIPPED))
def test_each_rule_fires_where_its_condition_starts_to_hold(tmp_path, rule):
    steps, expected = TRIPPED[rule]
    assert fired(config(tmp_path), steps) == expected


@pytest.mark.parametrize("rule", list(HEALTHY))
def test_each_rule_stays_quiet_just_short_of_its_threshold(tmp_path, rule):
    assert fired(config(tmp_path), HEALTHY[rule]) == []


def test_a_rules_threshold_is_its_config_key(tmp_path):
    steps = series(policy__entropy=[0.8, 0.8, 0.8, 0.2, 0.2, 0.2])
    assert fired(config(tmp_path), steps) == []
    assert fired(config(tmp_path, "alarm.entropy_collapse=0.3"), steps) == [(5, "entropy_collapse")]
    assert fired(config(tmp_path, "alarm.entropy_collapse=0.3", "alarm.enabled=false"), steps) == []


# a real geo3k run (`molt-wb train +recipe=geo3k`, seed 0, 30 steps), its metrics as stored: the
# reward rises from 0.24 to 0.92 as the policy learns to call its tool (0.31 -> 1.69 calls an
# episode) and its accuracy with it; entropy falls to a sixth
GEO3K = series(
    reward__mean=[0.2406, 0.1813, 0.2687, 0.2687, 0.325, 0.3531, 0.2344, 0.4094, 0.4344, 0.2656]
    + [0.3219, 0.4938, 0.4375, 0.4906, 0.4937, 0.5719, 0.4094, 0.5687, 0.4344, 0.6625]
    + [0.4937, 0.6062, 0.5469, 0.6813, 0.5781, 0.775, 0.6875, 0.5469, 0.8031, 0.9156],
    policy__entropy=[0.0695, 0.0866, 0.0738, 0.0719, 0.0746, 0.0674, 0.0744, 0.0556, 0.0643]
    + [0.0642, 0.0707, 0.066, 0.0522, 0.0594, 0.0499, 0.0415, 0.0449, 0.0399, 0.0385, 0.0291]
    + [0.035, 0.0272, 0.0337, 0.0344, 0.0273, 0.0172, 0.0194, 0.0369, 0.0209, 0.012],
    health__turn_len_frac=[0.547, 0.569, 0.575, 0.555, 0.567, 0.593, 0.576, 0.604, 0.608, 0.561]
    + [0.608, 0.634, 0.622, 0.641, 0.601, 0.675, 0.609, 0.672, 0.627, 0.673, 0.648, 0.639]
    + [0.653, 0.617, 0.683, 0.72, 0.66, 0.66, 0.713, 0.717],
    health__tool_calls=[0.312, 0.344, 0.375, 0.375, 0.375, 0.562, 0.5, 0.562, 0.812, 0.375, 0.625]
    + [0.875, 0.812, 0.906, 0.812, 1.5, 0.875, 1.312, 1.219, 1.375, 1.25, 1.25, 1.219, 1.312]
    + [1.438, 1.438, 1.688, 1.312, 1.625, 1.688],
    health__correctness=[0.156, 0.097, 0.188, 0.188, 0.25, 0.281, 0.167, 0.344, 0.375, 0.188]
    + [0.25, 0.438, 0.375, 0.452, 0.438, 0.531, 0.344, 0.531, 0.387, 0.625, 0.438, 0.562]
    + [0.516, 0.656, 0.531, 0.75, 0.656, 0.5, 0.781, 0.906],
    identity__segments_per_episode=[1.0] * 30,
)


@pytest.mark.parametrize("window", [3, 5, 10])
def test_a_real_geo3k_run_that_learns_trips_no_alarm(tmp_path, window):
    assert fired(config(tmp_path, f"alarm.window={window}"), GEO3K) == []


def test_health_metrics_read_turns_and_what_the_plugin_reports_of_each_episode():
    episodes = [
        # an episode sealed once: its last segment's info is the episode's
        {"rollout_id": 0, "segment_idx": 0, "turn_spans": [[5, 9]], "info": {"tool_calls": 0}},
        {"rollout_id": 0, "segment_idx": 1, "turn_spans": [[7, 15]], "info": {"tool_calls": 2}},
        {"rollout_id": 1, "segment_idx": 0, "turn_spans": [[3, 3 + 6]], "info": {"accuracy": 1.0}},
    ]
    # turns of 4, 8 and 6 tokens of 16; calls reported by one episode (2), accuracy by one (1.0)
    assert health_metrics(episodes, 16, "accuracy") == {
        "health/turn_len_frac": 6 / 16,
        "health/tool_calls": 2.0,
        "health/correctness": 1.0,
    }
    assert health_metrics([], 16, "accuracy") == {}


def fed_store(tmp_path, run_id: str, steps: list[dict[str, float]], start: int = 0):
    """A real store actor (in this process) given `steps` of metrics from `start` on, as the loop
    logs them (a `start` past 0 resumes the run), then a checkpoint of it; and (step, line) of
    each line the driver announced after logging that step."""
    cfg = compose_config(
        ["tracking=none", f"run.root={tmp_path / 'runs'}", f"run.id={run_id}", "alarm.window=3"]
        + [f"run.resume={bool(start)}"]
    )
    run_dir, row = run_folder.start_run(cfg)
    store = StoreActor(run_folder.plain(cfg), str(run_dir), row)
    announcer = Announcer(run_dir, f"molt-wb runs {run_id}")
    announced = []
    for step, metrics in enumerate(steps[start:], start=start):
        store.log(step, metrics)
        announced += [(step, line) for line in announcer.lines()]
    # the store's shard marks, as the driver saves them with a checkpoint
    checkpoint = run_dir / "checkpoints" / f"step-{len(steps):06d}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "writer.json").write_text(json.dumps(store.checkpoint()))
    store.close("finished")
    return announced


def test_a_firing_is_a_row_a_line_at_its_step_and_a_summary_line(tmp_path):
    steps = series(policy__entropy=[0.8, 0.8, 0.8, 0.05, 0.05, 0.05, 0.05], reward__mean=[0.5] * 7)
    announced = fed_store(tmp_path, "collapse", steps)
    evidence = "policy/entropy 0.05 over steps 3-5, below 0.1 times its 0.8 over steps 0-2"
    assert announced == [
        (5, f"alarm at step 5, entropy_collapse: {evidence} (molt-wb runs collapse)")
    ]
    db = open_run("collapse", tmp_path / "runs")
    [row] = db.execute(
        "select step, rule, metric, value, threshold, evidence from alarms"
    ).fetchall()
    assert row == (5, "entropy_collapse", "policy/entropy", approx(0.05), approx(0.08), evidence)
    summary = render(figures("collapse", tmp_path / "runs"), tmp_path / "runs")
    assert f"alarms     step 5 entropy_collapse: {evidence}" in summary.splitlines()
    shown = CliRunner().invoke(app, ["runs", "collapse", "--root", str(tmp_path / "runs")])
    assert f"alarms     step 5 entropy_collapse: {evidence}" in shown.output
    assert (
        RunData("collapse", tmp_path / "runs").headline()["alarms"] == "entropy_collapse at step 5"
    )


def test_a_run_with_no_firing_says_so(tmp_path):
    fed_store(tmp_path, "calm", series(policy__entropy=[0.8] * 6))
    summary = render(figures("calm", tmp_path / "runs"), tmp_path / "runs")
    assert "alarms     none fired" in summary.splitlines()
    assert RunData("calm", tmp_path / "runs").headline()["alarms"] == "none"


def test_a_resumed_run_replays_its_metrics_and_does_not_fire_twice(tmp_path):
    steps = series(policy__entropy=[0.8, 0.8, 0.8, 0.05, 0.05, 0.05, 0.05, 0.05])
    assert [step for step, _ in fed_store(tmp_path, "resumed", steps[:6])] == [5]
    assert fed_store(tmp_path, "resumed", steps, start=6) == []
    db = open_run("resumed", tmp_path / "runs")
    assert db.execute("select step, rule from alarms").fetchall() == [(5, "entropy_collapse")]


def test_a_window_of_0_is_refused_with_one_sentence(tmp_path):
    with pytest.raises(ValueError, match=r"^alarm.window must be at least 1 step"):
        config(tmp_path, "alarm.window=0")


@pytest.mark.slow
def test_a_learning_rate_that_collapses_entropy_fires_while_the_same_run_at_its_own_rate_does_not(
    tmp_path,
):
    root = tmp_path / "runs"
    command = [sys.executable, "-m", "workbench.cli", "train", "-m", "+recipe=arith"]
    command += ["trainer.lr=1e-3,0.05", "trainer.steps=12", "alarm.window=3", "tracking=none"]
    command += ["trainer.prompts_per_step=4", "run.progress=false", f"run.root={root}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    runs = {}
    for row in (json.loads(path.read_text()) for path in root.glob("*/run.json")):
        runs[row["config"]["trainer"]["lr"]] = row["run_id"]
    calm = open_run(runs[1e-3], root).execute("select rule from alarms").fetchall()
    hot = open_run(runs[0.05], root).execute("select step, rule, evidence from alarms").fetchall()
    assert calm == []
    # the collapsed policy may also run its replies to the cap (length_drift)
    [(step, _, evidence)] = [alarm for alarm in hot if alarm[1] == "entropy_collapse"]
    assert f"alarm at step {step}, entropy_collapse: {evidence}" in result.stdout + result.stderr
