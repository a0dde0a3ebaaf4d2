"""The policy's forwards over a `TrainBatch`: log-probs of the batch's own ids, their
distributions' entropies and a MoE policy's routes, in one padded batch or in micro-batches (packed,
or of whole groups that share their prompt), each rank over its own rows.

`PolicyForward` is the part of the learner (`Learner` derives from it) that runs the model without
stepping it; how a forward is batched, packed or replayed changes here.
"""

import contextlib

import torch

from workbench.config import TrainerConfig
from workbench.invariants.routing_replay import replay_routes
from workbench.learner.batch import TokenLogprobs, TrainBatch, rows_of
from workbench.learner.sharding import Ranks
from workbench.models.heads import forward_logprobs_entropy
from workbench.models.multimodal import ImageCodec, forward_inputs
from workbench.models.packing import microbatches, pack_like, packed_logprobs, unpack
from workbench.models.prefix import Plan, plan, shared_prefix_logprobs


class PolicyForward:
    """The policy's forwards; `Learner.__init__` sets what they read."""

    # the policy in training
    model: torch.nn.Module
    # this rank among the learner's ranks, and its device
    ranks: Ranks
    trainer: TrainerConfig
    # a vision-language policy's image encoder, else None
    codec: ImageCodec | None
    # the policy routes tokens to experts
    moe: bool
    # algo.routing_replay
    replay: bool
    # engine.temperature: the log-probs are the sampling distribution's
    temperature: float
    # the entropies keep their graph (an entropy bonus)
    entropy_grad: bool

    def local(self, train_batch: TrainBatch) -> TrainBatch:
        """This rank's rows of `train_batch` (every row on one rank). A rank without rows still
        runs the forward and backward its peers' collectives wait on: on the first row,
        discarded."""
        if self.ranks.world == 1:
            return train_batch
        rows = torch.arange(len(train_batch.rewards))[self.ranks.mine(len(train_batch.rewards))]
        if not len(rows):
            rows = torch.arange(1)
        return rows_of(train_batch, rows)

    def logprobs(
        self,
        train_batch: TrainBatch,
        replay: bool | None = None,
        routing: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`logprobs_entropy`'s log-probs alone."""
        return self.logprobs_entropy(train_batch, replay, routing, entropy=False).logprob

    def logprobs_entropy(
        self,
        train_batch: TrainBatch,
        replay: bool | None = None,
        routing: dict[str, torch.Tensor] | None = None,
        entropy: bool = True,
    ) -> TokenLogprobs:
        """The policy's log-probs of the batch's own ids [rows, tokens], and with `entropy` the
        entropy of each distribution they are taken from (None where the forward computes none:
        `forward`); for a MoE policy with recorded routes, under routing replay when `replay`
        (None: `algo.routing_replay`) and with the route mismatches put in `routing`."""
        rows = len(train_batch.rewards)
        if replay is None:
            replay = self.replay
        logprob, entropies, stats = self.forward(
            self.model, self.local(train_batch), entropy, replay=replay
        )
        if routing is not None:
            for key, value in stats.items():
                routing[key] = self.ranks.gather(value[: self.ranks.count(rows)], rows)
        if entropies is not None:
            entropies = self.ranks.spliced(entropies, rows)
        return TokenLogprobs(self.ranks.spliced(logprob, rows), entropies)

    @torch.no_grad()
    def frozen_logprobs(self, model: torch.nn.Module, train_batch: TrainBatch) -> torch.Tensor:
        """Log-probs [rows, tokens] of the batch's ids under a frozen model (reference or
        teacher); no routing replay."""
        base = self.model.disable_adapter() if model is self.model else contextlib.nullcontext()
        with base:
            logprob, _, _ = self.forward(model, self.local(train_batch), frozen=True)
        rows = len(train_batch.rewards)
        return self.ranks.gather(logprob[: self.ranks.count(rows)], rows)

    def forward(
        self,
        model: torch.nn.Module,
        train_batch: TrainBatch,
        entropy: bool = False,
        replay: bool = False,
        frozen: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """Log-probs [rows, tokens] of the batch's own ids, with `entropy` their distributions'
        entropies [rows, tokens] (else None), and the policy's route statistics where it has
        recorded routes (`replay_routes`; replayed when `replay`). A `frozen` model (reference,
        teacher) has no routes recorded or replayed. With `trainer.max_tokens_per_microbatch`, in
        micro-batches: of whole groups where they share their prompt (`grouped`), else packed
        (models/packing.py)."""
        recorded = train_batch.routed_experts if self.moe and not frozen else None
        if not self.trainer.max_tokens_per_microbatch or self.codec is not None:
            return self.padded(model, train_batch, recorded, replay, entropy)
        if recorded is None and self.shared(train_batch) is not None:
            return self.grouped(model, train_batch, entropy)
        mask = train_batch.attention_mask
        ids = train_batch.token_ids.to(self.ranks.device)
        device_mask = mask.to(self.ranks.device)
        logprob = torch.zeros(mask.shape)
        entropies = torch.zeros(mask.shape) if entropy else None
        stats = {}
        for rows in self.microbatches(train_batch):
            # an empty micro-batch (FSDP's collectives wait on every rank) runs a row, unused
            run = rows if len(rows) else torch.arange(1)
            routes = contextlib.nullcontext({})
            if recorded is not None:
                routes = replay_routes(model, pack_like(recorded[run], mask[run]), replay)
            with routes as found:
                piece = packed_logprobs(
                    model,
                    ids,
                    device_mask,
                    self.temperature,
                    run.tolist(),
                    entropy,
                    self.entropy_grad,
                )
            if not len(rows):
                continue
            if entropy:
                entropies = entropies.index_copy(0, rows, piece[1].cpu())
                piece = piece[0]
            logprob = logprob.index_copy(0, rows, piece.cpu())
            for key, value in found.items():
                # padding: no expert (-1) for the live routes, false for the masks
                fill = -1 if key == "live" else 0
                if key not in stats:
                    stats[key] = torch.full(
                        (*mask.shape, *value.shape[2:]), fill, dtype=value.dtype
                    )
                stats[key][rows] = unpack(value, mask[rows], fill)
        return logprob, entropies, stats

    def padded(
        self,
        model: torch.nn.Module,
        train_batch: TrainBatch,
        recorded: torch.Tensor | None,
        replay: bool,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """`forward` in one padded batch (`recorded`: the routes [rows, tokens, layers, k] to
        replay or compare with, None for none); a group's common prompt runs once when no routes
        are replayed and the policy reads text only (models/prefix.py: the same values, less
        compute)."""
        ids = train_batch.token_ids.to(self.ranks.device)
        mask = train_batch.attention_mask.to(self.ranks.device)
        routes = contextlib.nullcontext({})
        if recorded is not None:
            routes = replay_routes(model, recorded, replay)
        with routes as stats:
            split = self.shared(train_batch) if recorded is None else None
            if split is not None:
                logprob = shared_prefix_logprobs(
                    model, ids, mask, split, self.temperature, None, entropy, self.entropy_grad
                )
                if not entropy:
                    return logprob.cpu(), None, stats
                return logprob[0].cpu(), logprob[1].cpu(), stats
            inputs = forward_inputs(model, ids, mask, train_batch.images, self.codec)
            logprob, entropies = forward_logprobs_entropy(
                model, inputs, ids, self.temperature, entropy, self.entropy_grad
            )
        if entropies is not None:
            entropies = entropies.cpu()
        return logprob.cpu(), entropies, stats

    def grouped(
        self, model: torch.nn.Module, train_batch: TrainBatch, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """`forward` in micro-batches of whole groups (`microbatches`), each group's common prompt
        run once (`padded`)."""
        logprob = torch.zeros(train_batch.attention_mask.shape)
        entropies = torch.zeros(logprob.shape) if entropy else None
        for rows in self.microbatches(train_batch):
            # an empty micro-batch (FSDP's collectives wait on every rank) runs a row, unused
            run = rows if len(rows) else torch.arange(1)
            piece, spread, _ = self.padded(model, rows_of(train_batch, run), None, False, entropy)
            if not len(rows):
                continue
            logprob = logprob.index_copy(0, rows, piece)
            if entropies is not None:
                entropies = entropies.index_copy(0, rows, spread)
        return logprob, entropies, {}

    def shared(self, train_batch: TrainBatch, count: int | None = None) -> Plan | None:
        """The common prompts of the batch's groups (its first `count` rows) where the forwards
        run each once (models/prefix.py): a text-only policy on the CPU, with
        `trainer.shared_prefix`, in forwards that neither record nor replay routes; else None."""
        # models/prefix.py plans on the CPU: on a GPU every row runs its own prompt
        if (
            self.codec is not None
            or not self.trainer.shared_prefix
            or self.ranks.device.type != "cpu"
        ):
            return None
        lengths = train_batch.attention_mask[:count].sum(-1)
        return plan(train_batch.token_ids[:count], lengths, train_batch.group_ids[:count])

    def microbatches(self, train_batch: TrainBatch, count: int | None = None) -> list[torch.Tensor]:
        """The batch's rows (its first `count`) in micro-batches of at most
        `trainer.max_tokens_per_microbatch` tokens, as many on every rank: a rank with fewer adds
        empty ones. Where groups share their prompt (`shared`), whole groups, a group's tokens
        counted as its prompt once and each row's own."""
        lengths = train_batch.attention_mask.sum(-1)[:count]
        budget = self.trainer.max_tokens_per_microbatch
        # a MoE policy's micro-batches replay or record their routes, packed
        split = None if self.moe else self.shared(train_batch, count)
        if split is None:
            groups = [torch.tensor(rows) for rows in microbatches(lengths.tolist(), budget)]
        else:
            group_of = torch.from_numpy(split.group_of)
            prefix = torch.from_numpy(split.prefix_len)
            tokens = prefix.index_add(0, group_of, lengths - prefix[group_of])
            chosen = microbatches(tokens.tolist(), budget)
            groups = [torch.isin(group_of, torch.tensor(ids)).nonzero()[:, 0] for ids in chosen]
        empty = torch.zeros(0, dtype=torch.long)
        return groups + [empty] * (self.ranks.most(len(groups)) - len(groups))
