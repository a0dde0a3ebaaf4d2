"""The off-policy gap of every sampled token, δ = log π_old − log π_behavior, split into measured
parts that sum to it: staleness + routing + sampler + numerics = δ.

- staleness: π_old less the learner's log-prob under the weights of the version that sampled the
  token. 0 where that version is the learner's; on `audit.gap_rows` rows drawn each step it is
  recomputed with the learner's forward under the kept weights of that version (the learner keeps
  the few versions rollout can still sample from; only the trainable parameters change).
- routing: for a MoE policy trained without routing replay, π_old less the replay-on forward the
  learner runs for its mismatch metrics; 0 under replay (the rollout's routes are forced) and for a
  dense policy.
- sampler: what the engine's truncation (engine.top_p) does to the sampled token's log-prob: raw
  less processed, both the engine's own, for every sampled token (the torch engine returns each
  sampled id's raw log-prob beside the processed one; `Segment.raw_logprob`). An engine that
  returns no raw log-prob (vLLM: one `logprobs_mode` per engine, and its processed log-probs are
  the ones the gap needs) falls back to the learner: raw less processed under the learner's
  distribution at the sampling version's weights, on the drawn rows only. 0 when top_p = 1 (the
  temperature is applied on both sides).
- numerics: the rest, δ less the three: the two implementations' disagreement, measured directly
  on on-policy tokens (where the other parts are 0 or measured).

A token's parts are null where one of them is not measured (a stale token outside the drawn rows).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from workbench.models.multimodal import forward_inputs

if TYPE_CHECKING:
    from collections.abc import Iterator

    from workbench.config import Config
    from workbench.learner.batch import OldLogprobs, TrainBatch
    from workbench.models.multimodal import ImageCodec

# the parts, in the order their columns (gap_NAME) and metrics (gap/NAME) are written
PARTS = ("staleness", "routing", "sampler", "numerics")


class GapLearner(Protocol):
    """What the gap reads of the learner (`learner.Learner`)."""

    model: torch.nn.Module
    codec: ImageCodec | None
    replay: bool
    temperature: float

    def logprobs(self, train_batch: TrainBatch) -> torch.Tensor: ...


@dataclass
class Behind:
    """The drawn rows' measurements under the sampling versions' weights, taken before π_old."""

    # the learner's log-prob under the token's own version; NaN where not measured
    logprob: torch.Tensor  # [rows, tokens]
    # raw less processed log-prob (engine.top_p's truncation) the learner recomputed, where the
    # engine gave no raw log-prob; NaN where not measured
    sampler: torch.Tensor  # [rows, tokens]


class GapAudit:
    """The learner's part of the gap: the weights of recent versions, and the drawn rows' forwards
    under them."""

    def __init__(self, cfg: Config, model: torch.nn.Module) -> None:
        self.rows = cfg.audit.gap_rows
        self.seed = cfg.seed
        # the sampler's truncation: the torch engine and vLLM apply top_p only when sampling
        self.top_p = cfg.engine.top_p if cfg.engine.temperature > 0 else 1.0
        # versions rollout can still sample from: behind by async_depth, one more mid-sequence
        self.keep = 0
        if self.rows and (cfg.trainer.async_depth or cfg.rollout.partial):
            self.keep = cfg.trainer.async_depth + 1 + int(cfg.rollout.partial)
        self.trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        # a sharded learner's FSDP modules: the root keeps its gathered parameters after a forward
        self.sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        # version -> a copy of the trainable parameters at that version
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def behind(self, learner: GapLearner, train_batch: TrainBatch, consumed_at: int) -> Behind:
        """The drawn rows' log-probs under each token's sampling version, and the sampler part
        where top_p < 1 and the engine gave no raw log-prob; called before π_old, while no graph
        holds the weights."""
        shape = train_batch.loss_mask.shape
        behind = Behind(torch.full(shape, torch.nan), torch.full(shape, torch.nan))
        if self.keep:
            self._keep(consumed_at)
        rows = self._drawn(train_batch, consumed_at)
        if not len(rows):
            return behind
        from workbench.learner.batch import rows_of

        drawn = rows_of(train_batch, rows)
        versions = drawn.behavior_version.masked_fill(~drawn.loss_mask, consumed_at)
        # the learner recomputes the sampler part only where the engine's own is missing (vLLM)
        unknown = engine_sampler(drawn).isnan() & drawn.loss_mask
        recompute = self.top_p < 1 and bool(unknown.any())
        for version in versions.unique().tolist():
            if version != consumed_at and version not in self.versions:
                continue
            with torch.no_grad(), self._at(version, consumed_at):
                at = versions == version
                if version != consumed_at:
                    logprob = learner.logprobs(drawn)
                    behind.logprob[rows] = torch.where(at, logprob, behind.logprob[rows])
                if recompute:
                    sampler = sampler_part(learner, drawn, self.top_p)
                    behind.sampler[rows] = torch.where(at, sampler, behind.sampler[rows])
        return behind

    def parts(
        self,
        learner: GapLearner,
        train_batch: TrainBatch,
        pi_old: OldLogprobs,
        behind: Behind,
        consumed_at: int,
    ) -> tuple[dict[str, float], dict[str, Any]]:
        """Each sampled token's parts [rows, tokens] (NaN where one is not measured) and the
        step's `gap/` metrics: each part's and the whole gap's mean over the measured tokens."""
        sampled = train_batch.loss_mask
        delta = pi_old.logprob - train_batch.behavior_logprob
        same = train_batch.behavior_version == consumed_at
        values = {"staleness": torch.where(same, 0.0, pi_old.logprob - behind.logprob)}
        # the replay-on forward `routing_metrics` ran beside π_old (a MoE policy, replay off)
        replayed = pi_old.routing.get("other_replay")
        values["routing"] = torch.zeros_like(delta)
        if replayed is not None and not learner.replay:
            values["routing"] = pi_old.logprob - replayed
        values["sampler"] = behind.sampler if self.top_p < 1 else torch.zeros_like(delta)
        # the engine's own raw less processed log-prob, wherever it returned the raw one
        engine = engine_sampler(train_batch)
        values["sampler"] = torch.where(engine.isnan(), values["sampler"], engine)
        values["numerics"] = delta - values["staleness"] - values["routing"] - values["sampler"]
        measured = sampled & values["numerics"].isfinite()
        count = measured.sum().clamp(min=1)
        metrics = {
            "gap/total": float(torch.where(measured, delta, 0.0).sum() / count),
            "gap/measured_frac": float(measured.sum() / sampled.sum().clamp(min=1)),
        }
        real = train_batch.attention_mask.bool()
        columns = {}
        for name in PARTS:
            part = torch.where(measured, values[name], torch.nan)
            metrics[f"gap/{name}"] = float(torch.where(measured, part, 0.0).sum() / count)
            columns[f"gap_{name}"] = [part[real].numpy()]
        return metrics, columns

    def _keep(self, version: int) -> None:
        """A copy of the weights at `version` (the learner's now) in host memory, where a GPU
        run has room for them (a sharded learner's rank: its own shards); the oldest beyond `keep`
        dropped."""
        copies = {n: own(p).to("cpu", copy=True) for n, p in self.trainable.items()}
        self.versions[version] = copies
        for old in sorted(self.versions)[: -self.keep]:
            del self.versions[old]

    def _drawn(self, train_batch: TrainBatch, consumed_at: int) -> torch.Tensor:
        """The rows whose parts are measured in full this step: `audit.gap_rows` of those with a
        stale sampled token (or, when top_p < 1, a sampled token the engine gave no raw log-prob
        of), drawn with the run's seed; none when every part is known without a forward."""
        stale = train_batch.loss_mask & (train_batch.behavior_version != consumed_at)
        wanted = stale
        if self.top_p < 1:
            wanted = stale | (train_batch.loss_mask & engine_sampler(train_batch).isnan())
        candidates = wanted.any(-1).nonzero().flatten()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + consumed_at)
        order = torch.randperm(len(candidates), generator=generator)
        return candidates[order[: self.rows]].sort().values

    @contextlib.contextmanager
    def _at(self, version: int, current: int) -> Iterator[None]:
        """The trainable parameters at `version` while inside, the current ones after."""
        if version == current:
            yield
            return
        for name, parameter in self.trainable.items():
            own(parameter).copy_(self.versions[version][name])
        try:
            yield
        finally:
            for name, parameter in self.trainable.items():
                own(parameter).copy_(self.versions[current][name])
            # drop what the forward gathered at `version`: the next one gathers the current shards
            for module in self.sharded:
                module.reshard()


