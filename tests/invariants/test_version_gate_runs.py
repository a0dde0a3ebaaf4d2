"""Policy-version semantics in real runs: δ ≈ 0 on-policy, mixed versions and stale drops when
asynchronous, and a deliberate corruption of behavior log-probs caught and recorded by the gate."""

import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.learner.learner import Learner
from workbench.rollout.worker import RolloutWorker
from workbench.run.data import Prompts
from workbench.store import open_run
from workbench.store.schema import step_tables
from workbench.store.writer import RunWriter

# each test trains a run end to end (the full suite; the fast loop skips them)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_ray")]

FAST = [
    "+recipe=arith",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "run.id=gate",
]


def train(tmp_path, *overrides):
    result = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "train", *FAST, f"run.root={tmp_path}", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return open_run("gate", str(tmp_path))


def test_on_policy_every_sequence_is_kept_with_unit_weights(tmp_path):
    db = train(tmp_path, "trainer.steps=4", "gate.level=geo", "gate.band=[0.999,1.001]")
    assert db.execute(
        "select count(*), count(*) filter (where decision = 'kept' and reason = 'ok') "
        "from gate_decisions"
    ).fetchone() == (4 * 16, 4 * 16)
    # measured: |δ| ≤ 2e-6 in float32 between the cached engine and the learner's full forward
    worst = db.execute(
        "select max(abs(train_logprob - behavior_logprob)), max(abs(is_weight - 1)) "
        "from tokens where loss_mask = 1"
    ).fetchone()
    assert worst[0] < 1e-4 and worst[1] < 1e-4
    assert db.execute("select max(staleness) from gate_decisions").fetchone()[0] == 0


def test_async_partial_rollout_spans_versions_and_stale_sequences_are_dropped(tmp_path):
    # replies long enough that generating a batch outlasts a learner step, so pushes land
    # mid-generation
    db = train(
        tmp_path,
        "trainer.steps=8",
        "trainer.async_depth=2",
        "rollout.partial=true",
        "engine.max_tokens=96",
        "gate.level=token",
        "gate.max_staleness=1",
    )
    mixed_versions = "select count(*) from segments where min_version < max_version"
    mixed = db.execute(mixed_versions).fetchone()[0]
    assert mixed > 0, "no sequence held tokens of two weight versions"
    stale = db.execute(
        "select count(*), min(staleness) from gate_decisions where reason = 'stale'"
    ).fetchone()
    assert stale[0] > 0 and stale[1] > 1
    assert (
        db.execute(
            "select count(*) from gate_decisions where reason <> 'stale' and staleness > 1"
        ).fetchone()[0]
        == 0
    )
    # a dropped sequence contributes nothing: every one of its tokens has weight 0
    assert (
        db.execute(
            "select max(t.is_weight) from tokens t "
            "join gate_decisions g using (step, rollout_id, segment_idx) "
            "where g.reason = 'stale'"
        ).fetchone()[0]
        == 0
    )
    # each token's version is the one that sampled it: never newer than the learner that consumed it
    assert (
        db.execute(
            "select count(*) from tokens t join segments s using (step, rollout_id, segment_idx) "
            "where t.loss_mask = 1 and t.behavior_version > s.learner_version"
        ).fetchone()[0]
        == 0
    )
    stale_frac = db.execute(
        "select max(value) from metrics where key = 'gate/stale_frac'"
    ).fetchone()[0]
    assert stale_frac > 0


def test_whole_batch_rollouts_are_exactly_async_depth_versions_behind(tmp_path):
    """Without partial rollout each batch is sampled by the weights pushed before it was submitted:
    batch k by version max(0, k - async_depth), never older (the push is delivered before the next
    submit)."""
    db = train(
        tmp_path,
        "trainer.steps=3",
        "trainer.async_depth=1",
        "engine.max_tokens=4",
        "gate.level=seq",
        "trainer.prompts_per_step=2",
        "trainer.group_size=2",
    )
    rows = db.execute(
        "select step, min(min_version), max(max_version), max(learner_version) from segments "
        "group by step order by step"
    ).fetchall()
    assert rows == [(0, 0, 0, 0), (1, 0, 0, 1), (2, 1, 1, 2)]


