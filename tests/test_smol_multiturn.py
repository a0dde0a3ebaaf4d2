"""The real model learns a multi-turn game: `+recipe=smol_guess_the_number` trains
SmolLM2-135M-Instruct on textarena's GuessTheNumber (1 to 8) through the textarena adapter, from
the cached conversion, for the recipe's first steps on seed 0.

Its reward rises over those steps, every episode is one segment of several turns (the chat history
grows turn by turn without a reseal), the turns of an episode train on different advantages
(algo.advantage=turn) and the token identity holds (0 violations). Skipped when textarena is absent,
or when neither the hub nor the registry is reachable and no conversion is cached.
"""

import subprocess
import sys

import pytest
from fixtures.multiturn import assert_one_segment_per_episode_with_turn_credit

from workbench.models import pretrained
from workbench.store import open_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_ray")]

# the steps the test runs of the recipe's ten, 2 prompts x 8 episodes each
STEPS = 3
# the rise the test requires of the mean reward of the steps after the first over the first step's
# (the base policy's): seed 0 measured 0.384 -> 0.683 over steps 2-3 (0.631 over steps 2-4; seed 0
# repeats its rewards step by step, docs/bring-your-env.md); less than half of it
RISE = 0.12


@pytest.fixture(scope="module")
def smollm() -> None:
    """The converted SmolLM2-135M-Instruct in the model cache: cached, or fetched and converted."""
    pytest.importorskip("textarena")
    if pretrained.cached_path("smollm2-135m"):
        return
    pytest.importorskip("gguf", reason="no SmolLM2 copy is cached and the gguf extra is absent")
    try:
        pretrained.pretrained_path("smollm2-135m")
    except pretrained.Unreachable as error:
        pytest.skip(str(error))


def test_smollm2_learns_guess_the_number_one_segment_per_episode_with_turn_credit(
    smollm: None, tmp_path
) -> None:
    command = [sys.executable, "-m", "workbench.cli", "train", "+recipe=smol_guess_the_number"]
    settings = [
        f"trainer.steps={STEPS}",
        f"run.root={tmp_path}",
        "run.id=smol-guess",
        "tracking=none",
        "run.progress=false",
    ]
    result = subprocess.run([*command, *settings], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "identity   0 violations" in result.stdout
    db = open_run("smol-guess", str(tmp_path))
    metric = "select value from metrics where key = 'reward/mean' order by step"
    rewards = [value for (value,) in db.execute(metric).fetchall()]
    assert len(rewards) == STEPS
    later = sum(rewards[1:]) / (STEPS - 1)
    assert later - rewards[0] >= RISE, rewards
    assert_one_segment_per_episode_with_turn_credit(db, STEPS * 2 * 8)
