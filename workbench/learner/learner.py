"""The learner: recompute log-probs of the exact sampled ids, compute advantages, take policy
gradient steps.

Each optimizer step bumps the weight version by one; the loop pushes the new weights (with that
version) to every rollout engine. The maths is in workbench.algo, found through its registries
(`ADVANTAGES`, `POLICY_LOSSES`); this module only batches and calls them.
"""

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from workbench.algo.advantages import ADVANTAGES, uniform_groups
from workbench.algo.losses import POLICY_LOSSES, approx_kl
from workbench.config import Config, GateConfig
from workbench.engines.base import to_wire
from workbench.engines.torch_engine import set_threads
from workbench.invariants.routing_replay import find_routers
from workbench.invariants.version_gate import GateResult, gate_metrics, version_gate
from workbench.learner.batch import (
    LossTargets,
    OldLogprobs,
    TokenLogprobs,
    TrainBatch,
    audit_identity,
    batch_metrics,
    collate,
    generate_seconds,
    routing_table_rows,
    rows_of,
    step_means,
    store_rows,
)
from workbench.learner.forward import PolicyForward
from workbench.learner.sharding import Ranks
from workbench.learner.transport import WeightGroup, layout_of
from workbench.models.gap import GapAudit
from workbench.models.lora import adapter_state, with_adapter
from workbench.models.multimodal import ImageCodec, is_vision_language, load_policy
from workbench.models.state import load_learner, save_learner, side_files
from workbench.segment import Segment


