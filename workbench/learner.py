"""The learner: recompute log-probs of the exact sampled ids, compute advantages, take PPO-clip steps.

Each optimizer step bumps the weight version by one; the loop pushes the new weights (with that
version) to every rollout engine. The maths is in workbench.algo; this module only batches.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from workbench.algo.advantages import compute_advantages, distill_advantages, uniform_groups
from workbench.algo.losses import (
    approx_kl,
    masked_mean,
    policy_gradient_loss,
    sequence_ratio_logprob,
    token_logprobs,
)
from workbench.engines.base import to_wire
from workbench.invariants.routing_replay import find_routers, replay_routes
from workbench.invariants.version_gate import gate_metrics, version_gate
from workbench.models.multimodal import forward_inputs
from workbench.models.prefix import plan, shared_prefix_logprobs
from workbench.segment import Segment


def collate(segments: list[Segment]) -> dict[str, torch.Tensor]:
    """Right-padded batch tensors built from token ids only (text cannot reach the trainer)."""
    if not all(isinstance(s, Segment) for s in segments):
        raise TypeError("The learner trains on Segment records only (token ids), never on text.")
    lengths = np.array([len(s.token_ids) for s in segments])

    def padded(
        field: str, dtype, fill=0
    ) -> torch.Tensor:  # [batch, seq, ...] right-padded, filled in numpy
        shape = next(getattr(s, field).shape[1:] for s in segments if getattr(s, field) is not None)
        out = np.full((len(segments), lengths.max(), *shape), fill, dtype=dtype)
        for row, s in enumerate(segments):
            if getattr(s, field) is not None:
                out[row, : lengths[row]] = getattr(s, field)
        return torch.from_numpy(out)

    batch = {
        "token_ids": padded("token_ids", np.int64),  # [batch, seq]
        "attention_mask": torch.from_numpy(
            (np.arange(lengths.max()) < lengths[:, None]).astype(np.int64)
        ),
        "loss_mask": padded("loss_mask", bool),
        "behavior_logprob": padded("behavior_logprob", np.float32),
        "behavior_version": padded("behavior_version", np.int32, -1),
    }
    if any(s.routed_experts is not None for s in segments):  # [batch, seq, layers, k], -1 = unknown
        batch["routed_experts"] = padded("routed_experts", np.int16, -1)
    batch["images"] = [
        s.images for s in segments
    ]  # encoded images per row (vision-language policies)
    batch["rewards"] = torch.tensor([s.reward for s in segments], dtype=torch.float32)  # [batch]
    batch["group_ids"] = torch.tensor([s.group_id for s in segments])
    batch["rollout_ids"] = torch.tensor([s.rollout_id for s in segments])
    return batch


def audit_identity(segments: list[Segment], batch: dict) -> dict[str, float]:
    """Token identity, checked on every batch: the rollout's audit (mask-1 ids are the engine's sampled
    ids, in order) and the trainer's input ids equal to the segment's ids. A violation stops the run."""
    violations = sum(not s.audit.get("identity", True) for s in segments)
    ids = batch["token_ids"].numpy()
    violations += sum(
        not np.array_equal(ids[row, : len(s.token_ids)], s.token_ids)
        for row, s in enumerate(segments)
    )
    if violations:
        raise RuntimeError(
            f"Token identity violated in {violations} segment(s): trainer input no longer equals the "
            f"sampled ids; this is a bug in the rollout path, please report it with the run folder."
        )
    drift = [s.audit["retokenize_drift"] for s in segments if "retokenize_drift" in s.audit]
    return {
        "identity/violations": 0.0,
        "identity/retokenize_drift": float(np.mean(drift)) if drift else 0.0,
    }


def routing_table_rows(segments: list[Segment], routing: dict) -> list[dict]:
    """One row per (segment, MoE layer): tokens with a recorded route, how many the live router
    routed differently, their positions and, at each, the rollout's and the learner's experts."""
    rows = []
    for row, s in enumerate(segments):
        n = len(s.token_ids)
        for layer in range(routing["known"].shape[-1]):
            positions = torch.nonzero(routing["mismatch"][row, :n, layer]).flatten().tolist()
            rows.append(
                {
                    "rollout_id": s.rollout_id,
                    "segment_idx": s.segment_idx,
                    "layer": layer,
                    "tokens": int(routing["known"][row, :n, layer].sum()),
                    "mismatched": len(positions),
                    "positions": positions,
                    "rollout_experts": [s.routed_experts[p, layer].tolist() for p in positions],
                    "learner_experts": [routing["live"][row, p, layer].tolist() for p in positions],
                }
            )
    return rows


class Learner:
    def __init__(self, cfg, model_path: str):
        from workbench.engines.torch_engine import load_causal_lm, set_threads
        from workbench.models.multimodal import ImageCodec, is_vision_language

        self.codec = ImageCodec(model_path) if is_vision_language(model_path) else None
        torch.manual_seed(cfg.seed)
        self.algo, self.trainer, self.gate, self.temperature = (
            cfg.algo,
            cfg.trainer,
            cfg.gate,
            cfg.engine.temperature,
        )
        self.model = load_causal_lm(model_path, cfg.model.dtype).train()
        set_threads(cfg, self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.trainer.lr,
            weight_decay=cfg.trainer.weight_decay,
            fused=True,
        )  # one kernel for every tensor: 0.3 ms a step, not 0.9 (tiny, CPU)
        self.version, self.moe, self.replay = (
            0,
            bool(find_routers(self.model)),
            cfg.algo.routing_replay,
        )
        self.model_path = model_path
        # frozen models: the KL reference (a copy of the starting policy) and the distillation teacher
        self.reference = (
            load_causal_lm(model_path, cfg.model.dtype).eval() if cfg.algo.kl_coef > 0 else None
        )
        if cfg.algo.advantage == "on_policy_distill":
            from workbench.runtime import teacher_path

            self.teacher = load_causal_lm(teacher_path(cfg), cfg.model.dtype).eval()

    def save_checkpoint(self, folder: str, driver_state: dict) -> int:
        from workbench.checkpoint import save_learner

        return save_learner(self, folder, driver_state)

    def load_checkpoint(self, folder: str) -> int:
        from workbench.checkpoint import load_learner

        return load_learner(self, folder)

    def weights(self) -> dict:
        """The current weights (in `to_wire` form) and their version, as the rollout workers load them."""
        return {"state_dict": to_wire(self.model.state_dict()), "version": self.version}

    def step(self, *worker_segments: list[Segment]) -> tuple[dict, dict, dict]:
        """`train`, then the new `weights`: one call of the loop's, so the next batch waits on nothing more."""
        return *self.train(*worker_segments), self.weights()

    def logprobs(
        self, batch: dict, replay: bool | None = None, routing: dict | None = None
    ) -> torch.Tensor:
        """Log-probs of the batch's own ids; for a MoE policy with recorded routes, under routing replay
        (`algo.routing_replay`, or `replay` to override) and with the route mismatches put in `routing`."""
        recorded = batch.get("routed_experts") if self.moe else None
        with (
            replay_routes(self.model, recorded, self.replay if replay is None else replay)
            if recorded is not None
            else contextlib.nullcontext({})
        ) as stats:
            logprob = self.forward(self.model, batch, shared=recorded is None)
        if routing is not None:
            routing.update(stats)
        return logprob

    @torch.no_grad()
    def frozen_logprobs(self, model, batch: dict) -> torch.Tensor:
        """Log-probs of the batch's ids under a frozen model (reference or teacher); no routing replay."""
        return self.forward(model, batch, shared=True)

    def forward(self, model, batch: dict, shared: bool) -> torch.Tensor:
        """Log-probs [batch, seq] of the batch's own ids; a group's common prompt runs once when `shared`
        and the policy reads text only (models/prefix.py: the same values, less compute)."""
        ids, mask = batch["token_ids"], batch["attention_mask"]
        if (
            shared
            and self.trainer.shared_prefix
            and self.codec is None
            and (split := plan(ids, mask.sum(-1), batch["group_ids"])) is not None
        ):
            return shared_prefix_logprobs(model, ids, mask, split, self.temperature)
        inputs = forward_inputs(model, ids, mask, batch.get("images"), self.codec)
        return token_logprobs(model(**inputs).logits, ids, self.temperature)

    def routing_metrics(
        self, batch: dict, routing: dict, old_logprob: torch.Tensor
    ) -> dict[str, float]:
        """Live vs rollout routes, and the rollout-learner KL with replay and without (one extra forward)."""
        real = batch["attention_mask"].bool()[:, :, None] & routing["known"]  # [batch, seq, layers]
        tokens = real.any(-1)
        with torch.no_grad():
            other = self.logprobs(batch, replay=not self.replay)
        with_replay, without = (old_logprob, other) if self.replay else (other, old_logprob)
        mask = batch["loss_mask"]
        return {
            "routing/mismatch_token_frac": float(
                (routing["mismatch"] & real).any(-1).sum() / tokens.sum().clamp(min=1)
            ),
            "routing/mismatch_layer_frac": float(
                (routing["mismatch"] & real).sum() / real.sum().clamp(min=1)
            ),
            "mismatch/kl_replay": float(
                approx_kl(batch["behavior_logprob"], with_replay, mask, "k3")
            ),
            "mismatch/kl_no_replay": float(
                approx_kl(batch["behavior_logprob"], without, mask, "k3")
            ),
        }

    def train(self, *worker_segments: list[Segment]) -> tuple[dict, dict]:
        """One rollout batch -> `trainer.minibatches` optimizer steps. Returns (metrics, per-token rows)."""
        segments = [s for batch in worker_segments for s in batch]
        consumed_at = self.version
        batch = collate(segments)
        identity = audit_identity(segments, batch)
        routing: dict = {}
        start = time.perf_counter()
        # one optimizer step on a dense policy: π_old is the value of the training forward itself, so it runs once
        live = self.logprobs(batch) if self.trainer.minibatches == 1 and not self.moe else None
        with torch.no_grad():  # π_old: the learner's log-probs of the sampled ids
            old_logprob = (
                live.detach() if live is not None else self.logprobs(batch, routing=routing)
            )
        compute = (
            time.perf_counter() - start
        )  # model compute: forwards, backward, optimizer (perf/learner_compute_s)
        mask = batch["loss_mask"]
        gate = version_gate(
            batch["behavior_logprob"],
            old_logprob,
            mask,
            batch["behavior_version"],
            consumed_at,
            level=self.gate.level,
            mode=self.gate.mode,
            band=tuple(self.gate.band),
            max_staleness=self.gate.max_staleness,
            token_cap=self.gate.token_cap,
            denominator=self.gate.denominator,
        )
        lengths = batch["attention_mask"].sum(-1)
        sampled = mask.sum(-1).float()
        metrics = {
            "reward/mean": float(batch["rewards"].mean()),
            "reward/std": float(batch["rewards"].std(correction=0)),
            "rollout/segments": float(len(segments)),
            "rollout/tokens": float(lengths.sum()),
            "rollout/sampled_tokens": float(sampled.sum()),
            "rollout/response_len": float(sampled.mean()),
            "mismatch/kl": float(approx_kl(batch["behavior_logprob"], old_logprob, mask, "k3")),
            "mismatch/max_abs_logprob_diff": float(
                ((old_logprob - batch["behavior_logprob"]).abs() * mask).max()
            ),
            **gate_metrics(gate, mask),
            **identity,
        }
        if (
            self.algo.advantage == "on_policy_distill"
        ):  # per token, from the frozen teacher; no reward
            teacher = self.frozen_logprobs(self.teacher, batch)
            advantages = distill_advantages(
                old_logprob, teacher, mask, self.algo.distill_coef
            )  # [batch, seq]
            metrics["distill/kl"] = float(
                masked_mean(old_logprob - teacher, mask)
            )  # k1 of KL(student || teacher)
        else:
            advantages = compute_advantages(
                batch["rewards"],
                batch["group_ids"],
                self.algo.advantage,
                rollout_ids=batch["rollout_ids"],
            )  # [batch]
        loss_mask = gate.loss_mask  # [batch, seq]
        if self.algo.filter_uniform_groups:
            dropped = uniform_groups(batch["rewards"], batch["group_ids"])  # [batch]
            loss_mask = loss_mask & ~dropped[:, None]
            metrics["filter/dropped_frac"] = float(dropped.float().mean())
        reference = (
            self.frozen_logprobs(self.reference, batch) if self.reference is not None else None
        )
        routing_rows = []
        if routing:
            metrics.update(self.routing_metrics(batch, routing, old_logprob))
            routing_rows = routing_table_rows(segments, routing)
        steps = []
        for rows in torch.arange(len(segments)).chunk(self.trainer.minibatches):
            minibatch = {
                key: value[rows] if torch.is_tensor(value) else [value[i] for i in rows.tolist()]
                for key, value in batch.items()
            }
            start = time.perf_counter()
            logprob = (
                live if live is not None else self.logprobs(minibatch)
            )  # under replay when on: router logits and gradient stay live
            ratio_logprob = (
                sequence_ratio_logprob(logprob, old_logprob[rows], mask[rows])
                if self.algo.policy_loss == "gspo"
                else logprob
            )
            loss, step_metrics = policy_gradient_loss(
                ratio_logprob,
                old_logprob[rows],
                advantages[rows],
                loss_mask[rows],
                clip_low=self.algo.clip_low,
                clip_high=self.algo.clip_high,
                aggregation=self.algo.aggregation,
                constant_denominator=self.algo.constant_denominator,
                is_weight=gate.token_weight[rows],
                loss_type="cispo" if self.algo.policy_loss == "cispo" else "ppo",
            )
            if reference is not None:
                kl = approx_kl(logprob, reference[rows], loss_mask[rows], self.algo.kl_estimator)
                loss, step_metrics["kl_ref"] = loss + self.algo.kl_coef * kl, float(kl.detach())
            self.optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.trainer.max_grad_norm
            )
            self.optimizer.step()
            compute += time.perf_counter() - start
            self.version += 1
            steps.append(
                dict(step_metrics, policy=float(loss.detach()), grad_norm=float(grad_norm))
            )
        for key in steps[0]:
            metrics[f"loss/{key}"] = float(np.mean([s[key] for s in steps]))
        metrics["loss/advantage_abs_mean"] = float(advantages.abs().mean())
        metrics["train/version"] = float(self.version)
        metrics["perf/learner_compute_s"] = compute
        metrics["perf/generate_s"] = max(
            (sum(s.audit.get("generate_s", 0.0) for s in w) for w in worker_segments), default=0.0
        )
        real = batch[
            "attention_mask"
        ].bool()  # right-padded: each segment's tokens in order, segment after segment
        rows = {
            "train_logprob": [old_logprob[real].numpy()],
            "is_weight": [gate.token_weight[real].numpy()],
            "advantage": (
                masked_mean(advantages, mask, dim=-1) if advantages.dim() == 2 else advantages
            ).tolist(),
            "learner_version": consumed_at,
            "routing": routing_rows,
            "gate": {
                "staleness": gate.staleness.tolist(),
                "seq_log_ratio": gate.seq_log_ratio.tolist(),
                "geo_ratio": gate.geo_ratio.tolist(),
                "kept": gate.kept.tolist(),
                "reason": gate.reason,
                "tokens_masked": gate.tokens_masked.tolist(),
            },
        }
        return metrics, rows
