"""Sweeps: Hydra multirun through the CLI, one sweep id, swept values recorded, compare read
back."""

import json
import subprocess
import sys

import matplotlib.image
import pytest

from workbench.store import list_runs, open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

FAST = [
    "+recipe=arith",
    "trainer.steps=2",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=2",
    "trainer.group_size=4",
]


def molt_wb(*args):
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_a_band_sweep_runs_every_job_and_compare_reads_them_back(tmp_path):
    result = molt_wb(
        "train",
        *FAST,
        f"run.root={tmp_path}",
        "gate.level=token",
        "gate.band=[0.5,2.0],[0.9,1.1],[0.99,1.01]",
        "-m",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list_runs(str(tmp_path))
    assert len(runs) == 3 and len({r["sweep_id"] for r in runs}) == 1
    assert sorted(r["swept"]["gate.band"] for r in runs) == sorted(
        ["[0.5,2.0]", "[0.9,1.1]", "[0.99,1.01]"]
    )
    assert sorted(tuple(r["config"]["gate"]["band"]) for r in runs) == [
        (0.5, 2.0),
        (0.9, 1.1),
        (0.99, 1.01),
    ]
    sweep_id = runs[0]["sweep_id"]
    listed = molt_wb("sweeps", "--root", str(tmp_path))
    assert sweep_id in listed.stdout and "gate.band" in listed.stdout
    out = molt_wb(
        "compare",
        sweep_id,
        "--root",
        str(tmp_path),
        "--json",
        "--plot",
        str(tmp_path / "sweep.png"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert [r["gate.band"] for r in rows] == [
        r["swept"]["gate.band"] for r in sorted(runs, key=lambda r: r["created"])
    ]
    for row in rows:
        db = open_run(row["run_id"], str(tmp_path))
        rewards = [
            v
            for (v,) in db.execute(
                "select value from metrics where key = 'reward/mean' order by step"
            ).fetchall()
        ]
        kept_query = "select avg(value) from metrics where key = 'gate/kept_frac'"
        kept = db.execute(kept_query).fetchone()[0]
        assert row["final_reward"] == rewards[-1] and row["best_reward"] == max(rewards)
        filtered = db.execute(
            "select avg(value) from metrics where key = 'gate/is_filter_ratio'"
        ).fetchone()[0]
        assert (
            abs(row["kept_frac"] - kept) < 1e-12
            and abs(row["kept_token_frac"] - (1 - filtered)) < 1e-12
        )
        assert row["status"] == "finished" and row["wall_s"] > 0
    image = matplotlib.image.imread(tmp_path / "sweep.png")
    # 11 x 4.2 inches at 100 dpi
    assert image.shape[0] >= 300 and image.shape[1] >= 800
    # something is drawn, not a blank canvas
    assert image[..., :3].std() > 0.05
    table = molt_wb("compare", sweep_id, "--root", str(tmp_path), "--csv")
    assert table.stdout.splitlines()[0].startswith("run_id,gate.band,status,final_reward")
    assert len(table.stdout.strip().splitlines()) == 4


@pytest.mark.slow
def test_parallel_sweep_with_m_first_and_a_failing_job_that_does_not_stop_it(tmp_path):
    good = tmp_path / "good.jsonl"
    bad = tmp_path / "bad.jsonl"
    good.write_text(
        "\n".join(json.dumps({"problem": f"What is {i} + 1?", "answer": i + 1}) for i in range(4))
    )
    bad.write_text(json.dumps({"problem": "no answer field"}))
    result = molt_wb(
        "train", "-m", *FAST, f"run.root={tmp_path}", "sweep.parallel=2", f"data.path={good},{bad}"
    )
    assert result.returncode == 1 and "1/2 runs finished" in result.stdout
    statuses = sorted(
        (r["swept"]["data.path"].endswith("bad.jsonl"), r["status"])
        for r in list_runs(str(tmp_path))
    )
    assert statuses == [(False, "finished"), (True, "failed")]
