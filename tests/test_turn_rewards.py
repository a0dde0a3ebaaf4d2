"""Per-turn rewards: an Env's reward at every turn reaches the learner as each turn's own advantage
(`algo.advantage=turn`), and the run store keeps each token's turn and each turn's reward."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.learner.learner import Learner
from workbench.rollout.worker import RolloutWorker
from workbench.run.data import Prompts
from workbench.store import open_run
from workbench.store.schema import step_tables
from workbench.store.writer import RunWriter

FIXTURES = Path(__file__).parent / "fixtures"


def advantages_by_definition(episodes: dict, discount: float) -> dict:
    """{(rollout, turn): advantage}, loop by loop: the discounted return of the turn less the mean
    return at that turn of its group's episodes that reached it (0 where none other did)."""
    returns = {}
    for rollout, (group, rewards) in episodes.items():
        ahead = 0.0
        for turn in reversed(range(len(rewards))):
            ahead = rewards[turn] + discount * ahead
            returns[rollout, turn] = (group, ahead)
    advantages = {}
    for (rollout, turn), (group, value) in returns.items():
        peers = [v for (_, t), (g, v) in returns.items() if (g, t) == (group, turn)]
        advantages[rollout, turn] = value - sum(peers) / len(peers) if len(peers) > 1 else 0.0
    return advantages


def test_each_turns_tokens_are_trained_on_that_turns_discounted_advantage(tiny_path, tmp_path):
    cfg = compose_config(
        [
            f"agent.plugin={FIXTURES / 'turn_rewards.py'}",
            "agent.max_turns=3",
            "algo.advantage=turn",
            "algo.turn_discount=0.5",
            "engine.max_tokens=4",
            "trainer.prompts_per_step=2",
            "trainer.group_size=3",
            "tracking=none",
        ]
    )
    OmegaConf.update(cfg, "run.id", "turns")
    worker = RolloutWorker(cfg, tiny_path)
    learner = Learner(cfg, tiny_path)
    segments = worker.rollout(Prompts(cfg).next_jobs(1)[0])
    metrics, rows = learner.train(segments)
    writer = RunWriter(tmp_path / "turns", {"run_id": "turns", "created": 1.0, "status": "running"})
    for name, table in step_tables("turns", 0, rows["learner_version"], segments, rows).items():
        writer.append(name, table)
    writer.close("finished")
    db = open_run("turns", str(tmp_path))
    episodes = {}
    stored = db.execute(
        "select rollout_id, group_id, reward, turn_rewards from segments "
        "order by rollout_id, segment_idx"
    ).fetchall()
    for rollout, group, reward, turn_rewards in stored:
        episodes.setdefault(rollout, (group, []))[1].extend(turn_rewards)
        # the episode's reward is still the sum of its steps' rewards
        assert reward == pytest.approx(sum(episodes[rollout][1]))
    # episodes of several lengths and rewards: turn baselines differ from episode ones
    assert {len(rewards) for _, rewards in episodes.values()} >= {1, 2}
    expected = advantages_by_definition(episodes, 0.5)
    assert any(expected[key] for key in expected if key[1] > 0)
    tokens = db.execute(
        "select rollout_id, turn, loss_mask, advantage from tokens order by rollout_id, position"
    ).fetchall()
    for rollout, turn, sampled, advantage in tokens:
        # every sampled token, and only those, belongs to a turn of its episode
        assert (turn is not None) == bool(sampled)
        assert advantage == pytest.approx(expected.get((rollout, turn), 0.0), abs=1e-6)
    turns = db.execute(
        "select rollout_id, list(distinct turn order by turn) filter (turn is not null) "
        "from tokens group by 1"
    )
    assert dict(turns.fetchall()) == {r: list(range(len(e[1]))) for r, e in episodes.items()}
    assert metrics["loss/advantage_abs_mean"] > 0
