"""Recovery at any moment: a learner SIGKILLed before its run's first checkpoint or inside a
checkpoint write leaves a run that finishes by itself (trainer.max_restarts), or with the very
command its error names, holding the rows of the uninterrupted run of the same seed, token for
token."""

import shlex
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pytest
from test_reliability import FAST, kill_actors, wait_for

from workbench import cli
from workbench.config import compose_config
from workbench.models.state import HOLD
from workbench.run import loop
from workbench.run.faults import RunFailed
from workbench.run.progress import Progress
from workbench.store import open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

# checkpoints after loop steps 1 and 3: step-000002 and step-000004, each with an evaluation
COMMON = ["trainer.steps=4", "trainer.checkpoint_every=2", "eval.every=2", "eval.size=4"]


@pytest.fixture(scope="module")
def in_process() -> Iterator[Callable[..., str]]:
    """Runs in this process share one Ray; `train(root, *overrides)` runs one to the end."""
    import ray

    def train(root: Path, *overrides: str) -> str:
        return loop.train(compose_config([*FAST, *COMMON, f"run.root={root}", *overrides]))

    yield train
    ray.shutdown()


@pytest.fixture(scope="module")
def whole(
    tmp_path_factory: pytest.TempPathFactory, in_process: Callable[..., str]
) -> duckdb.DuckDBPyConnection:
    """The uninterrupted run every interrupted one is compared with."""
    root = tmp_path_factory.mktemp("whole")
    in_process(root, "run.id=whole")
    return open_run("whole", str(root))


def after_step(monkeypatch: pytest.MonkeyPatch, done: int, action: Callable[[], object]) -> list:
    """`action()` once, right after the run's `done`-th step is logged (after the checkpoint
    that step may write)."""
    update = Progress.update
    acted = []

    def update_then_act(self: Progress, metrics: dict) -> None:
        update(self, metrics)
        if self.done == done and not acted:
            acted.append(action())

    monkeypatch.setattr(Progress, "update", update_then_act)
    return acted


def kill_inside_a_write(run_dir: Path, killed: list[int]) -> None:
    """Once a checkpoint write is held halfway (its sharded state written, the `HOLD` file
    present), SIGKILL the learner; then let writes go on."""
    hold = run_dir / "checkpoints" / HOLD
    try:
        wait_for(lambda: any(run_dir.glob("checkpoints/step-*.tmp/state/.metadata")))
        # a process SIGKILLed runs no more code: the write can go on in none but a new learner
        killed.extend(kill_actors("ray::Learner"))
    finally:
        hold.unlink()


def held_kill(monkeypatch: pytest.MonkeyPatch, run_dir: Path, done: int) -> list[int]:
    """The learner SIGKILLed inside the checkpoint write that follows the `done`-th step; the
    pids killed."""
    killed = []

    def hold() -> None:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / HOLD).touch()
        threading.Thread(target=kill_inside_a_write, args=(run_dir, killed), daemon=True).start()

    after_step(monkeypatch, done, hold)
    return killed


def assert_same_rows(db: duckdb.DuckDBPyConnection, whole: duckdb.DuckDBPyConnection) -> None:
    """`db` finished its 4 steps with every row once, and the rows of `whole`, token for token."""
    assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 4)
    for table, key in (("segments", "rollout_id, segment_idx"), ("metrics", "step, key")):
        duplicates = f"select count(*) - count(distinct ({key})) from {table}"
        assert db.execute(duplicates).fetchone()[0] == 0
    versions = "select list(value order by step) from metrics where key = 'train/version'"
    assert db.execute(versions).fetchone()[0] == [1, 2, 3, 4]
    sampled = (
        "select step, rollout_id, group_id, response_text, reward, advantage, min_version "
        "from segments order by all"
    )
    assert db.execute(sampled).fetchall() == whole.execute(sampled).fetchall()
    tokens = "select * exclude (run_id) from tokens order by all"
    assert db.execute(tokens).fetchall() == whole.execute(tokens).fetchall()
    # an evaluation at a checkpoint's step is part of it: none lost, none twice
    evaluations = "select step, n, mean_reward, accuracy from eval order by all"
    assert db.execute(evaluations).fetchall() == whole.execute(evaluations).fetchall()
    assert [step for step, *_ in db.execute(evaluations).fetchall()] == [1, 3]


def checkpoints(run_dir: Path) -> list[str]:
    """The names in a run's checkpoints/ folder (committed ones, and any .tmp or hold left)."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_learner_killed_before_the_first_checkpoint_starts_again_from_step_0_by_itself(
    tmp_path, in_process, whole, monkeypatch, capfd
):
    killed = after_step(monkeypatch, 1, lambda: kill_actors("ray::Learner"))
    in_process(tmp_path, "trainer.max_restarts=1", "run.id=early")
    monkeypatch.undo()
    assert len(killed) == 1
    assert "recovering from step 0 as it has no checkpoint yet" in capfd.readouterr().err
    db = open_run("early", str(tmp_path))
    assert db.execute("select died, steps_done, checkpoint from recoveries").fetchall() == [
        ("learner", 1, None)
    ]
    assert checkpoints(tmp_path / "early") == ["step-000002", "step-000004"]
    assert_same_rows(db, whole)


@pytest.mark.slow
@pytest.mark.parametrize(("done", "went_on_from"), [(1, None), (3, "step-000002")])
def test_a_learner_killed_inside_a_checkpoint_write_goes_on_from_the_one_before(
    tmp_path, in_process, whole, monkeypatch, done, went_on_from
):
    run_dir = tmp_path / "held"
    killed = held_kill(monkeypatch, run_dir, done)
    in_process(tmp_path, "trainer.max_restarts=1", "run.id=held")
    monkeypatch.undo()
    assert len(killed) == 1
    db = open_run("held", str(tmp_path))
    assert db.execute("select died, checkpoint from recoveries").fetchall() == [
        ("learner", went_on_from)
    ]
    # the write the kill cut short was dropped, never taken for a checkpoint
    assert checkpoints(run_dir) == ["step-000002", "step-000004"]
    assert_same_rows(db, whole)


@pytest.mark.slow
def test_a_learner_killed_before_the_first_checkpoint_names_a_resume_that_starts_it_again(
    tmp_path, in_process, whole, monkeypatch
):
    after_step(monkeypatch, 1, lambda: kill_actors("ray::Learner"))
    with pytest.raises(RunFailed) as failed:
        in_process(tmp_path, "trainer.max_restarts=0", "run.id=stopped")
    monkeypatch.undo()
    advice = (
        f"start it again from step 0 (it has no checkpoint yet) with: molt-wb resume stopped "
        f"--root {tmp_path}"
    )
    assert str(failed.value).startswith("The learner process died")
    assert str(failed.value).endswith(advice)
    assert open_run("stopped", str(tmp_path)).execute("select status from runs").fetchone() == (
        "failed",
    )
    # the command as the error gives it
    with pytest.raises(SystemExit) as exited:
        cli.main(shlex.split(advice.split("with: ")[1])[1:])
    assert exited.value.code == 0
    db = open_run("stopped", str(tmp_path))
    assert db.execute("select resumes, resumed_from from runs").fetchone() == (1, None)
    assert_same_rows(db, whole)
