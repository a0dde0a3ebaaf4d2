"""The off-policy gap's sampler part taken from the engine itself: the torch engine returns each
sampled id's raw log-prob (the tempered distribution before top_p's truncation) beside the
processed one it sampled from, the rollout carries it to the learner, and a run's stored
`gap_sampler` is raw less processed on every sampled token, with no row drawn for the learner to
recompute it (`audit.gap_rows=0`)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.engines.base import SamplingParams
from workbench.engines.torch_engine import TorchEngine, nucleus
from workbench.models.gap import PARTS
from workbench.models.multimodal import load_policy
from workbench.store.query import open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

TEMPERATURE = 0.8
TOP_P = 0.5


def full_forward_raw(model: torch.nn.Module, ids: np.ndarray, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) [len(ids) - 1, vocab] of one unpadded sequence: the
    distribution each next id was drawn from, before any truncation."""
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0, :-1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


@pytest.mark.parametrize("top_p", [TOP_P, 1.0])
def test_the_torch_engine_returns_each_sampled_ids_raw_log_prob_beside_the_processed_one(
    tiny_path: str, top_p: float
) -> None:
    engine = TorchEngine(tiny_path, seed=0)
    prompts = [np.array([3, 17, 42, 9], np.int32), np.array([5, 8], np.int32)]
    params = SamplingParams(max_tokens=8, temperature=TEMPERATURE, top_p=top_p, seed=0)
    truncations = []
    for prompt, generation in zip(prompts, engine.generate(prompts, params), strict=True):
        raw_logprobs = generation.extras["raw_logprobs"]
        assert raw_logprobs.dtype == np.float32
        assert raw_logprobs.shape == generation.logprobs.shape
        # the same distributions recomputed by a forward over the whole sequence
        ids = np.concatenate([prompt, generation.token_ids])
        raw = full_forward_raw(engine.model, ids, TEMPERATURE)[len(prompt) - 1 :]
        sampled = torch.as_tensor(generation.token_ids, dtype=torch.long)[:, None]
        np.testing.assert_allclose(raw_logprobs, raw.gather(-1, sampled).squeeze(-1), atol=1e-5)
        processed = nucleus(raw, top_p).gather(-1, sampled).squeeze(-1)
        np.testing.assert_allclose(generation.logprobs, processed, atol=1e-5)
        truncations.append(raw_logprobs - generation.logprobs)
    truncation = np.concatenate(truncations)
    if top_p == 1:
        # nothing truncated: raw and processed are the same numbers
        assert (truncation == 0).all()
    else:
        # renormalised over the nucleus, a kept token's log-prob only rises
        assert truncation.max() <= 1e-6
        assert truncation.min() < -0.01


@pytest.mark.slow
def test_a_runs_stored_sampler_part_is_the_engines_raw_less_processed_log_prob(
    tmp_path: Path, tiny_path: str
) -> None:
    overrides = [
        "+recipe=arith",
        "model.warm_start_steps=0",
        f"engine.temperature={TEMPERATURE}",
        f"engine.top_p={TOP_P}",
        # top_p < 1 trains on-policy only, ungated (config.py refuses the rest)
        "gate.level=off",
        # no drawn rows: the learner recomputes nothing, the sampler part is the engine's alone
        "audit.gap_rows=0",
        "trainer.steps=2",
        "trainer.prompts_per_step=4",
        "trainer.group_size=4",
        "tracking=none",
        "run.progress=false",
        f"run.root={tmp_path}",
        "run.id=sampler",
    ]
    command = [sys.executable, "-m", "workbench.cli", "train", *overrides]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    db = open_run("sampler", tmp_path)
    rows = db.execute(
        "select t.step, t.rollout_id, t.segment_idx, list(t.token_id order by t.position), "
        "list(t.loss_mask order by t.position), list(t.behavior_logprob order by t.position), "
        "list(t.behavior_version order by t.position), "
        "list(t.train_logprob order by t.position), "
        + ", ".join(f"list(t.gap_{name} order by t.position)" for name in PARTS)
        + ", any_value(s.learner_version) from tokens t join segments s "
        "using (step, rollout_id, segment_idx) group by all order by all"
    ).fetchall()
    assert rows
    # the initial weights (version 0): what sampled the first step's tokens
    model = load_policy(tiny_path, "float32").eval()
    checked = 0
    for _, _, _, ids, mask, behavior, versions, pi_old, *parts, learner_version in rows:
        mask = np.array(mask, bool)
        behavior = np.array(behavior, np.float32)
        parts = {name: np.array(part, np.float64) for name, part in zip(PARTS, parts, strict=True)}
        on_policy = mask & (np.array(versions) == learner_version)
        # every on-policy sampled token measured in full, no row drawn
        assert not np.isnan(parts["sampler"][on_policy]).any()
        assert not np.isnan(parts["numerics"][on_policy]).any()
        measured = mask & ~np.isnan(parts["numerics"])
        delta = np.array(pi_old, np.float64) - behavior
        summed = sum(parts[name] for name in PARTS)
        np.testing.assert_allclose(summed[measured], delta[measured], atol=1e-5)
        at_zero = measured & (np.array(versions) == 0)
        if at_zero.any():
            # the engine's raw log-prob of each token, recomputed from version 0's weights
            raw = full_forward_raw(model, np.array(ids), TEMPERATURE)
            next_ids = torch.as_tensor(ids[1:], dtype=torch.long)[:, None]
            raw = np.pad(raw.gather(-1, next_ids).squeeze(-1).numpy(), (1, 0))
            np.testing.assert_allclose(
                parts["sampler"][at_zero], (raw - behavior)[at_zero], atol=1e-4
            )
            checked += int(at_zero.sum())
    assert checked
    sampler = db.execute(
        "select min(gap_sampler), max(gap_sampler) from tokens where loss_mask = 1"
    ).fetchone()
    assert sampler[0] < -0.01 and sampler[1] <= 1e-6
