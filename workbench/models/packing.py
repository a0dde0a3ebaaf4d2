"""Packed micro-batches: a batch's rows grouped under a token budget, each group run as one row of
its real tokens, no padding.

Invariant: a packed forward computes what the padded one does — every sequence restarts its
positions at 0 and attends only to its own earlier tokens — so the log-probs agree to float rounding
and the gradient is the same sum.

`packed_logprobs` feeds transformers' own packed format (the one `DataCollatorWithFlattening`
makes): one row [1, tokens], position_ids restarting per sequence, no attention_mask and no cache.
`masking_utils.create_causal_mask` reads the sequence boundaries off the positions (a position
that is not the previous one plus one starts a sequence) and, for sdpa, eager and flex attention,
builds the block-diagonal causal mask itself; flash-attention kernels take the same boundaries as
`cu_seqlens` (the variable-length kernel, no mask at all). Text-only policies: a vision-language
one's M-RoPE positions are not packed here.

`pack_like` and `unpack` move any per-token tensor between the padded [batch, seq, ...] and the
packed [1, tokens, ...] layouts: the MoE routers see a packed row's tokens in the same order, so
recorded routes replay on it as `replay_routes(model, pack_like(routes, mask))`.
"""

from collections.abc import Sequence

import torch

from workbench.models.heads import forward_logprobs_entropy


def microbatches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Row indices grouped so that each group's tokens stay within `max_tokens` (a row longer than
    the budget goes alone); `max_tokens=0` is one group of every row.

    First-fit decreasing: longest row first, each into the first group with room. It makes few
    groups, and order does not matter to the learner: the loss of every group is normalised over
    the whole batch. Groups are in the order they were opened, rows ascending within a group.
    """
    # a negative budget: config.validate refuses trainer.max_tokens_per_microbatch < 0
    if max_tokens == 0:
        return [list(range(len(lengths)))]
    groups = []
    # [groups] tokens each group can still take (negative for a row over the budget)
    room = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        # the first group with room, else a new one
        group = next((g for g, free in enumerate(room) if free >= lengths[row]), len(groups))
        if group == len(groups):
            groups.append([])
            room.append(max_tokens)
        groups[group].append(row)
        room[group] -= lengths[row]
    return [sorted(group) for group in groups]


def pack_like(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch, seq, ...] -> [1, tokens, ...]: the values at `mask`'s real tokens, row after row."""
    return values[mask.bool()][None]


def unpack(packed: torch.Tensor, mask: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """[1, tokens, ...] -> [batch, seq, ...]: `pack_like` undone, `fill` at padding (with
    gradient)."""
    padded = packed.new_full((*mask.shape, *packed.shape[2:]), fill)
    return padded.index_put((mask.bool(),), packed[0])


def packed_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    rows: Sequence[int] | torch.Tensor | None = None,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [len(rows), seq] of `rows`' own ids (all rows by default) in one packed forward:
    the values and layout of `token_logprobs` on a padded forward (position 0 holds 0, padding any
    value). With `entropy`, (log-probs, entropies) as `token_logprobs_entropy` gives them."""
    if rows is not None:
        ids = ids[rows]
        mask = mask[rows]
    # [1, tokens] each token's place in its own sequence
    positions = pack_like(mask.cumsum(-1) - 1, mask)
    packed_ids = pack_like(ids, mask)
    # no attention_mask and no cache: either one turns transformers' boundary detection off
    inputs = dict(input_ids=packed_ids, position_ids=positions, use_cache=False)
    # [1, tokens]; a sequence's first token would read the previous sequence's last logits
    logprob, entropies = forward_logprobs_entropy(
        model, inputs, packed_ids, temperature, entropy, entropy_grad
    )
    logprob = unpack(logprob.where(positions > 0, 0.0), mask)
    if not entropy:
        return logprob
    return logprob, unpack(entropies.where(positions > 0, 0.0), mask)
