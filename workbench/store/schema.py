"""The run store's tables: one Arrow schema each, and the columns a training step produces.

A run folder holds `run.json` (the `runs` row: id, recipe, status, config, code version, sweep)
and one folder of Parquet shards per table. Shards are written whole and renamed into place, so a
reader (DuckDB in another process, the TUI) never sees half a file.
"""

import json

import numpy as np
import pyarrow as pa

from workbench.segment import image_name

# every table's rows carry the run and the training step they belong to
ROW_KEY = {"run_id": pa.string(), "step": pa.int32()}
# a segment's rows also carry its key: (step, rollout_id, segment_idx)
SEGMENT_KEY = {**ROW_KEY, "rollout_id": pa.int64(), "segment_idx": pa.int32()}
# the Segment attributes stored as they are: one column each of `segments`
SEGMENT_ATTRIBUTES = (
    "rollout_id",
    "segment_idx",
    "group_id",
    "reward",
    "num_sampled",
    "finish_reason",
    "seal_reason",
    "turn_spans",
    "turn_rewards",
)
# the Segment arrays stored as they are: one column each of `tokens`, concatenated
TOKEN_ATTRIBUTES = ("loss_mask", "behavior_logprob", "behavior_version")
# the off-policy gap's parts, one column each of `tokens` (models/gap.py)
GAP_COLUMNS = ("gap_staleness", "gap_routing", "gap_sampler", "gap_numerics")

SEGMENTS = pa.schema(
    {
        **SEGMENT_KEY,
        "group_id": pa.int64(),
        "reward": pa.float64(),
        "advantage": pa.float32(),
        "num_tokens": pa.int32(),
        "num_sampled": pa.int32(),
        "min_version": pa.int32(),
        "max_version": pa.int32(),
        "learner_version": pa.int32(),
        "finish_reason": pa.string(),
        "seal_reason": pa.string(),
        "turn_spans": pa.list_(pa.list_(pa.int32())),
        # the episode's reward of each sampled turn, in order (absent from older runs)
        "turn_rewards": pa.list_(pa.float64()),
        "prompt_text": pa.string(),
        "response_text": pa.string(),
        "images": pa.list_(pa.string()),
        # JSON: the episode's last `Result.info` (e.g. a judge's prompt and verdict)
        "info": pa.string(),
    }
)

TOKENS = pa.schema(
    {
        **SEGMENT_KEY,
        "position": pa.int32(),
        "token_id": pa.int32(),
        "loss_mask": pa.uint8(),
        "behavior_logprob": pa.float32(),
        "train_logprob": pa.float32(),
        "behavior_version": pa.int32(),
        "is_weight": pa.float32(),
        "advantage": pa.float32(),
        # the learner's entropy of the distribution the token was drawn from; null where none
        # (molt-wb serve, runs older than the column)
        "entropy": pa.float32(),
        # the episode's index of the token's sampled turn; null outside them (and in older runs)
        "turn": pa.int32(),
        # the off-policy gap's parts (models/gap.py); null where not measured
        "gap_staleness": pa.float32(),
        "gap_routing": pa.float32(),
        "gap_sampler": pa.float32(),
        "gap_numerics": pa.float32(),
    }
)

METRICS = pa.schema(
    {
        **ROW_KEY,
        "key": pa.string(),
        "value": pa.float64(),
        "time": pa.float64(),
    }
)

GATE_DECISIONS = pa.schema(
    {
        **SEGMENT_KEY,
        "learner_version": pa.int32(),
        "min_version": pa.int32(),
        "max_version": pa.int32(),
        "staleness": pa.int32(),
        "seq_log_ratio": pa.float64(),
        "geo_ratio": pa.float64(),
        "decision": pa.string(),
        "reason": pa.string(),
        "tokens_masked": pa.int32(),
    }
)

REQUESTS = pa.schema(
    {
        **ROW_KEY,
        "session": pa.string(),
        "rollout_id": pa.int64(),
        "wire": pa.string(),
        "stream": pa.bool_(),
        "action": pa.string(),
        "prompt_tokens_reused": pa.int32(),
        "new_prompt_tokens": pa.int32(),
        "generated_tokens": pa.int32(),
        "latency_s": pa.float64(),
        "time": pa.float64(),
    }
)

ROUTING = pa.schema(
    {
        **SEGMENT_KEY,
        "layer": pa.int32(),
        "tokens": pa.int32(),
        "mismatched": pa.int32(),
        "positions": pa.list_(pa.int32()),
        "rollout_experts": pa.list_(pa.list_(pa.int16())),
        "learner_experts": pa.list_(pa.list_(pa.int16())),  # at positions
    }
)

# an episode that never reached a batch: kind env_error | agent_error | worker_died | timeout
FAILED_EPISODES = pa.schema(
    {
        **ROW_KEY,
        "rollout_id": pa.int64(),
        "group_id": pa.int64(),
        "worker": pa.int32(),
        "kind": pa.string(),
        "error": pa.string(),
        "traceback": pa.string(),
        "time": pa.float64(),
    }
)

EVAL = pa.schema(
    {
        **ROW_KEY,
        "checkpoint": pa.string(),
        "split": pa.string(),
        "n": pa.int32(),
        "mean_reward": pa.float64(),
        "accuracy": pa.float64(),
        "time": pa.float64(),
    }
)

