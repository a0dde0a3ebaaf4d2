"""The collective weight transport (`ray.weight_transport=collective`): a rollout worker that Ray
restarts joins a new weight group with learner rank 0 and the other workers, and the run goes on
without going back to a checkpoint, also when it died while the learner broadcast to it; one dead
for good stops the run at once."""

import json
import subprocess
import sys

import pytest
from test_reliability import FAST, FAULTY, data_file, rows

from workbench.config import compose_config
from workbench.run import loop
from workbench.run.data import Prompts
from workbench.store import open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")


def collective(tmp_path, run_id, *more):
    """Overrides of a 2-worker run on the collective transport, over the faults file's 8 rows."""
    return [
        *FAST,
        f"run.root={tmp_path}",
        f"run.id={run_id}",
        "ray.weight_transport=collective",
        "ray.rollout_workers=2",
        *more,
        f"data.path={data_file(tmp_path / 'faults.jsonl', rows(8))}",
    ]


def first_samples(overrides, batches):
    """Each worker's first sample id in each of the first `batches` batches."""
    draws = Prompts(compose_config(overrides))
    return [[jobs[0].sample["id"] for jobs in draws.next_jobs(2)] for _ in range(batches)]


@pytest.mark.slow
def test_a_dead_or_hung_rollout_worker_rejoins_the_weight_group_and_the_run_goes_on(tmp_path):
    import ray

    path = tmp_path / "faults.jsonl"
    overrides = collective(tmp_path, "rejoin", "trainer.steps=3", "rollout.timeout_s=15")
    first = first_samples(overrides, 3)
    faults = rows(8)
    # step 1: worker 1 dies; step 2: worker 0 hangs and is killed
    faults[first[1][1]].update(fault="exit", marker=str(tmp_path / "exited"))
    faults[first[2][0]].update(fault="hang", marker=str(tmp_path / "hung"))
    data_file(path, faults)
    try:
        loop.train(compose_config(overrides))
    finally:
        ray.shutdown()

    db = open_run("rejoin", str(tmp_path))
    assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 3)
    assert db.execute("select count(distinct step) from segments").fetchone()[0] == 3
    failed = db.execute(
        "select kind, step, worker, count(*) from failed_episodes group by all order by all"
    ).fetchall()
    assert failed == [("timeout", 2, 0, 2), ("worker_died", 1, 1, 2)]
    # every step's weights went through the group, the restarted workers' included
    query = "select count(*) from metrics where key = 'perf/weight_sync_bytes' and value > 1e6"
    assert db.execute(query).fetchone()[0] == 3
    # the restarted workers sample with the learner's current weights, not the first ones
    assert db.execute("select count(*) from segments where min_version <> step").fetchone()[0] == 0
    # no recovery from a checkpoint
    assert "recoveries" not in json.loads((tmp_path / "rejoin" / "run.json").read_text())


# the fixture's episodes, each first sleeping its row's `delay` seconds
DELAYED = """import time

from workbench.api import load_plugin


class Delayed(load_plugin({faulty!r}).Faulty):
    def step(self, action):
        time.sleep(self.sample.get("delay", 0))
        return super().step(action)


AgentRunner = Delayed
"""


@pytest.mark.slow
def test_a_rollout_worker_that_dies_beside_the_learners_step_rejoins_without_waiting(tmp_path):
    path = tmp_path / "faults.jsonl"
    plugin = tmp_path / "delayed.py"
    plugin.write_text(DELAYED.format(faulty=FAULTY))
    overrides = collective(
        tmp_path,
        "rejoin-async",
        f"agent.plugin={plugin}",
        "trainer.async_depth=1",
        "gate=token",
        "trainer.steps=4",
        "trainer.timeout_s=900",
    )
    first = first_samples(overrides, 4)
    faults = rows(8)
    # batch 1 runs beside step 0: worker 1 dies in it (after 1 s) while worker 0 still samples
    # batch 0 (3 s), so before the learner broadcasts step 0's weights to it
    faults[first[0][0]].update(delay=3)
    faults[first[1][1]].update(fault="exit", marker=str(tmp_path / "exited"), delay=1)
    data_file(path, faults)
    # nothing waited for trainer.timeout_s: such a wait would outlast this command's limit, however
    # loaded the machine (no wall-clock bound on the run itself)
    command = [sys.executable, "-m", "workbench.cli", "train", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    db = open_run("rejoin-async", str(tmp_path))
    assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 4)
    failed = db.execute(
        "select kind, step, worker, count(*) from failed_episodes group by all order by all"
    ).fetchall()
    assert failed == [("worker_died", 1, 1, 2)]
    # one version behind; step 2's batch (the restarted worker's too) on the weights of step 0
    versions = "select step, min(min_version), max(min_version) from segments group by 1 order by 1"
    assert db.execute(versions).fetchall() == [(0, 0, 0), (1, 0, 0), (2, 1, 1), (3, 2, 2)]
    # step 0's broadcast failed (its weights went through the object store); the group formed
    # again carried every later push
    query = "select step, value > 1e6 from metrics where key = 'perf/weight_sync_bytes' order by 1"
    assert db.execute(query).fetchall() == [(0, False), (1, True), (2, True), (3, True)]
    # no recovery from a checkpoint
    run = json.loads((tmp_path / "rejoin-async" / "run.json").read_text())
    assert "recoveries" not in run


@pytest.mark.slow
def test_a_rollout_worker_dead_for_good_stops_the_run_at_once(tmp_path):
    path = tmp_path / "faults.jsonl"
    # nor the run from step 0 (recovery.py)
    overrides = collective(
        tmp_path, "dead", "rollout.max_restarts=0", "trainer.max_restarts=0", "trainer.steps=3"
    )
    first = first_samples(overrides, 2)
    faults = rows(8)
    # step 1: worker 1 dies, and Ray may not restart it
    faults[first[1][1]].update(fault="exit", marker=str(tmp_path / "exited"))
    data_file(path, faults)
    # not after waiting 5 minutes for it to come back (faults.when_back): such a wait would outlast
    # this command's limit, however loaded the machine
    command = [sys.executable, "-m", "workbench.cli", "train", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 1
    assert "The rollout worker process died" in done.stderr