class Learner(PolicyForward):
    """The policy in training, its optimizer and weight version; `train` takes one rollout batch
    through the named steps below."""

    def __init__(
        self,
        cfg: Config,
        model_path: str,
        rank: int = 0,
        address: tuple[str, int] | None = None,
        teacher: str | None = None,
    ) -> None:
        # rank `rank` of `ray.learner_workers`, joined at `address` (sharding.py); `teacher`: the
        # distillation teacher's checkpoint (model_paths.teacher_path)
        self.ranks = Ranks(cfg, rank, address)
        self.codec = ImageCodec(model_path) if is_vision_language(model_path) else None
        torch.manual_seed(cfg.seed)
        self.algo = cfg.algo
        self.trainer = cfg.trainer
        self.gate = cfg.gate
        self.temperature = cfg.engine.temperature
        # sharded: float32 parameters, forwards in model.dtype (FSDP2 mixed precision)
        master = cfg.model.dtype if self.ranks.world == 1 else "float32"
        model = load_policy(model_path, master)
        # LoRA: an adapter on the frozen policy, which alone trains and travels (models/lora.py)
        self.lora = bool(cfg.model.lora.rank)
        self.model = with_adapter(model, cfg.model.lora).train().to(self.ranks.device)
        set_threads(cfg, self.model)
        self.moe = bool(find_routers(self.model))
        self.ranks.shard(self.model, cfg.model.dtype)
        self.gap = GapAudit(cfg, self.model)
        # fused: one kernel for every tensor, 0.3 ms a step, not 0.9 (tiny, CPU)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.trainer.lr,
            weight_decay=cfg.trainer.weight_decay,
            fused=True,
        )
        self.version = 0
        # the collective weight transport's group (rank 0, ray.weight_transport=collective)
        self.weight_group = None
        self.bucket_bytes = cfg.ray.weight_bucket_mb * 2**20
        self.replay = cfg.algo.routing_replay
        self.side_files = side_files(model_path)
        self.estimator = ADVANTAGES[cfg.algo.advantage]
        self.policy_loss = POLICY_LOSSES[cfg.algo.policy_loss]
        # the entropy keeps its graph for a bonus only
        self.entropy_grad = bool(cfg.algo.entropy_coef)
        # frozen models: the KL reference (a copy of the starting policy) and the distillation
        # teacher
        self.reference = None
        if cfg.algo.kl_coef > 0:
            # a LoRA policy's reference is its base: the adapter disabled, no second copy
            self.reference = self.model if self.lora else self.frozen(model_path, cfg.model.dtype)
        if self.estimator.teacher:
            self.teacher = self.frozen(teacher, cfg.model.dtype)

    def frozen(self, path: str, dtype: str) -> torch.nn.Module:
        """A frozen model (the KL reference, the teacher), sharded like the policy: it has no
        gradient or optimizer state, but unsharded its parameters alone would outweigh a rank's
        share of the policy's."""
        model = load_policy(path, dtype).eval().to(self.ranks.device)
        self.ranks.shard(model, dtype)
        return model

    def save_checkpoint(self, folder: str | Path, driver_state: dict[str, Any]) -> int:
        return save_learner(self, folder, driver_state)

    def load_checkpoint(self, folder: str | Path) -> int:
        return load_learner(self, folder)

    def weights(self) -> dict[str, Any] | None:
        """The current weights (in `to_wire` form) and their version, as the rollout workers load
        them."""
        full = self.sync_state()
        if full is None:
            return None
        return {"state_dict": to_wire(full), "version": self.version}

    def sync_state(self) -> dict[str, torch.Tensor] | None:
        """What a push carries: the adapter of a LoRA policy, else the full weights gathered
        from the shards (on rank 0; others: None)."""
        if self.lora:
            return adapter_state(self.model)
        return self.ranks.full_state_dict(self.model)

    def step(
        self, *worker_segments: list[Segment]
    ) -> tuple[dict[str, float], dict[str, Any], dict[str, Any] | None]:
        """`train`, then the new `weights`: one call of the loop's, so the next batch waits on
        nothing more. `perf/weight_sync_s`: gathering the full weights from the shards and
        packing them for the engines; `perf/weight_sync_bytes`: what the engines receive."""
        metrics, rows = self.train(*worker_segments)
        start = time.perf_counter()
        if self.weight_group is None:
            weights = self.weights()
            sent = weights and weights["state_dict"]["raw"].nbytes
        else:
            weights, sent = self.broadcast_weights()
        metrics["perf/weight_sync_s"] = time.perf_counter() - start
        if self.ranks.rank == 0:
            metrics["perf/weight_sync_bytes"] = float(sent)
        return metrics, rows, weights

    def weight_layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The full weights' names, dtypes and shapes (a sharded tensor's are its whole one's)."""
        if self.lora:
            return layout_of(adapter_state(self.model))
        return layout_of(self.model.state_dict())

    def join_weight_group(self, address: tuple[str, int], world: int) -> None:
        """Rank 0 joins the collective weight transport's group as its rank 0."""
        if self.ranks.rank == 0:
            self.weight_group = WeightGroup(address, 0, world, self.trainer.timeout_s)

    def broadcast_weights(self) -> tuple[dict[str, Any] | None, int]:
        """The new weights gathered from the shards and broadcast to the rollout workers; the
        handle that stands for them (no tensors) and the bytes sent."""
        full = self.sync_state()
        if full is None:
            return None, 0
        try:
            sent = self.weight_group.send(full, self.version, self.bucket_bytes)
        # a rollout worker died: window.sync sends these weights through the object store
        except RuntimeError:
            sent = 0
        return {"state_dict": None, "version": self.version}, sent

    def routing_metrics(
        self, train_batch: TrainBatch, routing: dict[str, torch.Tensor], old_logprob: torch.Tensor
    ) -> dict[str, float]:
        """Live vs rollout routes, and the rollout-learner KL with replay and without (one extra
        forward)."""
        # [rows, tokens, layers]
        real = train_batch.attention_mask.bool()[:, :, None] & routing["known"]
        tokens = real.any(-1)
        mismatch = routing["mismatch"] & real
        with torch.no_grad():
            other = self.logprobs(train_batch, replay=not self.replay)
        routing["other_replay"] = other
        with_replay, without = (old_logprob, other) if self.replay else (other, old_logprob)
        behavior = train_batch.behavior_logprob
        mask = train_batch.loss_mask
        return {
            "routing/mismatch_token_frac": float(
                mismatch.any(-1).sum() / tokens.sum().clamp(min=1)
            ),
            "routing/mismatch_layer_frac": float(mismatch.sum() / real.sum().clamp(min=1)),
            "mismatch/kl_replay": float(approx_kl(behavior, with_replay, mask, "k3")),
            "mismatch/kl_no_replay": float(approx_kl(behavior, without, mask, "k3")),
        }

    # ---- the named steps of `train`

    def old_logprobs(self, train_batch: TrainBatch) -> OldLogprobs:
        """π_old, the learner's log-probs of the sampled ids [rows, tokens], with its entropies,
        the route mismatches of a MoE policy and, when the training forward itself has π_old's
        value, that forward (`OldLogprobs`). Under `gate.bypass` the behavior log-probs are π_old:
        on-policy (config.py refuses it otherwise, the gate checks every batch) they are its
        value, up to the engine's float rounding."""
        # one optimizer step on a dense policy: π_old is the value of the training forward
        # itself, so it runs once
        if (
            self.trainer.minibatches == 1
            and not self.moe
            and not self.trainer.max_tokens_per_microbatch
        ):
            live = self.logprobs_entropy(train_batch)
            old_logprob = live.logprob.detach()
            if self.gate.bypass:
                old_logprob = train_batch.behavior_logprob
            return OldLogprobs(old_logprob, live.entropy.detach(), {}, live)
        if self.gate.bypass:
            return OldLogprobs(train_batch.behavior_logprob, None, {})
        routing = {}
        with torch.no_grad():
            pi_old = self.logprobs_entropy(train_batch, routing=routing)
        return OldLogprobs(pi_old.logprob, pi_old.entropy, routing)

    def apply_gate(
        self, train_batch: TrainBatch, old_logprob: torch.Tensor, consumed_at: int
    ) -> GateResult:
        """The version gate's decisions and per-token IS weights for this batch: every `gate.*`
        key is one of `version_gate`'s options."""
        options = {key.name: getattr(self.gate, key.name) for key in dataclasses.fields(GateConfig)}
        return version_gate(
            train_batch.behavior_logprob,
            old_logprob,
            train_batch.loss_mask,
            train_batch.behavior_version,
            consumed_at,
            **options,
        )

    def advantages(
        self, train_batch: TrainBatch, old_logprob: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages [rows] or [rows, tokens] of the registered estimator `algo.advantage`, and
        its metrics."""
        teacher_logprob = None
        if self.estimator.teacher:
            teacher_logprob = self.frozen_logprobs(self.teacher, train_batch)
        return self.estimator.estimate(train_batch, old_logprob, teacher_logprob, self.algo)

    def filtered(
        self, train_batch: TrainBatch, loss_mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss mask [rows, tokens] less every group of one reward when
        `algo.filter_uniform_groups` (dynamic filtering)."""
        if not self.algo.filter_uniform_groups:
            return loss_mask, {}
        dropped = uniform_groups(train_batch.rewards, train_batch.group_ids)  # [rows]
        return loss_mask & ~dropped[:, None], {"filter/dropped_frac": float(dropped.float().mean())}

    def optimizer_steps(
        self, train_batch: TrainBatch, live: TokenLogprobs | None, targets: LossTargets
    ) -> tuple[list[dict[str, float]], float]:
        """`trainer.minibatches` optimizer steps, one per slice of the batch's rows; their
        metrics, and the seconds of model compute they took."""
        steps = []
        compute = 0.0
        for rows in torch.arange(len(train_batch.rewards)).chunk(self.trainer.minibatches):
            minibatch = rows_of(train_batch, rows)
            minibatch_targets = rows_of(targets, rows)
            start = time.perf_counter()
            steps.append(self.optimizer_step(minibatch, minibatch_targets, live))
            compute += time.perf_counter() - start
        return steps, compute

    def optimizer_step(
        self, minibatch: TrainBatch, targets: LossTargets, live: TokenLogprobs | None
    ) -> dict[str, float]:
        """One step: the registered policy loss `algo.policy_loss` (plus the KL to the reference),
        backward (micro-batch by micro-batch under `trainer.max_tokens_per_microbatch`), gradient
        clip, optimizer step; the version goes up by one."""
        self.optimizer.zero_grad()
        if live is None and self.trainer.max_tokens_per_microbatch:
            logprob = self.accumulated(minibatch, targets)
            loss, metrics = self.loss(logprob, minibatch, targets)
        else:
            if live is None:
                # under replay when on: router logits and gradient stay live
                live = self.logprobs_entropy(minibatch, entropy=bool(self.algo.entropy_coef))
            loss, metrics = self.loss(live.logprob, minibatch, targets, live.entropy)
            # FSDP2 averages the ranks' gradients; each is already its rows' share of the loss
            (loss * self.ranks.world).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.trainer.max_grad_norm
        )
        self.optimizer.step()
        self.version += 1
        return dict(metrics, policy=float(loss.detach()), grad_norm=self.ranks.grad_norm(grad_norm))

    def loss(
        self,
        logprob: torch.Tensor,
        minibatch: TrainBatch,
        targets: LossTargets,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The registered policy loss (plus the KL to the reference, less the entropy bonus
        `algo.entropy_coef`) of a minibatch's log-probs and entropies, and its metrics."""
        loss, metrics = self.policy_loss(
            logprob,
            targets.old_logprob,
            targets.advantages,
            targets.loss_mask,
            minibatch.loss_mask,
            clip_low=self.algo.clip_low,
            clip_high=self.algo.clip_high,
            aggregation=self.algo.aggregation,
            constant_denominator=self.algo.constant_denominator,
            is_weight=targets.is_weight,
            entropy=entropy,
            entropy_coef=self.algo.entropy_coef,
        )
        if targets.reference is not None:
            kl = approx_kl(logprob, targets.reference, targets.loss_mask, self.algo.kl_estimator)
            loss = loss + self.algo.kl_coef * kl
            metrics["kl_ref"] = float(kl.detach())
        return loss, metrics

    def accumulated(self, minibatch: TrainBatch, targets: LossTargets) -> torch.Tensor:
        """Gradients accumulated micro-batch by micro-batch, each backward through the whole
        minibatch's loss with every other row held at π_old: the loss is a sum over rows with
        denominators of the whole minibatch, so each row's gradient is what the whole loss gives
        it. The live log-probs of every row [rows, tokens], detached."""
        rows = len(minibatch.rewards)
        local = self.local(minibatch)
        start = self.ranks.mine(rows).start
        mine = torch.zeros(local.attention_mask.shape)
        for group in self.microbatches(local, self.ranks.count(rows)):
            # an empty micro-batch runs a row with weight 0 (FSDP's collectives wait on it)
            run = group if len(group) else torch.arange(1)
            piece, _, _ = self.forward(self.model, rows_of(local, run), replay=self.replay)
            whole = targets.old_logprob + 0 * piece.sum()
            if len(group):
                whole = targets.old_logprob.index_copy(0, group + start, piece)
                mine[group] = piece.detach()
            loss, _ = self.loss(whole, minibatch, targets)
            (loss * self.ranks.world).backward()
        return self.ranks.gather(mine[: self.ranks.count(rows)], rows)

    def sft(self, segments: list[Segment]) -> tuple[dict[str, float], dict[str, Any]]:
        """One supervised step on demonstrations (`molt-wb sft`, the warm start): `optimizer_step`
        with the loss `algo.policy_loss=sft` over their trainable tokens; no π_old, gate or
        advantages. Returns (metrics, per-token rows) as `train` does."""
        train_batch = collate(segments)
        live = self.logprobs_entropy(train_batch, entropy=False)
        # no π_old, advantages or IS weights: the sft loss reads the mask alone
        targets = LossTargets(None, None, train_batch.loss_mask, None)
        # loss/policy is the sft loss, loss/tokens the tokens it is over
        metrics = step_means([self.optimizer_step(train_batch, targets, live)])
        metrics["train/version"] = float(self.version)
        real = train_batch.attention_mask.bool()
        rows = {
            "train_logprob": [live.logprob.detach()[real].numpy()],
            "is_weight": [torch.ones(int(real.sum())).numpy()],
            "advantage": [0.0] * len(segments),
            "learner_version": self.version - 1,
            "routing": [],
        }
        return metrics, rows

    def train(self, *worker_segments: list[Segment]) -> tuple[dict[str, float], dict[str, Any]]:
        """One rollout batch (each rollout worker's Segments) -> `trainer.minibatches` optimizer
        steps. Returns (metrics, per-token rows)."""
        segments = [s for one_worker in worker_segments for s in one_worker]
        consumed_at = self.version
        train_batch = collate(segments)
        identity = audit_identity(segments, train_batch)
        # before π_old: the gap's staleness swaps in older weights, which no graph may hold then
        behind = self.gap.behind(self, train_batch, consumed_at)
        # model compute: forwards, backward, optimizer (perf/learner_compute_s)
        start = time.perf_counter()
        pi_old = self.old_logprobs(train_batch)
        compute = time.perf_counter() - start
        gate = self.apply_gate(train_batch, pi_old.logprob, consumed_at)
        metrics = batch_metrics(segments, train_batch, pi_old.logprob, pi_old.entropy)
        metrics.update(gate_metrics(gate, train_batch.loss_mask))
        metrics.update(identity)
        advantages, advantage_metrics = self.advantages(train_batch, pi_old.logprob)
        metrics.update(advantage_metrics)
        loss_mask, filter_metrics = self.filtered(train_batch, gate.loss_mask)
        metrics.update(filter_metrics)
        # the PPO ratio's anchor (gate.anchor): π_old, or the policy that sampled
        anchor = train_batch.behavior_logprob if self.gate.anchor == "behavior" else pi_old.logprob
        targets = LossTargets(anchor, advantages, loss_mask, gate.token_weight)
        if self.reference is not None:
            targets.reference = self.frozen_logprobs(self.reference, train_batch)
        routing_rows = []
        if pi_old.routing:
            metrics.update(self.routing_metrics(train_batch, pi_old.routing, pi_old.logprob))
            routing_rows = routing_table_rows(segments, pi_old.routing)
        gap, gap_columns = self.gap.parts(self, train_batch, pi_old, behind, consumed_at)
        metrics.update(gap)
        steps, step_compute = self.optimizer_steps(train_batch, pi_old.live, targets)
        metrics.update(step_means(steps))
        metrics["loss/advantage_abs_mean"] = float(advantages.abs().mean())
        metrics["train/version"] = float(self.version)
        metrics["perf/learner_compute_s"] = compute + step_compute
        metrics["perf/generate_s"] = generate_seconds(worker_segments)
        rows = store_rows(
            train_batch, pi_old.logprob, gate, advantages, consumed_at, routing_rows, pi_old.entropy
        )
        return metrics, rows | gap_columns