def test_corrupted_behavior_logprobs_are_caught_and_recorded(tmp_path, tiny_path):
    cfg = compose_config(
        [
            "tracking=none",
            "gate.level=geo",
            "engine.max_tokens=6",
            "trainer.prompts_per_step=2",
            "trainer.group_size=4",
        ]
    )
    OmegaConf.update(cfg, "run.id", "corrupt")
    worker = RolloutWorker(cfg, tiny_path)
    learner = Learner(cfg, tiny_path)
    segments = worker.rollout(Prompts(cfg).next_jobs(1)[0])
    for index, segment in enumerate(segments[:4]):  # shift sampled log-probs by ±1 nat per token
        shift = 1.0 if index % 2 == 0 else -1.0
        segment.behavior_logprob[segment.loss_mask == 1] += shift
    metrics, rows = learner.train(segments)
    writer = RunWriter(
        tmp_path / "corrupt", {"run_id": "corrupt", "created": 0.0, "status": "running"}
    )
    for name, table in step_tables("corrupt", 0, rows["learner_version"], segments, rows).items():
        writer.append(name, table)
    writer.close()
    decisions = (
        open_run("corrupt", str(tmp_path))
        .execute(
            "select rollout_id, decision, reason, geo_ratio from gate_decisions order by rollout_id"
        )
        .fetchall()
    )
    # behavior +1 nat -> δ = -1 per token -> geo ratio e^-1 = 0.37 < 0.5;
    # behavior -1 nat -> e^1 = 2.72 > 2
    for rollout_id, decision, reason, geo_ratio in decisions[:4]:
        expected = "ratio_low" if rollout_id % 2 == 0 else "ratio_high"
        assert (decision, reason) == ("dropped", expected)
        assert abs(geo_ratio - (np.exp(-1) if expected == "ratio_low" else np.exp(1))) < 1e-3
    assert all(d[1:3] == ("kept", "ok") for d in decisions[4:])
    assert metrics["gate/kept_frac"] == 0.5 and metrics["mismatch/max_abs_logprob_diff"] > 0.99


def test_weights_pushed_mid_generation_are_adopted_between_token_steps(tiny_path):
    engine = TorchEngine(tiny_path, partial=True)
    new_weights = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
    pusher = threading.Thread(
        target=lambda: (time.sleep(0.15), engine.load_weights(new_weights, 1))
    )
    pusher.start()
    (generation,) = engine.generate(
        [np.arange(3, 9, dtype=np.int32)], SamplingParams(max_tokens=400, temperature=1.0)
    )
    pusher.join()
    versions = generation.versions.tolist()
    # one switch, in order
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    torch.testing.assert_close(
        engine.model.state_dict()["lm_head.weight"], new_weights["lm_head.weight"]
    )


def test_without_partial_rollout_an_episode_keeps_one_version(tiny_path):
    engine = TorchEngine(tiny_path, partial=False)
    new_weights = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
    pusher = threading.Thread(
        target=lambda: (time.sleep(0.15), engine.load_weights(new_weights, 1))
    )
    pusher.start()
    prompts = [np.arange(3, 9, dtype=np.int32)]
    with engine.hold():
        first = engine.generate(prompts, SamplingParams(max_tokens=400))[0]
        time.sleep(0.2)
        second = engine.generate(prompts, SamplingParams(max_tokens=4))[0]
    pusher.join()
    assert set(first.versions) == set(second.versions) == {0} and engine.version == 1


def test_an_async_run_repeats_exactly_with_the_same_seed(tmp_path):
    """Queued rollout batches may reach a worker in either order; each engine call is seeded by its
    batch and turn, so the same seed gives the same samples (and the same run) every time."""
    runs = [
        train(tmp_path / name, "trainer.steps=6", "trainer.async_depth=1", "gate.level=token")
        for name in "ab"
    ]
    ids = [
        db.execute(
            "select list(token_id order by rollout_id, segment_idx, position) from tokens"
        ).fetchone()[0]
        for db in runs
    ]
    rewards = [
        db.execute(
            "select list(value order by step) from metrics where key = 'reward/mean'"
        ).fetchone()[0]
        for db in runs
    ]
    assert (
        runs[0].execute("select count(distinct rollout_id) from tokens").fetchone()[0] == 6 * 16
        and ids[0] == ids[1]
    )
    assert rewards[0] == rewards[1]


def learner_batch(tiny_path, *overrides):
    """A learner on the tiny model and one on-policy batch of 8 of its episodes."""
    cfg = compose_config(
        [
            "tracking=none",
            "engine.max_tokens=6",
            "trainer.prompts_per_step=2",
            "trainer.group_size=4",
            *overrides,
        ]
    )
    OmegaConf.update(cfg, "run.id", "composed")
    segments = RolloutWorker(cfg, tiny_path).rollout(Prompts(cfg).next_jobs(1)[0])
    return Learner(cfg, tiny_path), segments


