"""Reliability: a run killed mid-way resumes into the run it would have been; a dead, hung or
raising episode is recorded and the run goes on; SIGTERM stops cleanly; bad data and bad resumes
are refused."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pytest
from omegaconf import OmegaConf

from workbench.config import ConfigError, compose_config
from workbench.learner.learner import Learner
from workbench.models.state import save_learner
from workbench.rollout.worker import Job, RolloutWorker
from workbench.run import loop, summary
from workbench.run.checkpoint import resume_config
from workbench.run.data import Prompts
from workbench.run.faults import RunFailed
from workbench.run.progress import Progress
from workbench.store import list_runs, open_run
from workbench.store.writer import RunWriter

FAULTY = str(Path(__file__).parent / "fixtures" / "faulty.py")
FAULTY_CHAT = str(Path(__file__).parent / "fixtures" / "faulty_chat.py")
FAST = [
    "+recipe=arith",
    f"agent.plugin={FAULTY}",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
    "engine.max_tokens=4",
    "run.flush_seconds=0",
]


def data_file(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def rows(count: int, **fields) -> list[dict]:
    return [
        dict({"id": i, "problem": f"What is {i % 5} + 1?", "answer": i % 5 + 1}, **fields)
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def in_process():
    """Runs in this process share one Ray; `train(root, *overrides)` runs one to the end."""
    import ray

    def train(root, *overrides):
        return loop.train(compose_config([*FAST, f"run.root={root}", *overrides]))

    yield train
    ray.shutdown()


def kill_actors(title: str) -> list[int]:
    """SIGKILL this process's Ray actor processes whose title starts with `title` (e.g.
    "ray::Learner"), as the OOM killer would; their pids."""
    killed = []
    for process in psutil.Process().children(recursive=True):
        if " ".join(process.cmdline()).startswith(title):
            process.kill()
            killed.append(process.pid)
    return killed


def wait_for(condition, seconds=300):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def run_json(root, run_id) -> dict:
    path = Path(root, run_id, "run.json")
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_into_the_uninterrupted_run(tmp_path, in_process):
    common = ["trainer.steps=4", "trainer.checkpoint_every=2"]
    # killed: this worker's 13th episode (the 4th step) never ends; SIGKILL once step 3 is written
    killed_data = data_file(tmp_path / "killed.jsonl", rows(8, hang_at=13))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "train",
            *FAST,
            *common,
            f"run.root={tmp_path}",
            "run.id=killed",
            f"data.path={killed_data}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            lambda: (
                run_json(tmp_path, "killed").get("steps_done") == 3 or process.poll() is not None
            )
        )
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()] == ["step-000002"]
    assert [r["status"] for r in list_runs(str(tmp_path))] == ["crashed"]
    # past the checkpoint
    last_step = "select max(step) from segments"
    assert open_run("killed", str(tmp_path)).execute(last_step).fetchone()[0] == 2

    in_process(
        tmp_path,
        *common,
        "run.id=whole",
        f"data.path={data_file(tmp_path / 'whole.jsonl', rows(8))}",
    )
    # as if it had crashed a day ago: the day between the two sessions is no run time
    crashed = run_json(tmp_path, "killed")
    day = 86_400.0
    moved = crashed | {"created": crashed["created"] - day, "updated": crashed["updated"] - day}
    (tmp_path / "killed" / "run.json").write_text(json.dumps(moved))
    loop.train(resume_config("killed", [f"run.root={tmp_path}"]))
    first_session = crashed["updated"] - crashed["created"]
    assert run_json(tmp_path, "killed")["ran_s"] == pytest.approx(first_session)
    assert first_session < summary.figures("killed", str(tmp_path))["wall_s"] < day

    killed = open_run("killed", str(tmp_path))
    whole = open_run("whole", str(tmp_path))
    for db in (killed, whole):
        assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 4)
        assert (
            db.execute(
                "select count(*) - count(distinct (rollout_id, segment_idx)) from segments"
            ).fetchone()[0]
            == 0
        )
        assert (
            db.execute("select count(*) - count(distinct (step, key)) from metrics").fetchone()[0]
            == 0
        )
        assert (
            db.execute("select count(*) from tokens").fetchone()[0]
            == db.execute("select sum(num_tokens) from segments").fetchone()[0]
        )
        # versions continue: step s was sampled and consumed at version s, and left version s + 1
        assert (
            db.execute(
                "select count(*) from segments where min_version <> step or max_version <> step "
                "or learner_version <> step"
            ).fetchone()[0]
            == 0
        )
        assert db.execute(
            "select list(value order by step) from metrics where key = 'train/version'"
        ).fetchone()[0] == [1, 2, 3, 4]
    # same data and ids step by step; and every row, past the checkpoint too, token for token
    ids = "select step, rollout_id, group_id, prompt_text from segments order by all"
    assert killed.execute(ids).fetchall() == whole.execute(ids).fetchall()
    sampled = (
        "select step, rollout_id, response_text, reward, advantage, min_version from segments "
        "order by all"
    )
    assert killed.execute(sampled).fetchall() == whole.execute(sampled).fetchall()
    tokens = "select * exclude (run_id) from tokens order by all"
    assert killed.execute(tokens).fetchall() == whole.execute(tokens).fetchall()
    assert run_json(tmp_path, "killed")["resumes"] == 1


@pytest.mark.slow
def test_dead_hung_and_raising_episodes_are_recorded_and_the_run_goes_on(tmp_path, in_process):
    path = tmp_path / "faults.jsonl"
    overrides = [
        "trainer.steps=3",
        "rollout.timeout_s=15",
        f"data.path={data_file(path, rows(6))}",
        "run.id=faults",
    ]
    draws = Prompts(compose_config([*FAST, *overrides]))
    # first sample of batches 0-2
    first = [draws.next_jobs(1)[0][0].sample["id"] for _ in range(3)]
    faults = rows(6)
    # step 0: one group's reward code raises
    faults[first[0]]["fault"] = "raise"
    # step 1: the worker dies ...
    faults[first[1]].update(fault="exit", marker=str(tmp_path / "exited"))
    # ... its batch drawn again hangs
    faults[first[2]].update(fault="hang", marker=str(tmp_path / "hung"))
    data_file(path, faults)

    in_process(tmp_path, *overrides)

    db = open_run("faults", str(tmp_path))
    assert db.execute("select status, steps_done from runs").fetchone() == ("finished", 3)
    assert db.execute("select count(distinct step) from segments").fetchone()[0] == 3
    failed = db.execute(
        "select kind, step, count(*) from failed_episodes group by all order by all"
    ).fetchall()
    # (the raising row may come again)
    assert {("env_error", 0, 2), ("worker_died", 1, 4), ("timeout", 1, 4)} <= set(failed)
    assert {kind for kind, _, _ in failed} == {"env_error", "worker_died", "timeout"}
    error, trace = db.execute(
        "select error, traceback from failed_episodes where kind = 'env_error'"
    ).fetchone()
    assert (
        error == "ValueError: reward code failed on purpose"
        and "faulty.py" in trace
        and "in step" in trace
    )
    assert (
        "rollout.timeout_s=15"
        in db.execute(
            "select any_value(error) from failed_episodes where kind = 'timeout'"
        ).fetchone()[0]
    )
    # a failed episode never reaches the batch
    assert (
        db.execute(
            "select count(*) from segments join failed_episodes using (rollout_id)"
        ).fetchone()[0]
        == 0
    )
    # the restarted worker samples with the learner's current weights, not the first ones
    assert db.execute("select count(*) from segments where min_version <> step").fetchone()[0] == 0


@pytest.mark.slow
def test_a_dead_learner_fails_the_run_with_one_sentence_and_keeps_what_was_written(
    tmp_path, in_process, monkeypatch
):
    update = Progress.update

    def kill_the_learner_after_step_2(self, metrics):
        update(self, metrics)
        if self.done == 2:
            kill_actors("ray::Learner")

    monkeypatch.setattr(Progress, "update", kill_the_learner_after_step_2)
    with pytest.raises(
        RunFailed,
        match=rf"^The learner process died .*: molt-wb resume dead-learner --root {tmp_path}$",
    ):
        in_process(tmp_path, "trainer.steps=30", "trainer.max_restarts=0", "run.id=dead-learner")
    db = open_run("dead-learner", str(tmp_path))
    assert db.execute("select status from runs").fetchone()[0] == "failed"
    assert db.execute("select count(distinct step) from segments where step < 2").fetchone()[0] == 2


def test_a_learner_step_past_trainer_timeout_s_fails_the_run_with_one_sentence(
    tmp_path, in_process
):
    with pytest.raises(
        RunFailed,
        match=r"^Step 0: the learner gave no result within trainer.timeout_s=0.001 s .* "
        rf"molt-wb resume hung-learner --root {tmp_path}$",
    ):
        in_process(tmp_path, "trainer.steps=3", "trainer.timeout_s=0.001", "run.id=hung-learner")
    assert run_json(tmp_path, "hung-learner")["status"] == "failed"


def test_a_chat_agent_that_raises_or_returns_no_result_fails_only_its_episode(tiny_path):
    cfg = compose_config(
        [
            "+recipe=arith",
            f"agent.plugin={FAULTY_CHAT}",
            "model.warm_start_steps=0",
            "engine.max_tokens=4",
        ]
    )
    worker = RolloutWorker(cfg, tiny_path)
    jobs = [
        Job({"problem": "Say 1.", "fault": fault}, group, group)
        for group, fault in enumerate(["raise", None, "none"])
    ]
    segments, failures = worker.rollout_with_failures(jobs)
    assert [s.rollout_id for s in segments] == [1]
    assert [(f["rollout_id"], f["kind"]) for f in failures] == [
        (0, "agent_error"),
        (2, "agent_error"),
    ]
    assert (
        failures[0]["error"] == "RuntimeError: agent failed on purpose"
        and "faulty_chat.py" in failures[0]["traceback"]
    )
    assert failures[1]["error"] == "TypeError: FaultyChat.run returned dict, not a Result"
    # every session closed, nothing left half-open
    assert not worker.server().sessions


def test_a_chat_agents_turn_rewards_reach_its_segments_and_a_miscount_fails_its_episode(tiny_path):
    cfg = compose_config([f"agent.plugin={FAULTY_CHAT}", "engine.max_tokens=4"])
    worker = RolloutWorker(cfg, tiny_path)
    # one policy call each: one turn reward, two, none given
    turn_rewards = [[0.25], [0.25, 0.75], None]
    jobs = [Job({"problem": "Say 1.", "turn_rewards": t}, k, k) for k, t in enumerate(turn_rewards)]
    segments, failures = worker.rollout_with_failures(jobs)
    # none given: the episode's reward at its last turn
    assert [(s.rollout_id, s.reward, s.turn_rewards) for s in segments] == [
        (0, 1.0, [0.25]),
        (2, 1.0, [1.0]),
    ]
    assert [(f["rollout_id"], f["kind"], f["error"]) for f in failures] == [
        (
            1,
            "agent_error",
            "ValueError: FaultyChat.run returned 2 turn_rewards for 1 policy calls: give one "
            "reward per call.",
        )
    ]


@pytest.mark.slow
def test_sigterm_stops_a_run_cleanly_marked_interrupted(tmp_path, in_process):
    data = data_file(tmp_path / "d.jsonl", rows(4, hang_at=5))  # the 2nd step never ends

    def terminate_after_step_one():
        wait_for(lambda: run_json(tmp_path, "term").get("steps_done") == 1)
        os.kill(os.getpid(), signal.SIGTERM)  # to this process, the run's driver

    threading.Thread(target=terminate_after_step_one, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        in_process(tmp_path, "trainer.steps=3", "run.id=term", f"data.path={data}")
    db = open_run("term", str(tmp_path))
    assert db.execute("select status, steps_done from runs").fetchone() == ("interrupted", 1)
    # flushed at the stop
    assert db.execute("select count(*) from segments where step = 0").fetchone()[0] == 4


@pytest.mark.parametrize(
    "plugin, content, words",
    [
        ("arith", "", "has no samples"),
        ("arith", '{"question": "1 + 1?", "answer": 2}\n', "has no 'problem' column"),
        ("arith", '{"problem": "1 + 1?"\n', "is not JSON lines"),
        ("arith", "[1, 2]\n", "not objects"),
        (
            "geo3k",
            '{"images": ["bm90IGFuIGltYWdl"], "problem": "x?", "answer": "1"}\n',
            "image 0 cannot be opened",
        ),
    ],
)
def test_bad_data_is_refused_before_anything_starts(tmp_path, plugin, content, words):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=words):
        loop.train(
            compose_config(
                [*FAST[:1], f"agent.plugin={plugin}", f"data.path={path}", f"run.root={tmp_path}"]
            )
        )
    assert not list(tmp_path.glob("*/run.json"))  # no run was started


def test_bad_resumes_are_refused_with_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="No run 'nope'"):
        resume_config("nope", [f"run.root={tmp_path}"])
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r", "status": "crashed"}))
    with pytest.raises(ConfigError, match="has no config.yaml"):
        resume_config("r", [f"run.root={tmp_path}"])
    saved = compose_config(["+recipe=arith", "trainer.steps=4"])
    (run / "config.yaml").write_text(OmegaConf.to_yaml(saved, resolve=True))
    # no checkpoint yet: it starts again from step 0, unless it finished, which that would undo
    assert resume_config("r", [f"run.root={tmp_path}"]).run.resume
    (run / "checkpoints" / "step-000004.tmp").mkdir(parents=True)  # half-written: not a checkpoint
    (run / "run.json").write_text(json.dumps({"run_id": "r", "status": "finished"}))
    with pytest.raises(ConfigError, match="finished with no checkpoint"):
        resume_config("r", [f"run.root={tmp_path}"])
    (run / "checkpoints" / "step-000004").mkdir()
    with pytest.raises(ConfigError, match="larger trainer.steps"):
        resume_config("r", [f"run.root={tmp_path}"])
    with pytest.raises(ConfigError, match="Bad override"):
        resume_config("r", [f"run.root={tmp_path}", "trainer.nope=3"])
    (run / "run.json").write_text(
        json.dumps({"status": "running", "pid": os.getpid(), "host": socket.gethostname()})
    )
    with pytest.raises(ConfigError, match="still running"):
        resume_config("r", [f"run.root={tmp_path}", "trainer.steps=8"])


def test_the_writer_flushes_on_a_schedule_without_being_asked(tmp_path):
    writer = RunWriter(
        tmp_path / "r", {"run_id": "r", "created": 1.0, "status": "running"}, flush_seconds=0.2
    )
    writer.flush_every(0.2)
    writer.append(
        "metrics",
        pa.table(
            {"run_id": ["r"], "step": [0], "key": ["reward/mean"], "value": [0.5], "time": [1.0]}
        ),
    )
    db = open_run("r", str(tmp_path))
    # no flush() call
    wait_for(lambda: db.execute("select count(*) from metrics").fetchone()[0] == 1, seconds=60)
    writer.close("finished")
    assert db.execute("select count(*) from metrics").fetchone()[0] == 1  # once, not again at close


def test_a_checkpoint_saves_after_the_folder_the_policy_was_loaded_from_is_gone(
    tmp_path, tiny_path
):
    # a resumed run loads its policy from a checkpoint that keep_checkpoints later deletes
    loaded_from = tmp_path / "step-000002" / "policy"
    shutil.copytree(tiny_path, loaded_from)
    cfg = compose_config(["+recipe=arith", "tracking=none"])
    learner = Learner(cfg, str(loaded_from))
    shutil.rmtree(loaded_from.parent)
    out = tmp_path / "step-000006"
    out.mkdir()
    save_learner(learner, str(out), {"step": 6})
    side = sorted(f.name for f in Path(tiny_path).iterdir() if "tokenizer" in f.name)
    assert side, "the tiny model has tokenizer files"
    for name in side:
        assert (out / "policy" / name).read_bytes() == (Path(tiny_path) / name).read_bytes()


@pytest.mark.slow
def test_a_chat_agent_run_resumed_from_its_checkpoint_samples_as_the_uninterrupted_run(
    tmp_path, in_process
):
    # the agents' requests reach the engine in whatever batches their timing makes
    chat = ["agent.plugin=chat_minimal", "trainer.checkpoint_every=2", "engine.max_tokens=6"]
    in_process(tmp_path, *chat, "trainer.steps=4", "run.id=whole")
    in_process(tmp_path, *chat, "trainer.steps=2", "run.id=halted")
    loop.train(resume_config("halted", [f"run.root={tmp_path}", "trainer.steps=4"]))
    whole = open_run("whole", str(tmp_path))
    halted = open_run("halted", str(tmp_path))
    sampled = "select step, rollout_id, response_text, reward from segments order by all"
    assert halted.execute(sampled).fetchall() == whole.execute(sampled).fetchall()
    assert halted.execute("select max(step) from segments").fetchone()[0] == 3
    ids = "select rollout_id, position, token_id from tokens order by all"
    assert halted.execute(ids).fetchall() == whole.execute(ids).fetchall()


@pytest.mark.slow
@pytest.mark.parametrize(("role", "title"), [("learner", "ray::Learner"), ("store", "ray::Store")])
def test_a_run_whose_learner_or_store_dies_recovers_from_its_checkpoint_by_itself(
    tmp_path, in_process, monkeypatch, capfd, role, title
):
    update = Progress.update
    killed = []

    def kill_once_after_step_3(self, metrics):
        update(self, metrics)
        if self.done == 3 and not killed:
            killed.extend(kill_actors(title))

    common = ["trainer.steps=4", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=1"]
    monkeypatch.setattr(Progress, "update", kill_once_after_step_3)
    in_process(tmp_path, *common, "run.id=recovered")
    monkeypatch.undo()
    assert len(killed) == 1
    assert f"The {role} process died" in capfd.readouterr().err
    in_process(tmp_path, *common, "run.id=whole")
    recovered = open_run("recovered", str(tmp_path))
    whole = open_run("whole", str(tmp_path))
    assert recovered.execute("select status, steps_done from runs").fetchone() == ("finished", 4)
    assert recovered.execute("select died, checkpoint from recoveries").fetchall() == [
        (role, "step-000002")
    ]
    assert whole.execute("select count(*) from recoveries").fetchone()[0] == 0
    # the checkpoint it started again from stays: a rollout worker Ray restarts loads it
    kept = sorted(p.name for p in (tmp_path / "recovered" / "checkpoints").iterdir())
    assert kept == ["step-000002", "step-000004"]
    # every row once, and the very rows of the run nothing happened to
    for table, key in (("segments", "rollout_id, segment_idx"), ("metrics", "step, key")):
        duplicates = f"select count(*) - count(distinct ({key})) from {table}"
        assert recovered.execute(duplicates).fetchone()[0] == 0
    sampled = "select step, rollout_id, response_text, reward, advantage from segments order by all"
    assert recovered.execute(sampled).fetchall() == whole.execute(sampled).fetchall()
    ids = "select rollout_id, position, token_id, behavior_version from tokens order by all"
    assert recovered.execute(ids).fetchall() == whole.execute(ids).fetchall()


@pytest.mark.slow
def test_a_run_whose_learner_dies_again_with_no_restarts_left_stops_failed(
    tmp_path, in_process, monkeypatch
):
    update = Progress.update

    def kill_the_learner_every_step_3(self, metrics):
        update(self, metrics)
        if self.done == 3:
            kill_actors("ray::Learner")

    monkeypatch.setattr(Progress, "update", kill_the_learner_every_step_3)
    with pytest.raises(RunFailed, match="^The learner process died"):
        in_process(
            tmp_path,
            "trainer.steps=5",
            "trainer.checkpoint_every=2",
            "trainer.max_restarts=1",
            "run.id=twice",
        )
    db = open_run("twice", str(tmp_path))
    assert db.execute("select status from runs").fetchone()[0] == "failed"
    assert db.execute("select died, checkpoint from recoveries").fetchall() == [
        ("learner", "step-000002")
    ]
