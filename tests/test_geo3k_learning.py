"""The default geo3k recipe learns on the CPU: over its RL steps the mean reward of the last 5
exceeds that of the first 5 by at least 0.15, and the share of right answers at least doubles.

Seed 0, the recipe's own settings (the README's table gives seeds 0, 1 and 2).
"""

import subprocess
import sys

import pytest

from workbench.store import nonfinite, open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")


@pytest.mark.slow
def test_geo3k_recipe_reward_rises_and_right_answers_double(tmp_path):
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "train",
        "+recipe=geo3k",
        "seed=0",
        f"run.root={tmp_path}",
        "run.id=learn",
        "tracking=none",
        "run.progress=false",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    db = open_run("learn", str(tmp_path))
    steps = db.execute("select steps from runs").fetchone()[0]
    rewards = [
        r
        for (r,) in db.execute(
            "select value from metrics where key = 'reward/mean' order by step"
        ).fetchall()
    ]
    assert len(rewards) == steps
    first = sum(rewards[:5]) / 5
    last = sum(rewards[-5:]) / 5
    assert last - first >= 0.15, (first, last)
    # a right answer earns 0.9 (accuracy) + 0.1 (format)
    right = db.execute(
        "select avg((reward >= 0.9)::int) filter (where step < 5), "
        f"avg((reward >= 0.9)::int) filter (where step >= {steps - 5}) from segments"
    ).fetchone()
    assert right[1] >= 2 * right[0] and right[1] > 0, right
    # every stored metric and per-token float is finite (entropy and the mismatch were NaN)
    assert nonfinite.scan(db) == {}