def test_a_corrupted_token_is_vetoed_under_a_geo_filter_and_recorded(tmp_path, tiny_path):
    learner, segments = learner_batch(
        tiny_path, "gate=geo_veto", "gate.veto=100", "gate.band=[0.001,1000]"
    )
    # one sampled token of segment 0 made 12 nats likelier than the learner's: δ = -12
    # (e^-12 < 1/100), while the geo mean over its tokens stays inside the wide band
    segments[0].behavior_logprob[np.flatnonzero(segments[0].loss_mask)[0]] += 12.0
    metrics, rows = learner.train(segments)
    writer = RunWriter(tmp_path / "veto", {"run_id": "veto", "created": 0.0, "status": "running"})
    for name, table in step_tables("veto", 0, rows["learner_version"], segments, rows).items():
        writer.append(name, table)
    writer.close()
    decisions = (
        open_run("veto", str(tmp_path))
        .execute("select decision, reason, geo_ratio from gate_decisions order by rollout_id")
        .fetchall()
    )
    assert decisions[0][:2] == ("dropped", "veto") and 1e-3 < decisions[0][2] < 1
    assert all(row[:2] == ("kept", "ok") for row in decisions[1:])
    assert metrics["gate/kept_frac"] == 7 / 8


@pytest.mark.parametrize(("bypass", "forwards"), [(False, 3), (True, 2)])
def test_bypass_skips_the_pi_old_forward_and_takes_the_behavior_log_probs(
    tiny_path, bypass, forwards
):
    learner, segments = learner_batch(
        tiny_path, "trainer.minibatches=2", "trainer.steps=2", f"gate.bypass={bypass}"
    )
    calls = []
    learner.model.register_forward_hook(lambda *_: calls.append(1))
    metrics, rows = learner.train(segments)
    # π_old (unless bypassed), then one forward per minibatch
    assert len(calls) == forwards
    behavior = np.concatenate([s.behavior_logprob for s in segments])
    stored = np.concatenate(rows["train_logprob"])
    assert np.array_equal(stored, behavior) == bypass
    assert rows["gate"]["reason"] == ["ok"] * 8 and metrics["train/version"] == 2


def test_a_run_stores_each_tokens_entropy_and_its_step_mean(tmp_path):
    db = train(tmp_path, "trainer.steps=2")
    counts = db.execute("select count(*), count(entropy) from tokens").fetchone()
    assert counts[0] > 0 and counts[0] == counts[1]
    means = db.execute(
        "select step, avg(entropy) filter (where loss_mask = 1) from tokens group by step "
        "order by step"
    ).fetchall()
    metric = db.execute(
        "select step, value from metrics where key = 'policy/entropy' order by step"
    ).fetchall()
    assert [step for step, _ in metric] == [0, 1]
    for (_, mean), (_, value) in zip(means, metric, strict=True):
        # at most the entropy of the uniform distribution over the tiny model's 512 ids
        assert value == pytest.approx(mean, rel=1e-5) and 0 < value <= math.log(512)


@pytest.mark.parametrize("anchor", ["behavior", "old"])
def test_an_async_run_clips_against_the_behavior_policy_at_one_minibatch(tmp_path, anchor):
    """gate.anchor=behavior (the asynchronous default): the PPO ratio of a stale batch is taken
    against the policy that sampled it, so the clip binds though there is one optimizer step per
    batch; against π_old the ratio is exactly 1 and the clip never acts."""
    db = train(
        tmp_path,
        "trainer.steps=4",
        "trainer.async_depth=1",
        "gate.level=token",
        # a policy that gets some answers right: an untrained one has no advantage to learn from
        "model.warm_start_steps=100",
        f"gate.anchor={anchor}",
    )
    ratio, clipped = db.execute(
        "select max(abs(value - 1)) filter (where key = 'loss/ratio_mean'), "
        "max(value) filter (where key = 'loss/clip_frac') from metrics where step > 0"
    ).fetchone()
    weights = db.execute(
        "select count(*) filter (where is_weight not in (0, 1)) from tokens where loss_mask = 1"
    ).fetchone()[0]
    if anchor == "behavior":
        assert ratio > 1e-3 and clipped > 0 and weights == 0
    else:
        assert ratio < 1e-6 and clipped == 0 and weights > 0
