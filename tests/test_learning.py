"""The arith recipe learns: mean reward over the last steps clearly above the first, for every seed.

Margin chosen from measured runs (seeds 0-5 at the recipe's defaults): last-10 minus first-10
mean reward was 0.36 to 0.53; we require 0.2.
"""

import subprocess
import sys

import pytest

from workbench.store import open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_arith_recipe_reward_rises(tmp_path, seed):
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "train",
        "+recipe=arith",
        f"seed={seed}",
        f"run.root={tmp_path}",
        "run.id=learn",
        "tracking=none",
        "run.progress=false",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rewards = [
        r
        for (r,) in open_run("learn", str(tmp_path))
        .execute("select value from metrics where key = 'reward/mean' order by step")
        .fetchall()
    ]
    assert len(rewards) == 80
    first = sum(rewards[:10]) / 10
    last = sum(rewards[-10:]) / 10
    assert last - first >= 0.2, (first, last)