# a run-health rule that fired (store/alarms.py), at the step its condition started to hold
ALARMS = pa.schema(
    {
        **ROW_KEY,
        "rule": pa.string(),
        "metric": pa.string(),
        "value": pa.float64(),
        "threshold": pa.float64(),
        "evidence": pa.string(),
        "time": pa.float64(),
    }
)

TABLES = {
    "segments": SEGMENTS,
    "tokens": TOKENS,
    "metrics": METRICS,
    "gate_decisions": GATE_DECISIONS,
    "requests": REQUESTS,
    "routing": ROUTING,
    "failed_episodes": FAILED_EPISODES,
    "eval": EVAL,
    "alarms": ALARMS,
}


def learner_logprobs(pieces: list[np.ndarray], loss_mask: np.ndarray) -> pa.Array:
    """The learner's log-prob of every token; NULL for a prompt token the model bans (a vision
    marker, whose logit is -inf in every forward): no distribution gives it mass, and -inf is kept
    where a sampled token has it."""
    logprobs = np.concatenate(pieces)
    return pa.array(logprobs, mask=np.isneginf(logprobs) & (loss_mask == 0))


def step_tables(run_id, step, learner_version, segments, train):
    """Segment and token rows of one consumed batch.

    `train` holds from the learner: `train_logprob`, `is_weight` and optionally `entropy`,
    `token_advantage` and the gap's `GAP_COLUMNS` (float32 arrays whose concatenation is every
    segment's tokens in order, segment after segment), `advantage` (one float per segment; each
    token's where no `token_advantage`) and, when a learner gated them, `gate` (the version
    gate's per-sequence columns).
    """

    def each(name):
        """Every segment's attribute `name`, in order."""
        return [getattr(s, name) for s in segments]

    lengths = np.array([len(s.token_ids) for s in segments], dtype=np.int64)
    versions = [s.version_range() for s in segments]
    segment_rows = {name: each(name) for name in SEGMENT_ATTRIBUTES}
    segment_rows |= {
        "run_id": [run_id] * len(segments),
        "step": [step] * len(segments),
        "advantage": train["advantage"],
        "num_tokens": lengths,
        "min_version": [v[0] for v in versions],
        "max_version": [v[1] for v in versions],
        "learner_version": [learner_version] * len(segments),
        "prompt_text": [s.display.get("prompt", "") for s in segments],
        "response_text": [s.display.get("response", "") for s in segments],
        # files under images/
        "images": [list(map(image_name, s.images)) for s in segments],
        "info": [json.dumps(s.display.get("info") or {}, default=str) for s in segments],
    }
    total = int(lengths.sum())
    turns = np.concatenate(each("turns"))
    # pa.table casts each column to the schema's type; integers are cast here, where numpy is faster
    token_rows = {name: np.concatenate(each(name)) for name in TOKEN_ATTRIBUTES}
    token_rows |= {
        "run_id": pa.repeat(pa.scalar(run_id), total),
        "step": np.full(total, step, dtype=np.int32),
        "rollout_id": np.repeat(each("rollout_id"), lengths),
        "segment_idx": np.repeat(each("segment_idx"), lengths).astype(np.int32),
        "position": np.concatenate([np.arange(n, dtype=np.int32) for n in lengths]),
        "token_id": np.concatenate(each("token_ids")),
        "train_logprob": learner_logprobs(train["train_logprob"], token_rows["loss_mask"]),
        "is_weight": np.concatenate(train["is_weight"]),
        "advantage": np.repeat(train["advantage"], lengths),
        "entropy": pa.nulls(total, pa.float32()),
        "turn": pa.array(turns, mask=turns < 0),
    }
    for name in ("entropy", "token_advantage"):
        if train.get(name) is not None:
            token_rows[name.removeprefix("token_")] = np.concatenate(train[name])
    # the gap's parts: NaN where not measured is null
    for name in GAP_COLUMNS:
        gap = np.concatenate(train.get(name) or [np.full(total, np.nan, np.float32)])
        token_rows[name] = pa.array(gap, mask=np.isnan(gap))
    # no learner (molt-wb serve): no gate decisions
    gate_rows = dict.fromkeys(GATE_DECISIONS.names, [])
    gate = train.get("gate")
    if gate:
        # each segment's key and versions, then the gate's per-sequence columns
        gate_rows = {name: segment_rows.get(name) for name in GATE_DECISIONS.names}
        gate_rows.update(gate, decision=["kept" if kept else "dropped" for kept in gate["kept"]])
    return {
        "segments": pa.table(segment_rows, schema=SEGMENTS),
        "tokens": pa.table(token_rows, schema=TOKENS),
        "gate_decisions": pa.table(gate_rows, schema=GATE_DECISIONS),
        "requests": rows_table(REQUESTS, run_id, step, [r for s in segments for r in s.requests]),
        "routing": rows_table(ROUTING, run_id, step, train.get("routing") or []),
    }


def rows_table(schema: pa.Schema, run_id, step, rows):
    """`rows` (each holding every column of `schema` but `ROW_KEY`'s) as a table of `schema`; the
    loopback server's request rows (workbench.server.loopback) make the `requests` table."""
    columns = {"run_id": [run_id] * len(rows), "step": [step] * len(rows)}
    for name in schema.names[len(ROW_KEY) :]:
        columns[name] = [row[name] for row in rows]
    return pa.table(columns, schema=schema)