def own(parameter: torch.Tensor) -> torch.Tensor:
    """The values a parameter holds on this rank, as a tensor that writes them in place: a sharded
    learner's DTensor's local shard (what FSDP all-gathers in the forward), else its data."""
    if isinstance(parameter, DTensor):
        return parameter.detach().to_local()
    return parameter.data


def engine_sampler(train_batch: TrainBatch) -> torch.Tensor:
    """The engine's own sampler part [rows, tokens]: each sampled id's raw less processed
    log-prob; NaN where the engine returned no raw log-prob (vLLM) and on tokens not sampled."""
    raw = train_batch.raw_logprob
    if raw is None:
        return torch.full(train_batch.loss_mask.shape, torch.nan)
    return torch.where(train_batch.loss_mask, raw - train_batch.behavior_logprob, torch.nan)


def sampler_part(learner: GapLearner, train_batch: TrainBatch, top_p: float) -> torch.Tensor:
    """Raw less processed log-prob [rows, tokens] of each id under the learner's distribution at
    the sampling temperature, processed as the engine does (top_p truncated and renormalised);
    one padded forward, first column 0."""
    from workbench.engines.torch_engine import nucleus

    model = learner.model
    device = next(model.parameters()).device
    ids = train_batch.token_ids.to(device)
    mask = train_batch.attention_mask.to(device)
    inputs = forward_inputs(model, ids, mask, train_batch.images, learner.codec)
    scaled = model(**inputs).logits[:, :-1].float() / learner.temperature  # [rows, tokens-1, V]
    raw = torch.log_softmax(scaled, dim=-1)
    processed = nucleus(raw, top_p)
    next_ids = ids[:, 1:, None]
    part = raw.gather(-1, next_ids) - processed.gather(-1, next_ids)  # [rows, tokens-1, 1]
    return torch.nn.functional.pad(part.squeeze(-1).cpu(), (1, 0))
