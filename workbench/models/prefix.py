"""Shared prefixes: the rows of a GRPO group open on the same prompt, so the prompt runs once.

The learner computes each group's longest common prefix once. Short replies are packed: one row
per group, the prefix once and then each of its rows' own tokens, under an attention mask by which
a row's tokens see the prefix and their own earlier tokens only (one forward, no padding between
replies). Long ones run in two forwards: the prefixes (their KV cache kept, with gradient), then
every row's own tokens on its group's cache. Either way attention, positions and maths are those of
a full forward of every row: the log-probs agree to float rounding, the gradient is the same sum.
The rollout engine prefills each distinct prompt once (`unique_rows`) and copies its cache to the
group. Dense text-only policies: MoE routing replay and images take the full path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workbench.models.heads import deferred, row_logprobs

if TYPE_CHECKING:
    from transformers import Cache
    from transformers.utils import ModelOutput


@dataclass
class Plan:
    # [groups] tokens each group's rows share
    prefix_len: np.ndarray
    # [batch] the group of each row
    group_of: np.ndarray


def plan(token_ids: torch.Tensor, lengths: torch.Tensor, group_ids: torch.Tensor) -> Plan | None:
    """Each group's longest common prefix (leaving every row at least one token of its own; a group
    of one row shares with itself); None when a group shares no token, or when sharing would save
    under a quarter of the batch's tokens."""
    ids = token_ids.numpy()
    lengths = lengths.numpy()
    groups, group_of = np.unique(group_ids.numpy(), return_inverse=True)
    prefix_len = np.zeros(len(groups), dtype=np.int64)
    for g in range(len(groups)):
        rows = np.flatnonzero(group_of == g)
        limit = int(lengths[rows].min()) - 1
        same = (ids[rows, :limit] == ids[rows[0], :limit]).all(0)
        prefix_len[g] = limit if same.all() else int(np.argmin(same))
    saved = int(prefix_len[group_of].sum() - prefix_len.sum())
    if prefix_len.min() <= 0 or saved < 0.25 * lengths.sum():
        return None
    return Plan(prefix_len, group_of)


def shared_prefix_logprobs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    plan: Plan,
    temperature: float = 1.0,
    packed: bool | None = None,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [batch, seq] of right-padded rows' own ids, as `token_logprobs` of a full forward
    gives them (padding positions hold any value), with each group's prefix computed once: `packed`
    in one forward, else in two (prefixes, then rows on their KV cache). By default packed while a
    group's packed row is at most twice the hidden size: the dense attention over a longer one costs
    more than the second forward saves (bench/shared_prefix.py). With `entropy`, (log-probs,
    entropies) as `token_logprobs_entropy` of a full forward gives them."""
    lengths = attention_mask.sum(-1)
    prefix_len = torch.from_numpy(plan.prefix_len)
    group_of = torch.from_numpy(plan.group_of)
    # [batch] where each row's own tokens start
    own = prefix_len[group_of]
    # [batch, groups] each row's own token count, in its group's column
    member = torch.nn.functional.one_hot(group_of, len(prefix_len)) * (lengths - own)[:, None]
    width = int((prefix_len + member.sum(0)).max())  # the longest packed row
    # (a 4D mask is an additive bias for sdpa and eager attention; flash kernels take none)
    if packed is None:
        packed = (
            width <= 2 * model.config.get_text_config().hidden_size
            and model.config._attn_implementation in ("sdpa", "eager")
        )
    options = (temperature, entropy, entropy_grad)
    if not packed:
        return _cached(model, token_ids, lengths, prefix_len, group_of, own, *options)
    return _packed(model, token_ids, lengths, group_of, own, member, width, *options)


def _packed(
    model: torch.nn.Module,
    token_ids: torch.Tensor,  # [batch, seq]
    lengths: torch.Tensor,  # [batch]
    group_of: torch.Tensor,  # [batch]
    own: torch.Tensor,  # [batch]
    member: torch.Tensor,  # [batch, groups]
    width: int,
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One row per group: its prefix once, then each of its rows' own tokens, under a mask by which
    a row's tokens see the prefix and their own earlier tokens only, at their own positions."""
    groups = member.shape[1]
    # [batch] own tokens' packed column
    start = own + (member.cumsum(0) - member).gather(1, group_of[:, None])[:, 0]
    t = torch.arange(token_ids.shape[1])[None]  # [1, seq]
    column = torch.where(t < own[:, None], t, start[:, None] + t - own[:, None])
    # the slot every padding position writes to (dropped)
    spare = groups * width
    # [batch, seq] packed slot
    slot = torch.where(t < lengths[:, None], group_of[:, None] * width + column, spare)

    def pack(values: torch.Tensor, fill: int) -> torch.Tensor:
        """[groups, width]: `values` at their packed slots; a group's rows agree on its prefix."""
        return (
            torch.full((spare + 1,), fill)
            .index_put_((slot.flatten(),), values.flatten())[:spare]
            .view(-1, width)
        )

    ids = pack(token_ids, 0)
    positions = pack(t.expand_as(token_ids), 0)
    # the row each slot belongs to: prefix -1, padding -2
    owner = pack(torch.where(t < own[:, None], -1, torch.arange(len(token_ids))[:, None]), -2)
    sees = ((owner[:, None, :] == owner[:, :, None]) | (owner[:, None, :] == -1)) & (
        positions[:, None, :] <= positions[:, :, None]
    )
    dtype = next(model.parameters()).dtype
    # [groups, 1, q, k]
    bias = torch.zeros(sees.shape, dtype=dtype).masked_fill(~sees, torch.finfo(dtype).min)[:, None]
    with deferred(model) as hidden:
        model(input_ids=ids, attention_mask=bias, position_ids=positions, use_cache=False)
    # [batch, seq - 1] the slot whose logits predict each next id
    source = slot[:, :-1].clamp(max=spare - 1)
    options = (temperature, entropy, entropy_grad)
    logprob, entropies = row_logprobs(model, hidden[0].flatten(0, 1), source, token_ids, *options)
    return (logprob, entropies) if entropy else logprob


