"""The run store: whole shards only, readable by another process while written, crash-safe."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from workbench.segment import Segment
from workbench.store import list_runs, open_run, resolve_run
from workbench.store.schema import step_tables
from workbench.store.writer import RunWriter


def make_segments(count: int, length: int = 10, step: int = 0) -> list[Segment]:
    mask = np.r_[np.zeros(length - 4), np.ones(4)].astype(np.uint8)
    return [
        Segment(
            "r1",
            step * 100 + i,
            0,
            i // 2,
            np.arange(length, dtype=np.int32) + i,
            mask,
            (-mask * 0.5).astype(np.float32),
            np.where(mask == 1, step, -1).astype(np.int32),
            reward=float(i % 2),
        )
        for i in range(count)
    ]


def learner_rows(segments):
    return {
        "train_logprob": [s.behavior_logprob - 0.1 for s in segments],
        "is_weight": [np.ones(len(s.token_ids), np.float32) for s in segments],
        "advantage": [float(i) for i in range(len(segments))],
        "gate": {
            "staleness": [0] * len(segments),
            "seq_log_ratio": [-0.4] * len(segments),
            "geo_ratio": [0.9] * len(segments),
            "kept": [True] * len(segments),
            "reason": ["ok"] * len(segments),
            "tokens_masked": [0] * len(segments),
        },
    }


def write_step(writer, step, count=4, length=10):
    segments = make_segments(count, length, step)
    for name, table in step_tables("r1", step, step, segments, learner_rows(segments)).items():
        writer.append(name, table)


def test_rows_round_trip_through_duckdb_views(tmp_path):
    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    write_step(writer, 0)
    write_step(writer, 1, count=3, length=7)
    writer.close("finished")
    db = open_run("r1", str(tmp_path))
    assert db.execute("select count(*) from tokens").fetchone()[0] == 4 * 10 + 3 * 7
    assert db.execute("select sum(num_tokens) from segments").fetchone()[0] == 61
    # per-token columns are the segment's arrays, in order
    row = db.execute(
        "select list(token_id order by position), list(loss_mask order by position), "
        "list(behavior_version order by position) from tokens where step = 1 and rollout_id = 102"
    ).fetchone()
    assert (
        row[0] == list(range(2, 9))
        and row[1] == [0, 0, 0, 1, 1, 1, 1]
        and row[2] == [-1, -1, -1, 1, 1, 1, 1]
    )
    assert db.execute(
        "select min_version, max_version, advantage from segments where rollout_id = 102"
    ).fetchone() == (1, 1, 2.0)
    assert db.execute("select status from runs").fetchone()[0] == "finished"


def test_views_are_valid_before_the_first_flush_and_grow_live(tmp_path):
    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    db = open_run("r1", str(tmp_path))
    assert db.execute("select count(*) from tokens").fetchone()[0] == 0
    write_step(writer, 0)
    assert db.execute("select count(*) from tokens").fetchone()[0] == 0  # buffered, not yet flushed
    writer.flush()
    assert db.execute("select count(*) from tokens").fetchone()[0] == 40


WRITER_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from store.test_store import write_step
    from workbench.store.writer import RunWriter
    writer = RunWriter({run_dir!r}, {{"run_id": "r1", "created": 1.0, "status": "running"}})
    for step in range(1000):
        write_step(writer, step)
        if step % 2 == 1:
            writer.flush()
            print(step, flush=True)
        time.sleep(0.02)
""")


def start_writer(tmp_path):
    script = WRITER_SCRIPT.format(
        tests=os.path.dirname(os.path.dirname(__file__)), run_dir=str(tmp_path / "r1")
    )
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def test_another_process_reads_while_the_writer_runs_and_a_kill_loses_only_the_buffer(tmp_path):
    writer = start_writer(tmp_path)
    try:
        for _ in range(5):
            last_flushed = int(writer.stdout.readline())
        # a second process (this one) queries while the writer is alive and writing
        live = open_run("r1", str(tmp_path)).execute("select count(*) from tokens").fetchone()[0]
        assert live >= (last_flushed + 1) * 40 and live % 80 == 0
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    flushed_steps = (
        open_run("r1", str(tmp_path))
        .execute("select count(distinct step), max(step) from tokens")
        .fetchone()
    )
    # every flushed step, none torn
    assert flushed_steps[0] == flushed_steps[1] + 1 >= last_flushed + 1
    for path in (tmp_path / "r1" / "tokens").glob("part-*.parquet"):
        # every visible shard is a whole file
        duckdb.execute(f"select count(*) from '{path}'").fetchone()


def test_runs_are_listed_newest_first_and_found_by_prefix(tmp_path):
    for index, run_id in enumerate(["20260101-aaaa", "20260102-bbbb"]):
        RunWriter(
            tmp_path / run_id, {"run_id": run_id, "created": float(index), "status": "finished"}
        ).close()
    assert [r["run_id"] for r in list_runs(str(tmp_path))] == ["20260102-bbbb", "20260101-aaaa"]
    assert resolve_run("20260102", str(tmp_path)).name == "20260102-bbbb"
    with pytest.raises(ValueError, match="ambiguous"):
        resolve_run("2026010", str(tmp_path))
    with pytest.raises(ValueError, match="Close matches: 20260101-aaaa"):
        resolve_run("20260101-aaab", str(tmp_path))


