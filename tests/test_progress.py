"""Progress of long work: a rich bar on a terminal, one line per interval when piped, for the
model build, the warm start and the RL steps."""

import shutil
import sys

from omegaconf import OmegaConf

from workbench.api import load_plugin
from workbench.models.tiny import tiny_model_path
from workbench.run.progress import Progress, Task, stage
from workbench.run.sft import warm_started_path


def test_piped_progress_prints_the_first_update_then_one_line_per_interval_and_the_last(capsys):
    task = Task("build", 100, interval_s=3600)
    for done in range(1, 101):
        task.update(done, f"loss {1 / done:.2f}")
    task.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["build 1/100", "build 100/100"]
    assert lines[0].startswith("build 1/100: loss 1.00  (") and lines[0].endswith(" s left)")
    assert lines[1] == "build 100/100: loss 0.01  (0 s left)"
    every = Task("steps", 3, interval_s=0)
    for done in (1, 2, 3):
        every.update(done)
    assert len(capsys.readouterr().out.splitlines()) == 3


def test_a_terminal_gets_a_rich_bar_with_time_left_and_no_lines(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    with Task("warm start", 10) as task:
        task.update(4, "loss 0.50")
        (bar,) = task.bar.tasks
        assert (bar.completed, bar.total, bar.fields["info"]) == (4, 10, "loss 0.50")
        columns = [type(column).__name__ for column in task.bar.columns]
        assert "TimeRemainingColumn" in columns and "MofNCompleteColumn" in columns
    drawn = capsys.readouterr().out
    # the bar is drawn (terminal codes), not written as a piped line
    assert "\x1b[" in drawn and "loss 0.50" in drawn and "4/10:" not in drawn


def test_rl_steps_show_reward_and_tokens_per_s_and_are_silent_when_off(tmp_path, capsys):
    run = {"id": "r1", "progress": True, "root": str(tmp_path)}
    cfg = OmegaConf.create({"run": run, "trainer": {"steps": 2}})
    progress = Progress(cfg)
    progress.update({"train/version": 1, "reward/mean": 0.25, "perf/tokens_per_s": 900.4})
    assert capsys.readouterr().out.startswith("r1 1/2: reward 0.250  900 tok/s  (")
    assert progress.done == 1
    cfg.run.progress = False
    Progress(cfg).update({"train/version": 1, "reward/mean": 0.5, "perf/tokens_per_s": 1.0})
    assert capsys.readouterr().out == ""


def test_a_stage_says_when_it_starts_and_ends_and_keeps_transformers_bars_quiet(capsys):
    from transformers.utils import logging

    with stage("building model tiny"):
        assert not logging.is_progress_bar_enabled()
    assert logging.is_progress_bar_enabled()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "building model tiny ..."
    assert lines[1].startswith("building model tiny: done in ")


def test_the_warm_start_shows_step_loss_and_time_left(tmp_path, capsys):
    base = tmp_path / "tiny"
    shutil.copytree(tiny_model_path(), base)
    arith = load_plugin("arith")
    path = warm_started_path(base, arith, "source", steps=3, lr=1e-3, seed=0, batch=4)
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("warm start tiny ")]
    assert steps[0].startswith("warm start tiny 1/3: loss ")
    assert steps[-1].startswith("warm start tiny 3/3: loss ") and steps[-1].endswith("(0 s left)")
    assert (path / "config.json").exists()
