"""A replay bundle's contents read from the run store: one step's Segments as the learner took
them, and what the learner recorded of that step; and the bundle file itself.

A bundle is one zip file: `bundle.json` (what it holds), `config.yaml` (the run's resolved config),
`segments.json` and `batch.npz` (the step's rows: ids, masks, behavior log-probs and versions,
routes), `images/`, `recorded.json` and `recorded.npz` (the learner's outputs at that step), and the
weights the learner held (`weights/`, a checkpoint folder or the starting policy; for a large
policy only its path and hash). `run/replay.py` writes and replays it.
"""

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from workbench.segment import Segment

# the per-token outputs of the learner a bundle records (tokens table columns)
TOKEN_OUTPUTS = ("train_logprob", "is_weight", "entropy", "advantage")
# the gate's per-sequence outputs a bundle records (gate_decisions table columns)
GATE_OUTPUTS = ("decision", "reason", "staleness", "seq_log_ratio", "geo_ratio", "tokens_masked")
# the bundle format this module writes and reads
FORMAT = 1


@dataclass
class StepRows:
    """One training step as the run store holds it: its Segments in the learner's batch order,
    how many the whole batch had, and the learner's recorded outputs."""

    segments: list[Segment]
    batch_rows: int
    learner_version: int
    # per token, concatenated over the segments: TOKEN_OUTPUTS (NaN where null)
    token_outputs: dict[str, np.ndarray]
    # per segment, in order: GATE_OUTPUTS (empty lists when the step had no gate rows)
    gate: dict[str, list[Any]]
    # per (segment, MoE layer): mismatched route count, in order
    routing: list[dict[str, Any]]
    # the step's metrics (key -> value)
    metrics: dict[str, float]


def read_table(run_dir: Path, table: str, step: int) -> pa.Table:
    """The rows of `table` at `step`, in the order the writer wrote them."""
    shards = sorted(Path(run_dir, table).glob("part-*.parquet"))
    pieces = []
    for shard in shards:
        # row groups of other steps are skipped by their statistics
        rows = pq.read_table(shard, filters=[("step", "=", step)])
        if rows.num_rows:
            pieces.append(rows)
    if not pieces:
        return pa.table({"step": pa.array([], pa.int32())})
    return pa.concat_tables(pieces, promote_options="default")


def steps_stored(run_dir: Path) -> list[int]:
    """The steps whose segments the run store holds."""
    steps = set()
    for shard in Path(run_dir, "segments").glob("part-*.parquet"):
        steps.update(pq.read_table(shard, columns=["step"])["step"].to_pylist())
    return sorted(steps)


def read_step(run_dir: Path, step: int, rows: int | None = None, top_k: int = 1) -> StepRows:
    """Step `step` of the run in `run_dir`, its first `rows` segments (None: all), with a MoE
    policy's routes `top_k` experts wide; ValueError when the store holds no such step."""
    segments_table = read_table(run_dir, "segments", step)
    if not segments_table.num_rows:
        stored = steps_stored(run_dir)
        span = f"steps {stored[0]} to {stored[-1]}" if stored else "no step yet"
        raise ValueError(f"Run {run_dir.name} has no step {step} in its store ({span}): give one.")
    batch_rows = segments_table.num_rows
    keep = batch_rows if rows is None else min(rows, batch_rows)
    segment_rows = segments_table.slice(0, keep).to_pylist()
    tokens = read_table(run_dir, "tokens", step).to_pandas()
    by_segment = dict(iter(tokens.groupby(["rollout_id", "segment_idx"], sort=False)))
    routing = read_table(run_dir, "routing", step).to_pylist()
    segments = []
    outputs = {name: [] for name in TOKEN_OUTPUTS}
    for row in segment_rows:
        key = (row["rollout_id"], row["segment_idx"])
        token_rows = by_segment[key].sort_values("position")
        segments.append(segment_of(run_dir, row, token_rows, routing, top_k))
        for name in TOKEN_OUTPUTS:
            outputs[name].append(token_rows[name].to_numpy(np.float32, na_value=np.nan))
    gate_rows = read_table(run_dir, "gate_decisions", step).to_pylist()[:keep]
    kept = {(row["rollout_id"], row["segment_idx"]) for row in segment_rows}
    metrics = read_table(run_dir, "metrics", step).to_pylist()
    return StepRows(
        segments=segments,
        batch_rows=batch_rows,
        learner_version=segment_rows[0]["learner_version"],
        token_outputs={name: np.concatenate(pieces) for name, pieces in outputs.items()},
        gate={name: [row[name] for row in gate_rows] for name in GATE_OUTPUTS},
        routing=[
            {"layer": row["layer"], "mismatched": row["mismatched"], "positions": row["positions"]}
            for row in routing
            if (row["rollout_id"], row["segment_idx"]) in kept
        ],
        metrics={row["key"]: row["value"] for row in metrics},
    )