def _cached(
    model: torch.nn.Module,
    token_ids: torch.Tensor,  # [batch, seq]
    lengths: torch.Tensor,  # [batch]
    prefix_len: torch.Tensor,  # [groups]
    group_of: torch.Tensor,  # [batch]
    own: torch.Tensor,  # [batch]
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The prefixes in one forward (KV cache kept, with gradient), every row's own tokens in a
    second on it."""
    first_rows = torch.from_numpy(np.unique(group_of.numpy(), return_index=True)[1])
    longest = int(prefix_len.max())
    # [groups, prefix], right-padded
    prefix_mask = (torch.arange(longest)[None] < prefix_len[:, None]).long()
    prefix_ids = token_ids[first_rows, :longest] * prefix_mask
    with deferred(model) as hidden:
        out = model(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            position_ids=torch.arange(longest)[None].expand_as(prefix_ids),
            use_cache=True,
        )
        cache = output_cache(out)
        # each row reads its group's prefix keys and values
        cache.batch_select_indices(group_of)
        steps = torch.arange(int((lengths - own).max()))[None]  # [1, suffix]
        suffix_mask = (steps < (lengths - own)[:, None]).long()  # [batch, suffix]
        suffix_ids = (
            token_ids.gather(1, (own[:, None] + steps).clamp(max=token_ids.shape[1] - 1))
            * suffix_mask
        )
        model(
            input_ids=suffix_ids,
            attention_mask=torch.cat([prefix_mask[group_of], suffix_mask], dim=1),
            position_ids=own[:, None] + steps,
            use_cache=True,
            **cache_input(model, cache),
        )
    # slots: the prefixes' positions [groups * prefix], then the rows' own [batch * suffix]; a
    # row's token t is predicted by its group's position t - 1 up to its first own token (the last
    # prefix position predicts it), then by its own position t - own - 1
    t = torch.arange(1, token_ids.shape[1])[None]  # [1, seq - 1]
    width = suffix_ids.shape[1]
    in_prefix = group_of[:, None] * longest + t - 1
    in_suffix = (
        prefix_ids.numel()
        + torch.arange(len(token_ids))[:, None] * width
        + (t - own[:, None] - 1).clamp(max=width - 1)
    )
    source = torch.where(t <= own[:, None], in_prefix, in_suffix)  # [batch, seq - 1]
    slots = torch.cat([hidden[0].flatten(0, 1), hidden[1].flatten(0, 1)])
    options = (temperature, entropy, entropy_grad)
    logprob, entropies = row_logprobs(model, slots, source, token_ids, *options)
    return (logprob, entropies) if entropy else logprob


def output_cache(out: ModelOutput) -> Cache:
    """The KV cache a forward returned (`cache`; `past_key_values` before transformers 5.20)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def cache_input(model: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """The keyword a forward takes its KV cache by (`cache`; `past_key_values` before transformers
    5.20)."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": cache}
    return {"past_key_values": cache}


def unique_rows(prompts: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """The distinct prompts, and for each prompt the index of its copy among them."""
    # prompt bytes -> index among the distinct prompts
    seen = {}
    index = np.array([seen.setdefault(p.astype(np.int64).tobytes(), len(seen)) for p in prompts])
    return [prompts[i] for i in np.unique(index, return_index=True)[1]], index
