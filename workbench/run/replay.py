"""Replay bundles: one training step of a run written to one file (`molt-wb bundle`), and re-run
on the CPU by a fresh learner with every output diffed against the recorded one
(`molt-wb replay`).

A step trains on the weights of its learner version: a checkpoint named after that version, or for
version 0 the run's starting policy. Outputs that depend on a row alone (π_old, entropies, IS
weights, gate decisions, route mismatches) are compared for any rows; those of the whole batch
(advantages, loss, gradient norm, the step's metrics) when the bundle holds the whole batch.
"""

import json
import math
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from workbench.config import Config
from workbench.store.bundle import StepRows, folder_hash, read_bundle, read_step, write_bundle
from workbench.store.query import resolve_run

# embedded weights larger than this go in a bundle as their path and hash (--max-mb)
MAX_EMBEDDED_MB = 64
# metrics a replay cannot reproduce: timings, the rollout's own audit (not in the store), the
# off-policy gap (its staleness reads the weights of earlier versions, which a bundle does not
# hold), and the route fractions (the store keeps the rollout's experts only where the learner's
# differed, so their denominators are lost; the mismatch counts per layer are compared instead)
NOT_REPLAYED = ("perf/", "identity/", "audit/", "time/", "gap/", "routing/")


def config_of(config_yaml: str, overrides: list[str] | None = None) -> DictConfig:
    """A run's saved config (typed) with `overrides` on top."""
    return OmegaConf.merge(
        OmegaConf.structured(Config),
        OmegaConf.create(config_yaml),
        OmegaConf.from_dotlist(overrides or []),
    )


def weights_versions(run_dir: Path) -> dict[int, Path]:
    """The learner versions whose weights the run keeps (checkpoint folders, by version)."""
    found = Path(run_dir, "checkpoints").glob("step-" + "[0-9]" * 6)
    return {int(folder.name[5:]): folder for folder in found}


def bundleable_steps(run_dir: Path) -> list[int]:
    """The steps of a run whose learner weights it still has (version 0: the starting policy)."""
    import pyarrow.parquet as pq

    kept = set(weights_versions(run_dir)) | {0}
    pairs = set()
    for shard in Path(run_dir, "segments").glob("part-*.parquet"):
        table = pq.read_table(shard, columns=["step", "learner_version"])
        versions = table["learner_version"].to_pylist()
        pairs.update(zip(table["step"].to_pylist(), versions, strict=True))
    return sorted(step for step, version in pairs if version in kept)


def make_bundle(
    run_id: str, step: int, root: str, out: str, rows: int | None = None, max_mb: float = 0
) -> dict[str, Any]:
    """Write the bundle of step `step` of run `run_id` (its first `rows` rows; None: all) to
    `out` (default RUN-step-STEP.zip); its meta, with the file's `path`. ValueError (one
    sentence) when the step cannot be bundled."""
    run_dir = resolve_run(run_id, root)
    cfg = config_of((run_dir / "config.yaml").read_text())
    version = read_step(run_dir, step, 1).learner_version
    weights = {"policy": _policy_at(run_dir, cfg, step, version)}
    if cfg.model.lora.rank:
        weights = _lora_weights(cfg, weights["policy"], version)
    experts = _experts_per_token(weights.get("base", weights.get("policy")))
    step_rows = read_step(run_dir, step, rows, experts)
    # one optimizer step a batch: every output comes before it, so the optimizer's state (and the
    # checkpoint's pickled files) is not needed: the policy's safetensors (a LoRA policy's
    # adapter) alone
    policy = weights.get("policy")
    if cfg.trainer.minibatches == 1 and policy and (policy / "policy").is_dir():
        weights["policy"] = policy / "policy"
    # a LoRA policy's KL reference is its base with the adapter disabled: no second copy
    if cfg.algo.kl_coef > 0 and not cfg.model.lora.rank:
        weights["reference"] = _starting_policy(cfg)
    from workbench.run.model_paths import teacher_path

    teacher = teacher_path(cfg)
    if teacher:
        weights["teacher"] = Path(teacher)
    limit = (max_mb or MAX_EMBEDDED_MB) * 2**20
    embedded = {}
    meta_weights = {}
    for name, folder in weights.items():
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        checkpoint = (folder / "trainer.pt").exists()
        meta_weights[name] = {"checkpoint": checkpoint, "bytes": size}
        if size <= limit:
            embedded[name] = folder
        else:
            meta_weights[name] |= {"path": str(folder.resolve()), "sha256": folder_hash(folder)}
    meta = {
        "run_id": run_dir.name,
        "step": step,
        "rows": len(step_rows.segments),
        "batch_rows": step_rows.batch_rows,
        "learner_version": version,
        "weights": meta_weights,
    }
    out = out or f"{run_dir.name}-step-{step}.zip"
    write_bundle(Path(out), meta, (run_dir / "config.yaml").read_text(), step_rows, embedded)
    return meta | {"path": out}


