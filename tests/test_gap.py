"""The off-policy gap decomposed: each sampled token's δ = log π_old − log π_behavior split into
staleness, routing, sampler and numerics parts that sum to it, each measured by a real learner
(no Ray) on batches whose behavior log-probs are known by construction; the store's columns and
the summary's line."""

import duckdb
import numpy as np
import pytest
import torch

from workbench.config import compose_config
from workbench.engines.torch_engine import nucleus
from workbench.invariants.routing_replay import find_routers
from workbench.learner.batch import collate
from workbench.learner.learner import Learner
from workbench.models.gap import PARTS
from workbench.models.multimodal import forward_inputs
from workbench.models.tiny import tiny_model_path
from workbench.segment import Segment
from workbench.store.gap import gap_line, gap_sizes
from workbench.store.schema import step_tables

ROWS = 8
LENGTH = 24
# the first half of each row is prompt, the second sampled
SAMPLED = slice(LENGTH // 2, LENGTH)


def segments(version: int, behavior: list[np.ndarray] | None = None, **fields) -> list[Segment]:
    """ROWS segments of fixed random ids, sampled by `version`, two groups of mixed rewards (so the
    policy moves); behavior log-probs 0 unless given."""
    rng = np.random.default_rng(0)
    made = []
    for row in range(ROWS):
        mask = np.zeros(LENGTH, np.uint8)
        mask[SAMPLED] = 1
        made.append(
            Segment(
                run_id="gap",
                rollout_id=row,
                segment_idx=0,
                group_id=row // 4,
                token_ids=rng.integers(5, 200, LENGTH).astype(np.int32),
                loss_mask=mask,
                behavior_logprob=np.zeros(LENGTH, np.float32)
                if behavior is None
                else behavior[row],
                behavior_version=np.where(mask, version, -1).astype(np.int32),
                reward=float(row % 2),
                turn_spans=[(SAMPLED.start, SAMPLED.stop)],
                turn_rewards=[float(row % 2)],
                **{name: value[row] for name, value in fields.items()},
            )
        )
    return made


def learner(*overrides: str, model: str = "tiny") -> Learner:
    cfg = compose_config(
        ["+recipe=arith", f"model={model}", "model.warm_start_steps=0", *overrides]
    )
    return Learner(cfg, str(tiny_model_path(model)))


def sampled_only(values: np.ndarray) -> list[np.ndarray]:
    """Per-row behavior log-probs: `values` [rows * LENGTH] on sampled tokens, 0 elsewhere."""
    rows = values.reshape(ROWS, LENGTH)
    return [np.where(np.arange(LENGTH) >= SAMPLED.start, row, 0).astype(np.float32) for row in rows]


def parts_of(rows: dict) -> dict[str, np.ndarray]:
    """Each part's column, [rows, tokens]."""
    return {name: rows[f"gap_{name}"][0].reshape(ROWS, LENGTH) for name in PARTS}


def test_a_stale_tokens_gap_is_the_version_change_and_the_parts_sum_to_it() -> None:
    policy = learner("trainer.async_depth=1", "gate.level=token", "audit.gap_rows=3")
    first = segments(0)
    _, rows = policy.train(first)
    # the behavior log-probs are the learner's own at version 0: no numerics, no sampler
    at_zero = rows["train_logprob"][0]
    metrics, rows = policy.train(segments(0, sampled_only(at_zero)))
    parts = parts_of(rows)
    pi_old = rows["train_logprob"][0].reshape(ROWS, LENGTH)
    measured = ~np.isnan(parts["numerics"])
    # audit.gap_rows rows measured in full, on their sampled tokens only
    assert measured.any(-1).sum() == 3
    assert not measured[:, : SAMPLED.start].any()
    staleness = pi_old - at_zero.reshape(ROWS, LENGTH)
    assert np.abs(staleness[measured]).min() > 0
    np.testing.assert_allclose(parts["staleness"][measured], staleness[measured], atol=1e-6)
    np.testing.assert_allclose(parts["numerics"][measured], 0, atol=1e-5)
    assert (parts["routing"][measured] == 0).all() and (parts["sampler"][measured] == 0).all()
    delta = pi_old - at_zero.reshape(ROWS, LENGTH)
    summed = sum(parts[name] for name in PARTS)
    np.testing.assert_allclose(summed[measured], delta[measured], atol=1e-6)
    assert metrics["gap/measured_frac"] == pytest.approx(3 / ROWS)
    total = sum(metrics[f"gap/{name}"] for name in PARTS)
    assert total == pytest.approx(metrics["gap/total"], abs=1e-6)
    assert metrics["gap/staleness"] == pytest.approx(float(staleness[measured].mean()), abs=1e-6)


def test_without_drawn_rows_only_on_policy_tokens_are_measured() -> None:
    policy = learner("trainer.async_depth=1", "gate.level=token", "audit.gap_rows=0")
    metrics, rows = policy.train(segments(0))
    # on-policy: the whole gap is numerics, measured on every sampled token
    assert metrics["gap/measured_frac"] == 1.0
    assert metrics["gap/numerics"] == pytest.approx(metrics["gap/total"])
    metrics, rows = policy.train(segments(0))
    assert metrics["gap/measured_frac"] == 0.0
    assert np.isnan(rows["gap_staleness"][0]).all()


def test_the_sampler_part_is_what_top_p_truncation_does_to_the_log_prob() -> None:
    top_p = 0.5
    policy = learner("gate.level=off", f"engine.top_p={top_p}", "audit.gap_rows=2")
    batch = collate(segments(0))
    # the engine's processed log-probs, computed here by hand from the same weights
    with torch.no_grad():
        inputs = forward_inputs(policy.model, batch.token_ids, batch.attention_mask, [], None)
        raw = torch.log_softmax(policy.model(**inputs).logits[:, :-1].float(), dim=-1)
    ids = batch.token_ids[:, 1:, None]
    processed = nucleus(raw, top_p).gather(-1, ids).squeeze(-1)
    truncation = raw.gather(-1, ids).squeeze(-1) - processed
    processed = torch.nn.functional.pad(processed, (1, 0)).numpy().reshape(-1)
    metrics, rows = policy.train(segments(0, sampled_only(processed)))
    parts = parts_of(rows)
    measured = ~np.isnan(parts["numerics"])
    assert measured.any(-1).sum() == 2
    truncation = torch.nn.functional.pad(truncation, (1, 0)).numpy()
    assert truncation[measured].min() < 0
    np.testing.assert_allclose(parts["sampler"][measured], truncation[measured], atol=1e-5)
    np.testing.assert_allclose(parts["numerics"][measured], 0, atol=1e-5)


@pytest.mark.parametrize("replay", [False, True])
def test_the_routing_part_is_what_the_rollouts_routes_change_without_replay(replay: bool) -> None:
    policy = learner(f"algo.routing_replay={str(replay).lower()}", model="tiny-moe")
    layers = len(find_routers(policy.model))
    top_k = policy.model.config.num_experts_per_tok
    # routes unlike the live router's: every token of every layer sent to the first experts
    route = np.tile(np.arange(top_k, dtype=np.int16), (LENGTH, layers, 1))
    routes = [route] * ROWS
    metrics, rows = policy.train(segments(0, routed_experts=routes))
    parts = parts_of(rows)
    sampled = ~np.isnan(parts["numerics"])
    assert sampled.sum() == ROWS * (LENGTH - SAMPLED.start)
    if replay:
        assert (parts["routing"][sampled] == 0).all()
    else:
        assert np.abs(parts["routing"][sampled]).max() > 1e-3
    assert sum(metrics[f"gap/{name}"] for name in PARTS) == pytest.approx(metrics["gap/total"])


def test_the_store_keeps_each_part_null_where_unmeasured_and_the_summary_names_the_largest() -> (
    None
):
    policy = learner("trainer.async_depth=1", "gate.level=token", "audit.gap_rows=2")
    _, rows = policy.train(segments(0))
    batch = segments(0, sampled_only(rows["train_logprob"][0]))
    _, rows = policy.train(batch)
    tokens = step_tables("gap", 1, 1, batch, rows)["tokens"]
    measured = tokens.filter(tokens["gap_numerics"].is_valid())
    assert measured.num_rows == 2 * (LENGTH - SAMPLED.start)
    db = duckdb.connect()
    db.register("tokens", tokens)
    sizes = gap_sizes(db)
    assert sizes["measured"] == measured.num_rows
    assert sizes["sampled"] == ROWS * (LENGTH - SAMPLED.start)
    # behavior log-probs of version 0 by construction: the weights' change is the gap
    assert sizes["staleness"] > 100 * sizes["numerics"]
    assert sizes["routing"] == sizes["sampler"] == 0
    (line,) = gap_line(sizes)
    assert line.startswith("gap        |δ| ") and "on 25% of sampled tokens" in line
    assert line.endswith("largest staleness")