def test_run_row_updates_are_atomic_json(tmp_path):
    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    writer.update_run(steps_done=3, reward_mean=0.5)
    row = json.loads((tmp_path / "r1" / "run.json").read_text())
    assert (
        row["steps_done"] == 3 and row["status"] == "running" and row["updated"] >= row["created"]
    )
    assert not list((tmp_path / "r1").glob(".*.tmp"))


def test_a_steps_progress_reaches_run_json_with_the_data_it_counts(tmp_path):
    writer = RunWriter(
        tmp_path / "r2", {"run_id": "r2", "created": 1.0, "status": "running", "steps_done": 0}
    )
    writer.update_run(at_flush=True, steps_done=4)
    # not before its data
    assert json.loads((tmp_path / "r2" / "run.json").read_text())["steps_done"] == 0
    writer.flush()
    assert json.loads((tmp_path / "r2" / "run.json").read_text())["steps_done"] == 4


def test_entropy_is_stored_per_token_and_null_without_a_learner_or_in_older_shards(tmp_path):
    # a run from before the entropy column: its shards lack it
    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    segments = make_segments(2, length=5)
    old = step_tables("r1", 0, 0, segments, learner_rows(segments))["tokens"].drop(["entropy"])
    for path in (tmp_path / "r1" / "tokens").glob("*.parquet"):
        path.unlink()
    writer._write_shard("tokens", old)
    # resumed by the new code: a step with entropy, one without (molt-wb serve: no learner)
    segments = make_segments(2, length=5, step=1)
    rows = learner_rows(segments)
    rows["entropy"] = [np.linspace(0.0, 0.4, 5, dtype=np.float32) + i for i in range(2)]
    writer.append("tokens", step_tables("r1", 1, 1, segments, rows)["tokens"])
    writer.append("tokens", step_tables("r1", 2, 2, segments, learner_rows(segments))["tokens"])
    writer.close("finished")
    db = open_run("r1", str(tmp_path))
    assert db.execute(
        "select step, count(*), count(entropy) from tokens group by step order by step"
    ).fetchall() == [(0, 10, 0), (1, 10, 10), (2, 10, 0)]
    entropy = db.execute(
        "select list(entropy order by position) from tokens where step = 1 and rollout_id = 101"
    ).fetchone()[0]
    assert entropy == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])


def test_each_tokens_turn_and_the_episodes_turn_rewards_are_stored_and_null_in_older_shards(
    tmp_path,
):
    # a run from before the columns: its shards lack them
    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    segments = make_segments(1, length=6)
    tables = step_tables("r1", 0, 0, segments, learner_rows(segments))
    for name, column in (("tokens", "turn"), ("segments", "turn_rewards")):
        for path in (tmp_path / "r1" / name).glob("*.parquet"):
            path.unlink()
        writer._write_shard(name, tables[name].drop([column]))
    # resumed by the new code: an episode of three turns, its third in a second segment
    first, second = make_segments(2, length=6, step=1)
    second.rollout_id = first.rollout_id
    second.segment_idx = 1
    first.turn_spans = [(2, 4), (4, 6)]
    second.turn_spans = [(2, 6)]
    second.first_turn = 2
    for segment in (first, second):
        segment.turn_rewards = [0.5, 0.0, 1.0]
    tables = step_tables("r1", 1, 1, [first, second], learner_rows([first, second]))
    for name in ("tokens", "segments"):
        writer.append(name, tables[name])
    writer.close("finished")
    db = open_run("r1", str(tmp_path))
    assert db.execute(
        "select step, segment_idx, list(turn order by position) from tokens "
        "group by step, segment_idx order by step, segment_idx"
    ).fetchall() == [
        (0, 0, [None] * 6),
        (1, 0, [None, None, 0, 0, 1, 1]),
        (1, 1, [None, None, 2, 2, 2, 2]),
    ]
    assert db.execute(
        "select step, segment_idx, turn_rewards from segments order by step, segment_idx"
    ).fetchall() == [(0, 0, None), (1, 0, [0.5, 0.0, 1.0]), (1, 1, [0.5, 0.0, 1.0])]


def test_compare_reads_the_same_figures_from_the_same_store_every_time(tmp_path):
    # float sums depend on their order: a reader on several threads summed the shards in whatever
    # order they finished and printed tokens/s differing in the last digit from call to call
    from workbench.store.compare import compare_rows

    writer = RunWriter(tmp_path / "r1", {"run_id": "r1", "created": 1.0, "status": "running"})
    values = np.random.default_rng(0).lognormal(4.0, 3.0, size=64 * 32)
    for step, chunk in enumerate(np.split(values, 64)):
        rows = {
            "run_id": ["r1"] * len(chunk),
            "step": [step] * len(chunk),
            "key": ["perf/tokens_per_s"] * len(chunk),
            "value": chunk.tolist(),
            "time": [0.0] * len(chunk),
        }
        writer.append("metrics", pa.table(rows))
        writer.flush()
    writer.close("finished")
    readings = {compare_rows(["r1"], str(tmp_path))[1][0]["tokens_per_s"] for _ in range(30)}
    assert len(readings) == 1 and readings.pop() == pytest.approx(values.mean())
