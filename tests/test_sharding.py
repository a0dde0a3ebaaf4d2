"""The sharded learner (#15): two FSDP2 ranks in a real gloo process group train the same batch
to the same loss and weights as one rank, and their torch.distributed checkpoint resumes on one."""

import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from workbench.config import compose_config
from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine
from workbench.learner.batch import collate
from workbench.learner.learner import Learner
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment
from workbench.store import open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_ray")]


def config(overrides: list[str], ranks: int):
    cfg = compose_config(["trainer.lr=1e-2", f"ray.learner_workers={ranks}", *overrides])
    OmegaConf.update(cfg, "run.id", "ranks")
    return cfg


def rollout_segments(path: str, count: int = 7, shared: bool = False) -> list[Segment]:
    """`count` sampled segments (an odd number: the ranks' slices differ in size), groups of 2;
    `shared`: a group's rows on one longer prompt."""
    engine = TorchEngine(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 400, size=n).astype(np.int32) for n in rng.integers(3, 9, count)]
    if shared:
        prompts = [
            rng.integers(5, 400, size=n).astype(np.int32) for n in rng.integers(20, 30, count)
        ]
        prompts = [prompts[index // 2] for index in range(count)]
    generations = engine.generate(prompts, SamplingParams(max_tokens=8, seed=3))
    segments = []
    for index, (prompt, g) in enumerate(zip(prompts, generations, strict=True)):
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(g.token_ids))].astype(np.uint8)
        segments.append(
            Segment(
                "ranks",
                index,
                0,
                index // 2,
                np.r_[prompt, g.token_ids].astype(np.int32),
                mask,
                np.r_[np.zeros(len(prompt)), g.logprobs].astype(np.float32),
                np.where(mask == 1, 0, -1).astype(np.int32),
                reward=float(index % 3 == 0),
                routed_experts=g.extras.get("routed_experts"),
            )
        )
    return segments


def full_weights(learner: Learner) -> dict | None:
    full = learner.ranks.full_state_dict(learner.model)
    return full and {name: tensor.clone() for name, tensor in full.items()}


def two_steps(learner: Learner, segments, folder=None) -> dict:
    """Loss and weights after one step and after a second; a checkpoint between them."""
    first, _ = learner.train(segments)
    weights = full_weights(learner)
    if folder is not None:
        learner.save_checkpoint(folder, {"step": 0})
    second, _ = learner.train(segments)
    return {
        "first": first,
        "weights": weights,
        "second": second,
        "final": full_weights(learner),
    }


def rank_main(rank, jobs, out):
    """Every case on this rank, each in its own process group (the spawn and the imports are most
    of a case's time, so one pair of processes runs them all)."""
    torch.set_num_threads(1)
    results = {}
    for name, port, overrides, path, segments, folder in jobs:
        learner = Learner(config(overrides, 2), path, rank, ("127.0.0.1", port))
        results[name] = two_steps(learner, segments, folder)
        torch.distributed.destroy_process_group()
    if rank == 0:
        torch.save(results, out)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_same(sharded: dict, single: dict, keys=("loss/policy", "mismatch/kl", "loss/grad_norm")):
    for step in ("first", "second"):
        for key in keys:
            assert sharded[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6)
    for moment in ("weights", "final"):
        assert sharded[moment].keys() == single[moment].keys()
        for name, tensor in single[moment].items():
            # Adam scales float noise in near-zero gradients up to a whole step (lr = 1e-2); the
            # gradient norm above catches a gradient of the wrong scale, which Adam hides
            torch.testing.assert_close(sharded[moment][name], tensor, rtol=1e-4, atol=1e-3)


