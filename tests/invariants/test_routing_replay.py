"""Forward consistency: the rollout's experts, captured per token, replayed in the learner,
measured."""

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from workbench.config import ConfigError, compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.invariants.routing_replay import decode_vllm_routed_experts, find_routers
from workbench.learner.batch import collate
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment
from workbench.store import open_run


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-mixtral"])
def moe(request):
    return request.param, str(tiny_model_path(request.param))


def learner_for(moe_name, path, replay=True):
    cfg = compose_config(
        [f"model={moe_name}", f"algo.routing_replay={str(replay).lower()}", "trainer.lr=1e-2"]
    )
    OmegaConf.update(cfg, "run.id", "r")
    return Learner(cfg, path)


def rollout_segments(engine, count=6, max_tokens=10):
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(5, 400, size=n).astype(np.int32) for n in rng.integers(3, 9, size=count)
    ]
    generations = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=3))
    segments = []
    for index, (prompt, g) in enumerate(zip(prompts, generations, strict=True)):
        ids = np.r_[prompt, g.token_ids].astype(np.int32)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(g.token_ids))].astype(np.uint8)
        segments.append(
            Segment(
                "r",
                index,
                0,
                index // 2,
                ids,
                mask,
                np.r_[np.zeros(len(prompt)), g.logprobs].astype(np.float32),
                np.where(mask == 1, 0, -1).astype(np.int32),
                reward=float(index % 2),
                routed_experts=g.extras["routed_experts"],
            )
        )
    return segments


def test_captured_routes_cover_every_fed_token(moe):
    name, path = moe
    engine = TorchEngine(path)
    (segment,) = rollout_segments(engine, count=1)
    routes = segment.routed_experts
    layers = len(find_routers(engine.model))
    assert routes.shape == (len(segment.token_ids), layers, 2) and routes.dtype == np.int16
    assert (routes[:-1] >= 0).all()
    # the last sampled token is never fed
    assert (routes[-1] == -1).all()
    # top-2 distinct experts
    assert (np.sort(routes[:-1], -1)[..., 0] != np.sort(routes[:-1], -1)[..., 1]).all()


def test_replay_on_the_same_weights_reproduces_rollout_logprobs(moe):
    name, path = moe
    segments = rollout_segments(TorchEngine(path))
    learner = learner_for(name, path)
    batch = collate(segments)
    routing = {}
    with torch.no_grad():
        replayed = learner.logprobs(batch, routing=routing)
    mask = batch.loss_mask
    assert (replayed - batch.behavior_logprob)[mask].abs().max() < 1e-5
    assert not routing["mismatch"].any()
    assert routing["known"][batch.attention_mask.bool()].float().mean() > 0.8


def perturbed_router_engine(path, scale=0.05):
    """The rollout engine's router weights carry noise: its expert choices differ from the
    learner's."""
    engine = TorchEngine(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in find_routers(engine.model):
            router.weight.add_(
                scale * router.weight.abs().mean() * torch.randn_like(router.weight) * 10
            )
    return engine


def test_when_routes_flip_replay_brings_the_learner_back_to_the_rollout(moe):
    name, path = moe
    segments = rollout_segments(perturbed_router_engine(path), count=8, max_tokens=16)
    learner = learner_for(name, path)
    batch = collate(segments)
    metrics = learner.routing_metrics(batch, *_routing(learner, batch))
    assert metrics["routing/mismatch_token_frac"] > 0.05  # the mismatch is measured
    assert metrics["mismatch/kl_replay"] < 0.2 * metrics["mismatch/kl_no_replay"]


def _routing(learner, batch):
    routing = {}
    with torch.no_grad():
        old = learner.logprobs(batch, routing=routing)
    return routing, old


def test_gradients_flow_through_the_router_under_replay(moe):
    name, path = moe
    segments = rollout_segments(perturbed_router_engine(path), count=8)
    learner = learner_for(name, path)
    before = [r.weight.detach().clone() for r in find_routers(learner.model)]
    metrics, rows = learner.train(segments)
    after = [r.weight.detach() for r in find_routers(learner.model)]
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    assert metrics["routing/mismatch_token_frac"] > 0 and rows["routing"]
    layers = {row["layer"] for row in rows["routing"]}
    assert layers == set(range(len(after)))
    assert all(len(r["positions"]) == r["mismatched"] for r in rows["routing"])
    by_segment = {(s.rollout_id, s.segment_idx): s for s in segments}
    # at each mismatch, the rollout's experts as recorded and the learner's, a different set
    for row in rows["routing"]:
        segment = by_segment[row["rollout_id"], row["segment_idx"]]
        recorded = segment.routed_experts[row["positions"], row["layer"]]
        assert row["rollout_experts"] == recorded.tolist()
        pairs = zip(row["rollout_experts"], row["learner_experts"], strict=True)
        assert all(sorted(chosen) != sorted(live) for chosen, live in pairs)


def test_vllm_routed_experts_decode_from_lists_and_base64_npy():
    rows = [[[1, 2], [3, 4]], [[5, 6], [7, 0]]]  # 2 fed tokens, 2 layers, top-2
    from_lists = decode_vllm_routed_experts(rows, num_tokens=3)  # one row fewer than tokens
    assert from_lists.dtype == np.int16 and from_lists.shape == (3, 2, 2)
    assert from_lists[:2].tolist() == rows and (from_lists[2] == -1).all()
    buffer = io.BytesIO()
    np.save(buffer, np.array(rows + [[[2, 3], [1, 0]]], dtype=np.uint8))
    from_npy = decode_vllm_routed_experts(
        base64.b64encode(buffer.getvalue()).decode(), num_tokens=3
    )
    assert from_npy.tolist() == rows + [[[2, 3], [1, 0]]]
    with pytest.raises(ValueError, match="rows for 5 tokens"):
        decode_vllm_routed_experts(rows, num_tokens=5)
    with pytest.raises(ValueError, match="layers, top_k"):
        decode_vllm_routed_experts([[1, 2]], num_tokens=1)


def test_replay_with_a_dense_model_is_refused():
    with pytest.raises(ConfigError, match="algo.routing_replay needs a mixture-of-experts policy"):
        compose_config(["model=tiny", "algo.routing_replay=true"])


def test_a_moe_run_records_routing_per_segment_and_layer(tmp_path):
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "train",
        "+recipe=arith",
        "model=tiny-mixtral",
        "algo.routing_replay=true",
        "trainer.steps=2",
        "model.warm_start_steps=0",
        "tracking=none",
        "run.progress=false",
        "trainer.prompts_per_step=2",
        "trainer.group_size=4",
        f"run.root={tmp_path}",
        "run.id=moe",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    db = open_run("moe", str(tmp_path))
    # segments x layers
    assert db.execute("select count(*) from routing").fetchone()[0] == 2 * 8 * 3
    # same weights, same precision
    assert db.execute("select sum(mismatched) from routing").fetchone()[0] == 0
    keys = {
        k
        for (k,) in db.execute(
            "select distinct key from metrics "
            "where key like 'routing/%' or key like 'mismatch/kl_%'"
        ).fetchall()
    }
    assert keys == {
        "routing/mismatch_token_frac",
        "routing/mismatch_layer_frac",
        "mismatch/kl_replay",
        "mismatch/kl_no_replay",
    }
