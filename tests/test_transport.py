"""The collective weight transport (`ray.weight_transport=collective`): a rollout worker that Ray
restarts joins a new weight group with learner rank 0 and the other workers, and the run goes on
without going back to a checkpoint."""

import json

import pytest
from test_reliability import FAST, data_file, rows

from workbench import loop
from workbench.config import compose_config
from workbench.data import Prompts
from workbench.store import open_run


@pytest.mark.slow
def test_a_dead_or_hung_rollout_worker_rejoins_the_weight_group_and_the_run_goes_on(tmp_path):
    import ray

    path = tmp_path / "faults.jsonl"
    overrides = [
        *FAST,
        f"run.root={tmp_path}",
        "run.id=rejoin",
        "ray.weight_transport=collective",
        "ray.rollout_workers=2",
        "trainer.steps=3",
        "rollout.timeout_s=5",
        f"data.path={data_file(path, rows(6))}",
    ]
    draws = Prompts(compose_config(overrides))
    # each worker's first sample of batches 0-2
    first = [[jobs[0].sample["id"] for jobs in draws.next_jobs(2)] for _ in range(3)]
    faults = rows(6)
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