CASES = {
    "dense": ("tiny", []),
    "dense, 2 minibatches, KL reference": ("tiny", ["trainer.minibatches=2", "algo.kl_coef=0.1"]),
    # the second step trains on tokens one version old: the gap's staleness is measured on drawn
    # rows under the kept weights of version 0 (each rank keeps its own shards)
    "dense, one version behind, gap rows": (
        "tiny",
        ["trainer.async_depth=1", "gate=token", "audit.gap_rows=4"],
    ),
    # a group's rows share their prompt: micro-batches of whole groups, each prompt run once
    "dense, micro-batches of whole groups": ("tiny", ["trainer.max_tokens_per_microbatch=50"]),
    "moe, replay": ("tiny-moe", ["model=tiny-moe", "algo.routing_replay=true"]),
    "moe, no replay": ("tiny-moe", ["model=tiny-moe", "algo.routing_replay=false"]),
    # the ranks hold unequal rows, so unequal micro-batch counts: empty ones even them out
    "moe, replay, packed micro-batches": (
        "tiny-moe",
        ["model=tiny-moe", "algo.routing_replay=true", "trainer.max_tokens_per_microbatch=24"],
    ),
}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict:
    """Each case's segments and its two ranks' results, a checkpoint between their two steps."""
    folder = tmp_path_factory.mktemp("ranks")
    jobs = []
    for name, (model, overrides) in CASES.items():
        path = str(tiny_model_path(model))
        checkpoint = folder / f"checkpoint-{len(jobs)}"
        checkpoint.mkdir()
        segments = rollout_segments(path, shared="whole groups" in name)
        jobs.append((name, free_port(), overrides, path, segments, str(checkpoint)))
    mp.spawn(rank_main, args=(jobs, str(folder / "rank0.pt")), nprocs=2, join=True)
    results = torch.load(folder / "rank0.pt", weights_only=False)
    for name, _, _, _, segments, checkpoint in jobs:
        results[name].update(segments=segments, folder=Path(checkpoint))
    return results


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_train_like_one(sharded, case):
    model, overrides = CASES[case]
    path = str(tiny_model_path(model))
    torch.set_num_threads(1)
    single = two_steps(Learner(config(overrides, 1), path), sharded[case]["segments"])
    keys = ("loss/policy", "mismatch/kl", "loss/grad_norm")
    if "audit.gap_rows=4" in overrides:
        keys += ("gap/staleness", "gap/numerics", "gap/measured_frac")
        # on-policy, then 4 of the 7 rows one version behind measured in full
        assert single["first"]["gap/measured_frac"] == 1
        assert 0 < single["second"]["gap/measured_frac"] < 1
        assert single["second"]["gap/staleness"] != 0
    if "whole groups" in case:
        batch = collate(sharded[case]["segments"])
        learner = Learner(config(overrides, 1), path)
        assert learner.shared(batch) is not None
        groups = learner.microbatches(batch)
        assert sorted(batch.group_ids[rows].tolist() for rows in groups) == [
            [0, 0],
            [1, 1],
            [2, 2],
            [3],
        ]
    assert_same(sharded[case], single, keys)
    # the weights changed: the comparison is not between two untouched models
    start = Learner(config(overrides, 1), path).model.state_dict()
    assert any(not torch.equal(start[name], t) for name, t in single["weights"].items())


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_packed_micro_batches_train_like_one_padded_batch(model, minibatches):
    path = str(tiny_model_path(model))
    segments = rollout_segments(path)
    torch.set_num_threads(1)
    overrides = [f"model={model}", f"trainer.minibatches={minibatches}", "algo.kl_coef=0.1"]
    padded = two_steps(Learner(config(overrides, 1), path), segments)
    budget = config([*overrides, "trainer.max_tokens_per_microbatch=20"], 1)
    learner = Learner(budget, path)
    # the budget splits every minibatch
    assert len(learner.microbatches(collate(segments[:4]))) > 1
    keys = ("loss/policy", "loss/kl_ref", "loss/grad_norm")
    assert_same(two_steps(learner, segments), padded, keys=keys)