def _policy_at(run_dir: Path, cfg: DictConfig, step: int, version: int) -> Path:
    """The folder of the learner's weights at `version`: its checkpoint, or for version 0 the
    starting policy; ValueError naming the steps that can be bundled when neither exists."""
    saved = weights_versions(run_dir)
    if version in saved:
        return saved[version]
    if version == 0:
        return _starting_policy(cfg)
    steps = ", ".join(map(str, bundleable_steps(run_dir))) or "none"
    raise ValueError(
        f"Step {step} of run {run_dir.name} trained on weights version {version}, which no kept "
        f"checkpoint holds (bundleable steps: {steps}): rerun with trainer.checkpoint_every=1 "
        f"trainer.keep_checkpoints=<steps> to keep every step's weights."
    )


def _lora_weights(cfg: DictConfig, policy: Path, version: int) -> dict[str, Path]:
    """A LoRA step's weights: the base the run started from, and the adapter of `version` (its
    checkpoint, whose `policy/` is the adapter alone); version 0 has no adapter to carry, every
    process builds the same fresh one (models/lora.py)."""
    weights = {"base": _starting_policy(cfg)}
    if version:
        weights["policy"] = policy
    return weights


def _experts_per_token(folder: Path) -> int:
    """The experts a MoE policy in `folder` (a checkpoint or a policy folder) routes each token
    to; 1 for a dense one."""
    config = folder / "policy" / "config.json"
    if not config.exists():
        config = folder / "config.json"
    return int(json.loads(config.read_text()).get("num_experts_per_tok") or 1)


def _starting_policy(cfg: DictConfig) -> Path:
    """The policy the run started from (model.path, or the tiny model as the run built it)."""
    from workbench.run.model_paths import policy_path

    fresh = OmegaConf.merge(cfg, {"run": {"resume": False}})
    return Path(policy_path(fresh))


# ---- replay


@dataclass
class Diff:
    """One output of the learner, replayed against the recorded one."""

    name: str
    values: int
    max_abs_diff: float
    tolerance: float
    ok: bool
    note: str = ""


def replay(bundle: str, atol: float = 1e-4, rtol: float = 1e-4) -> tuple[dict, list[Diff]]:
    """Re-run a bundle's step on the CPU; its meta and the diff of every output."""
    with tempfile.TemporaryDirectory(prefix="molt-wb-replay-") as scratch:
        meta, config_yaml, step = read_bundle(Path(bundle), Path(scratch))
        folders = {name: _weights_folder(meta, name, Path(scratch)) for name in meta["weights"]}
        cfg = config_of(
            config_yaml, ["ray.learner_workers=1", "ray.learner_gpus=0", "run.resume=false"]
        )
        metrics, rows = _train(cfg, folders, meta, step)
    skip = ()
    # without replay, the replay-on forward beside π_old forced the rollout's routes everywhere,
    # and the bundle holds them only where the live router differed
    if not cfg.algo.routing_replay and any(r["mismatched"] for r in step.routing):
        skip = ("mismatch/kl_replay",)
    return meta, diff_outputs(step, metrics, rows, atol, rtol, skip)


def _weights_folder(meta: dict, name: str, scratch: Path) -> Path:
    """Where the bundle's weights `name` are: extracted, or at their recorded path (its hash
    checked); ValueError when that path is gone or changed."""
    entry = meta["weights"][name]
    if "path" not in entry:
        return scratch / "weights" / name
    folder = Path(entry["path"])
    if not folder.is_dir() or folder_hash(folder) != entry["sha256"]:
        raise ValueError(
            f"The bundle's {name} weights at {folder} are missing or changed since it was written: "
            f"replay it where that checkpoint is, or write it again with a larger --max-mb."
        )
    return folder


def _train(
    cfg: DictConfig, folders: dict[str, Path], meta: dict, step: StepRows
) -> tuple[dict[str, float], dict[str, Any]]:
    """A fresh CPU learner holding the bundle's weights, trained on the bundle's segments."""
    from workbench.learner.learner import Learner

    policy = folders.get("policy")
    checkpoint = policy is not None and meta["weights"]["policy"]["checkpoint"]
    teacher = folders.get("teacher")
    teacher = teacher and str(teacher)
    # a LoRA step starts from its base, with a fresh adapter; else from the policy itself
    start = folders.get("base") or (policy / "policy" if checkpoint else policy)
    learner = Learner(cfg, str(start), teacher=teacher)
    learner.version = meta["learner_version"]
    if checkpoint:
        # one process, no process group: torch.distributed.checkpoint warns that it loads alone
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            learner.load_checkpoint(str(policy))
    elif policy is not None and "base" in folders:
        _load_adapter(learner, policy)
    if "reference" in folders:
        learner.reference = learner.frozen(str(folders["reference"]), cfg.model.dtype)
    return learner.train(step.segments)


