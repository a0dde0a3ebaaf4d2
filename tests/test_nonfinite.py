"""No silent NaN: the vision-language policy's figures are finite, and a NaN or inf put into any
path of a run (a metric, a per-token column, a loss, a reward) is counted, named with its step,
or refused in one sentence."""

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from workbench.algo.losses import policy_gradient_loss, token_logprobs_entropy
from workbench.config import ConfigError, compose_config
from workbench.learner.batch import batch_metrics
from workbench.run import faults
from workbench.run.faults import RunFailed
from workbench.run.summary import figures, render
from workbench.store import nonfinite, open_run
from workbench.store.actor import StoreActor
from workbench.store.alarms import Announcer
from workbench.tui.data import RunData

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

FIXTURES = Path(__file__).parent / "fixtures"
# the warm-started policy of a default geo3k run whose entropy and mismatch figures were NaN on
# every step (../shared/repro/geo3k-nan-warm, its weights stored as bfloat16)
NAN_WARM = FIXTURES / "geo3k-nan-warm"


def test_entropy_with_banned_ids_is_the_entropy_over_the_others_and_its_gradient_is_finite():
    """A vision marker's logit is -inf in every forward: 0·log 0 adds 0, not NaN."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    logits[..., [1, 4]] = float("-inf")
    logits.requires_grad_(True)
    token_ids = torch.tensor([[0, 2, 3, 5, 6], [6, 5, 3, 2, 0]])
    logprob, entropy = token_logprobs_entropy(logits, token_ids, temperature=0.7)
    allowed = logits.detach()[..., [0, 2, 3, 5, 6]] / 0.7
    expected = torch.distributions.Categorical(logits=allowed[:, :-1]).entropy()
    torch.testing.assert_close(entropy[:, 1:], expected)
    assert torch.isfinite(logprob).all()
    # the entropy bonus's gradient reaches the logits finite
    mask = torch.ones(2, 5)
    mask[:, 0] = 0
    loss, _ = policy_gradient_loss(
        logprob, logprob.detach(), torch.ones(2), mask, entropy=entropy, entropy_coef=0.1
    )
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_the_mismatch_figure_is_taken_only_where_the_mask_is_set():
    """A prompt's vision marker has a learner log-prob of -inf (outside the mask): -inf * 0 was
    NaN."""
    old = torch.tensor([[0.0, float("-inf"), -1.0, -2.0]])
    behavior = torch.tensor([[0.0, 0.0, -1.5, -2.0]])
    # the fields of a TrainBatch the metrics read
    batch = SimpleNamespace(
        loss_mask=torch.tensor([[0, 0, 1, 1]]),
        behavior_logprob=behavior,
        rewards=torch.tensor([1.0]),
        attention_mask=torch.ones(1, 4),
    )
    metrics = batch_metrics([None], batch, old, entropy=torch.zeros(1, 4))
    assert metrics["mismatch/max_abs_logprob_diff"] == pytest.approx(0.5)
    assert all(math.isfinite(value) for value in metrics.values())


def store_step(store: StoreActor, step: int, segments, rows, metrics: dict) -> None:
    rows["learner_version"] = step
    store.write_step(step, {"train/version": float(step + 1)} | metrics, rows, segments)


def test_each_nonfinite_value_is_counted_warned_once_and_named_with_its_first_step(tmp_path):
    from store.test_store import learner_rows, make_segments

    cfg = compose_config(["+recipe=arith", f"run.root={tmp_path}", "run.id=nan", "tracking=none"])
    row = {"run_id": "nan", "created": 0.0, "steps": 3, "status": "running", "config": {}}
    store = StoreActor(cfg, str(tmp_path / "nan"), row)
    # the driver's side prints the store's alarm rows (the actor's output goes to Ray's logs)
    announcer = Announcer(tmp_path / "nan", f"molt-wb runs nan --root {tmp_path}")
    clean = make_segments(2, length=5)
    store_step(store, 0, clean, learner_rows(clean), {"policy/entropy": 0.7})
    for step in (1, 2):
        segments = make_segments(2, length=5, step=step)
        rows = learner_rows(segments)
        rows["entropy"] = [np.array([0, 1, np.nan, 1, 1], np.float32)] * 2
        # a sampled token's learner log-prob of -inf
        rows["train_logprob"][0][-1] = -np.inf
        metrics = {"policy/entropy": float("nan"), "mismatch/kl": 0.0}
        store_step(store, step, segments, rows, metrics)
    store.close("finished")
    warned = announcer.lines()
    assert warned == [
        f"alarm at step 1, nonfinite: {key} has {bad} non-finite value(s) (NaN or inf); the run "
        f"goes on and counts them in audit/nonfinite/{key} (molt-wb runs nan --root {tmp_path})"
        for key, bad in [("policy/entropy", 1), ("tokens.entropy", 2), ("tokens.train_logprob", 1)]
    ]
    db = open_run("nan", str(tmp_path))
    audit = dict(
        db.execute(
            "select key, sum(value) from metrics where key like 'audit/%' group by key"
        ).fetchall()
    )
    assert audit == {
        "audit/nonfinite": 8.0,
        "audit/nonfinite/policy/entropy": 2.0,
        "audit/nonfinite/tokens.entropy": 4.0,
        "audit/nonfinite/tokens.train_logprob": 2.0,
    }
    assert nonfinite.scan(db) == {
        "policy/entropy": 2,
        "tokens.entropy": 4,
        "tokens.train_logprob": 2,
    }
    summary = render(figures("nan", str(tmp_path)), str(tmp_path)).splitlines()
    line = next(line for line in summary if line.startswith("NONFINITE"))
    assert line.startswith("NONFINITE  policy/entropy from step 1 (2 steps, 2 values)")
    assert "tokens.entropy from step 1" in line and "tokens.train_logprob from step 1" in line
    headline = RunData("nan", str(tmp_path)).headline()["non-finite"]
    assert headline == (
        "policy/entropy from step 1, tokens.entropy from step 1, tokens.train_logprob from step 1"
    )


def test_a_nonfinite_loss_or_gradient_stops_the_run_unless_told_to_warn():
    cfg = compose_config(["+recipe=arith", "run.id=nan"])
    metrics = {"loss/policy": 0.3, "loss/grad_norm": float("inf"), "policy/entropy": math.nan}
    with pytest.raises(RunFailed, match=r"Step 4's loss/grad_norm is not finite") as stopped:
        faults.nonfinite_loss(cfg, 4, metrics)
    assert "trainer.nonfinite=warn" in str(stopped.value)
    # a measurement alone never stops it
    faults.nonfinite_loss(cfg, 4, metrics | {"loss/grad_norm": 1.0})
    warn = compose_config(["+recipe=arith", "run.id=nan", "trainer.nonfinite=warn"])
    faults.nonfinite_loss(warn, 4, metrics)
    with pytest.raises(ConfigError, match="trainer.nonfinite='never' must be warn or stop"):
        compose_config(["+recipe=arith", "trainer.nonfinite=never"])


def train(tmp_path: Path, run_id: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "workbench.cli", "train", f"run.root={tmp_path}"]
    command += [f"run.id={run_id}", "tracking=none", "run.progress=false", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_a_nan_reward_fails_its_episode_in_one_sentence_and_reaches_no_figure(tmp_path):
    run = train(
        tmp_path,
        "nan",
        "+recipe=arith",
        f"agent.plugin={FIXTURES / 'nan_reward.py'}",
        "trainer.steps=2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "finite     every metric and per-token value" in run.stdout
    db = open_run("nan", str(tmp_path))
    errors = {e for (e,) in db.execute("select error from failed_episodes").fetchall()}
    assert errors == {
        "ValueError: Env.step returned the reward nan: a reward must be a finite number."
    }
    assert nonfinite.scan(db) == {}


@pytest.mark.slow
def test_the_reproductions_vision_language_policy_stores_only_finite_figures(tmp_path):
    """The reproduction: entropy and the mismatch's max were NaN at every step, every sampled
    token's entropy too."""
    run = train(
        tmp_path,
        "geo",
        "+recipe=geo3k",
        f"model.path={NAN_WARM}",
        "model.warm_start_steps=0",
        "trainer.steps=2",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    db = open_run("geo", str(tmp_path))
    assert nonfinite.scan(db) == {}
    sampled = db.execute(
        "select count(*), count(*) filter (where isfinite(entropy)) from tokens where loss_mask = 1"
    ).fetchone()
    assert sampled[0] > 0 and sampled[1] == sampled[0]
    figures_ = dict(
        db.execute(
            "select key, count(*) filter (where isfinite(value)) from metrics where key in "
            "('policy/entropy', 'mismatch/max_abs_logprob_diff') group by key"
        ).fetchall()
    )
    assert figures_ == {"policy/entropy": 2, "mismatch/max_abs_logprob_diff": 2}