def test_a_checkpoint_of_two_ranks_resumes_on_one(sharded):
    segments = sharded["dense"]["segments"]
    folder = sharded["dense"]["folder"]
    assert (folder / "state" / ".metadata").exists() and (folder / "policy").is_dir()
    # built from the checkpoint's policy, then its model and optimizer state loaded
    resumed = Learner(config([], 1), str(folder / "policy"))
    resumed.load_checkpoint(str(folder))
    assert resumed.version == 1
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, sharded["dense"]["weights"][name])
    # the optimizer's moments came along: the next step lands where the two ranks' did
    resumed.train(segments)
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, sharded["dense"]["final"][name], rtol=1e-4, atol=1e-4)


def run_rewards(tmp_path, run_id: str, overrides: list[str]) -> tuple[list, list]:
    import subprocess
    import sys

    command = [sys.executable, "-m", "workbench.cli", "train", "+recipe=arith", "trainer.steps=4"]
    command += [f"run.root={tmp_path}", f"run.id={run_id}", "tracking=none", "run.progress=false"]
    result = subprocess.run(command + overrides, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    db = open_run(run_id, str(tmp_path))
    query = "select value from metrics where key = ? order by step"
    rewards = [value for (value,) in db.execute(query, ["reward/mean"]).fetchall()]
    kl = [value for (value,) in db.execute(query, ["mismatch/kl"]).fetchall()]
    return rewards, kl


def test_a_run_with_two_learner_ranks_tracks_the_one_rank_run(tmp_path):
    one, _ = run_rewards(tmp_path, "one", ["ray.rollout_workers=2"])
    # two ranks, their weights broadcast to the workers (ray.weight_transport=collective)
    overrides = [
        "ray.learner_workers=2",
        "ray.weight_transport=collective",
        "ray.rollout_workers=2",
    ]
    two, kl = run_rewards(tmp_path, "two", overrides)
    assert len(two) == 4 and max(kl) < 1e-6
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 0.05, (one, two)
    assert (tmp_path / "two" / "checkpoints" / "step-000004" / "state" / ".metadata").exists()
    db = open_run("two", str(tmp_path))
    query = "select min(value) from metrics where key = 'perf/weight_sync_bytes'"
    # the tiny policy's float32 weights, every step
    assert db.execute(query).fetchone()[0] > 1e6
    # the two ranks' last checkpoint exported: a Hugging Face folder transformers loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workbench.cli import main

    out = tmp_path / "exported"
    with pytest.raises(SystemExit) as done:
        main(["export", "two", str(out), "--root", str(tmp_path)])
    assert done.value.code == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template
    assert not model.config.architectures[0].startswith("FSDP")
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path("tiny")).state_dict()
    assert any(not torch.equal(start[name], t) for name, t in model.state_dict().items())


def test_a_learner_rank_that_raises_stops_the_run_at_once_naming_it(tmp_path):
    import ray

    from workbench.run import cluster, run_folder
    from workbench.run.faults import RunFailed

    cfg = config([f"run.root={tmp_path}", "trainer.timeout_s=600"], 2)
    path = str(tiny_model_path("tiny"))
    segments = rollout_segments(path)
    # a token id past the vocabulary in the last row: rank 1's slice alone holds it, and rank 0
    # waits for rank 1 in the sharded forward's collectives
    segments[-1].token_ids[-1] = 10**6
    cluster.init_ray(cfg)
    run_dir, row = run_folder.start_run(cfg)
    store, learner, workers = cluster.start_actors(cfg, path, run_dir, row)
    try:
        ray.get(learner.step.options(num_returns=3).remote(segments[:-1])[0])
        start = time.monotonic()
        with pytest.raises(
            RunFailed, match=r"^Learner rank 1 raised IndexError: .* molt-wb resume ranks$"
        ):
            learner.step.options(num_returns=3).remote(segments)
        # not after trainer.timeout_s
        assert time.monotonic() - start < 60
        cluster.stop_actors(cfg.run.id, "failed", store, learner, workers)
        # rank 0, stuck in a collective, is gone with the others, and so is their placement group
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(learner.actors[0].__ray_ready__.remote(), timeout=60)
        with pytest.raises(ValueError):
            ray.util.get_placement_group("molt-wb-ranks")
    finally:
        ray.shutdown()