def _load_adapter(learner: Any, folder: Path) -> None:
    """The adapter a LoRA checkpoint's `policy/` holds, into the learner's fresh one."""
    from safetensors.torch import load_file

    from workbench.models.lora import load_adapter

    load_adapter(learner.model, load_file(folder / "adapter_model.safetensors"))


def diff_outputs(
    step: StepRows,
    metrics: dict[str, float],
    rows: dict[str, Any],
    atol: float,
    rtol: float,
    skip: tuple[str, ...] = (),
) -> list[Diff]:
    """Every replayed output against the recorded one (but the metrics in `skip`)."""
    whole = len(step.segments) == step.batch_rows
    recorded = step.token_outputs
    diffs = [
        _close("pi_old (train_logprob)", recorded["train_logprob"], rows["train_logprob"][0], atol),
        _close("is_weight", recorded["is_weight"], rows["is_weight"][0], atol, rtol),
    ]
    if rows.get("entropy") is not None and not np.isnan(recorded["entropy"]).all():
        diffs.append(_close("entropy", recorded["entropy"], rows["entropy"][0], atol, rtol))
    gate = rows.get("gate") or {}
    if step.gate["decision"]:
        decisions = ["kept" if kept else "dropped" for kept in gate["kept"]]
        diffs.append(_equal("gate decision", step.gate["decision"], decisions))
        diffs.append(_equal("gate reason", step.gate["reason"], gate["reason"]))
        diffs.append(
            _equal("gate tokens_masked", step.gate["tokens_masked"], gate["tokens_masked"])
        )
        for name in ("seq_log_ratio", "geo_ratio"):
            diffs.append(_close(f"gate {name}", step.gate[name], gate[name], atol, rtol))
    if step.routing or rows["routing"]:
        replayed = [r["mismatched"] for r in rows["routing"]]
        diffs.append(
            _equal("routing mismatched", [r["mismatched"] for r in step.routing], replayed)
        )
    if not whole:
        note = f"not compared: {len(step.segments)} of {step.batch_rows} rows, these need all"
        return [*diffs, Diff("advantages, loss, grad norm, metrics", 0, 0.0, atol, True, note)]
    token_advantage = rows.get("token_advantage")
    if token_advantage is None:
        lengths = [len(s.token_ids) for s in step.segments]
        token_advantage = [np.repeat(np.asarray(rows["advantage"], np.float32), lengths)]
    diffs.append(_close("advantage", recorded["advantage"], token_advantage[0], atol, rtol))
    for key in sorted(step.metrics):
        if key in metrics and not key.startswith(NOT_REPLAYED) and key not in skip:
            diffs.append(_close(key, [step.metrics[key]], [metrics[key]], atol, rtol))
    return diffs


def _close(name: str, recorded: Any, replayed: Any, atol: float, rtol: float = 0.0) -> Diff:
    """Values within `atol + rtol * |recorded|`; NaN (a null the store kept) matches -inf or
    NaN, an infinity itself."""
    recorded = np.asarray(recorded, np.float64)
    replayed = np.asarray(replayed, np.float64)
    if recorded.shape != replayed.shape:
        return Diff(name, recorded.size, math.inf, atol, False, f"{replayed.size} values replayed")
    unknown = np.isnan(recorded) & (np.isnan(replayed) | np.isneginf(replayed))
    same = np.isclose(replayed, recorded, atol=atol, rtol=rtol, equal_nan=True) | unknown
    gaps = np.abs(replayed - recorded)[~unknown & np.isfinite(recorded) & np.isfinite(replayed)]
    worst = float(gaps.max()) if gaps.size else 0.0
    return Diff(name, recorded.size, worst, atol, bool(same.all()))


def _equal(name: str, recorded: list, replayed: list) -> Diff:
    """Values that must be equal (decisions, reasons, counts)."""
    recorded = list(recorded)
    replayed = list(replayed)
    wrong = sum(a != b for a, b in zip(recorded, replayed, strict=False))
    wrong += abs(len(recorded) - len(replayed))
    note = f"{wrong} differ" if wrong else ""
    return Diff(name, len(recorded), float(wrong), 0.0, not wrong, note)