def segment_of(
    run_dir: Path, row: dict, tokens: Any, routing: list[dict], top_k: int = 1
) -> Segment:
    """The Segment of a `segments` row and its `tokens` rows (a DataFrame, by position). Its
    routes: the rollout's experts where the learner's live router chose others, -1 (the live
    choice) elsewhere; under replay the forward is the one the learner ran, since at every other
    position the live choice is the recorded one."""
    turns = tokens["turn"].to_numpy(np.float64, na_value=-1)
    first_turn = int(turns[turns >= 0].min()) if (turns >= 0).any() else 0
    mine = [
        r
        for r in routing
        if r["rollout_id"] == row["rollout_id"] and r["segment_idx"] == row["segment_idx"]
    ]
    routed_experts = None
    if mine:
        layers = max(r["layer"] for r in mine) + 1
        top_k = max((len(e) for r in mine for e in r["rollout_experts"]), default=top_k)
        routed_experts = np.full((len(tokens), layers, top_k), -1, dtype=np.int16)
        for r in mine:
            for position, experts in zip(r["positions"], r["rollout_experts"], strict=True):
                routed_experts[position, r["layer"]] = experts
    return Segment(
        run_id=row["run_id"],
        rollout_id=row["rollout_id"],
        segment_idx=row["segment_idx"],
        group_id=row["group_id"],
        token_ids=tokens["token_id"].to_numpy(np.int32),
        loss_mask=tokens["loss_mask"].to_numpy(np.uint8),
        behavior_logprob=tokens["behavior_logprob"].to_numpy(np.float32),
        behavior_version=tokens["behavior_version"].to_numpy(np.int32),
        reward=row["reward"],
        turn_spans=[tuple(span) for span in row["turn_spans"] or []],
        turn_rewards=list(row["turn_rewards"] or []),
        first_turn=first_turn,
        finish_reason=row["finish_reason"],
        seal_reason=row["seal_reason"],
        routed_experts=routed_experts,
        images=[Path(run_dir, "images", name).read_bytes() for name in row["images"] or []],
    )


# ---- the file


SCALARS = ("rollout_id", "segment_idx", "group_id", "reward", "turn_spans", "turn_rewards")
ARRAYS = ("token_ids", "loss_mask", "behavior_logprob", "behavior_version")


def folder_hash(folder: Path) -> str:
    """sha256 over a folder's files (relative names and contents, in name order)."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def write_bundle(
    out: Path, meta: dict[str, Any], config_yaml: str, step: StepRows, weights: dict[str, Path]
) -> None:
    """The bundle file `out`: `meta` (bundle.json), the config, the step's rows and recorded
    outputs, and each folder of `weights` (name -> folder) embedded whole."""
    segments = step.segments
    scalars = [
        {name: getattr(s, name) for name in SCALARS}
        | {"first_turn": s.first_turn, "finish_reason": s.finish_reason}
        | {"seal_reason": s.seal_reason, "images": [hash_name(i) for i in s.images]}
        for s in segments
    ]
    arrays = {name: np.concatenate([getattr(s, name) for s in segments]) for name in ARRAYS} | {
        "lengths": np.array([len(s.token_ids) for s in segments])
    }
    routed = [s.routed_experts for s in segments]
    if any(r is not None for r in routed):
        arrays |= {f"routed_experts_{i}": r for i, r in enumerate(routed) if r is not None}
    recorded = {
        "metrics": step.metrics,
        "gate": step.gate,
        "routing": step.routing,
        "batch_rows": step.batch_rows,
        "learner_version": step.learner_version,
    }
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("bundle.json", json.dumps(meta | {"format": FORMAT}, indent=1))
        bundle.writestr("config.yaml", config_yaml)
        bundle.writestr("segments.json", json.dumps(scalars))
        bundle.writestr("batch.npz", npz_bytes(arrays))
        bundle.writestr("recorded.json", json.dumps(recorded, default=float))
        bundle.writestr("recorded.npz", npz_bytes(step.token_outputs))
        for image in {hash_name(i): i for s in segments for i in s.images}.items():
            bundle.writestr(f"images/{image[0]}", image[1])
        for name, folder in weights.items():
            for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                bundle.write(file, f"weights/{name}/{file.relative_to(folder)}")


def hash_name(image: bytes) -> str:
    """An image's member name in a bundle: its content hash."""
    return hashlib.sha256(image).hexdigest()[:16] + ".png"


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """`arrays` as the bytes of an .npz file."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def read_bundle(path: Path, into: Path) -> tuple[dict[str, Any], str, StepRows]:
    """A bundle's meta, config and step rows; its weights folders extracted under `into`
    (`into/weights/NAME`). ValueError when `path` is not a bundle."""
    try:
        bundle = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        raise ValueError(
            f"{path} is not a molt-wb bundle: write one with `molt-wb bundle`."
        ) from None
    with bundle:
        names = set(bundle.namelist())
        if "bundle.json" not in names:
            raise ValueError(f"{path} is not a molt-wb bundle: write one with `molt-wb bundle`.")
        meta = json.loads(bundle.read("bundle.json"))
        bundle.extractall(into, [name for name in names if name.startswith("weights/")])
        arrays = dict(np.load(io.BytesIO(bundle.read("batch.npz"))))
        outputs = dict(np.load(io.BytesIO(bundle.read("recorded.npz"))))
        recorded = json.loads(bundle.read("recorded.json"))
        scalars = json.loads(bundle.read("segments.json"))
        images = {name[7:]: bundle.read(name) for name in names if name.startswith("images/")}
        config_yaml = bundle.read("config.yaml").decode()
    ends = np.cumsum(arrays["lengths"])
    segments = []
    for i, row in enumerate(scalars):
        span = slice(ends[i] - arrays["lengths"][i], ends[i])
        segments.append(
            Segment(
                run_id=meta["run_id"],
                **{name: row[name] for name in SCALARS if name != "turn_spans"},
                turn_spans=[tuple(s) for s in row["turn_spans"]],
                first_turn=row["first_turn"],
                finish_reason=row["finish_reason"],
                seal_reason=row["seal_reason"],
                images=[images[name] for name in row["images"]],
                routed_experts=arrays.get(f"routed_experts_{i}"),
                **{name: arrays[name][span] for name in ARRAYS},
            )
        )
    step = StepRows(
        segments=segments,
        batch_rows=recorded["batch_rows"],
        learner_version=recorded["learner_version"],
        token_outputs=outputs,
        gate=recorded["gate"],
        routing=recorded["routing"],
        metrics=recorded["metrics"],
    )
    return meta, config_yaml, step
