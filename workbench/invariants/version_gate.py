"""Invariant: every trainable token keeps the log-prob and version that sampled it; asynchronous
use is gated per sequence, then corrected per token.

`version_gate` is a pure function of the batch's behavior log-probs and versions, the learner's
recomputed log-probs of the same ids (π_old) and the learner version. Per sampled token
δ = log π_old − log π_behavior. A sequence whose oldest sampled token is more than
`max_staleness` versions behind the learner is dropped (`stale`). Then, by `level`:

- `off`: every token weight 1;
- `token`: weight e^δ per token; `mask` zeroes tokens outside the band, `clip` clamps into it,
  `trunc` clamps the upper side only;
- `seq` (e^Σδ) or `geo` (e^mean δ): a rejection filter — outside the band the sequence is dropped
  (`ratio_low` / `ratio_high`); kept sequences carry per-token weights e^δ, truncated at
  `token_cap` and zeroed outside `token_band` (a token mask), so corrections compose.

With `anchor="behavior"` the loss takes its PPO ratio against the behavior log-probs, so the
correction e^δ lives in that ratio and every weight above is 1 where the token is kept: the clip
then bounds each token's move from the policy that sampled it, a trust region that acts even with
one optimizer step per batch (bench/README.md "Asynchronous at equal reward").

At every level a `veto` drops a sequence holding any sampled token whose unclamped ratio lies
outside [1/veto, veto] (`veto`): one catastrophic token outweighs what a mean or product shows.
Precedence of reasons: stale, veto, ratio. With `bypass` the learner passes the behavior log-probs
as π_old (δ = 0 everywhere), true only on-policy: a batch holding a stale sequence is refused.

`denominator` says whether rejected tokens stay in the token-mean denominator: `all` (default)
keeps the loss scale of a batch independent of how much the gate rejected, so a batch that is
mostly rejected moves the policy less instead of amplifying its few survivors; `kept` averages
over the surviving tokens only.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

LEVELS = ("off", "token", "seq", "geo")
MODES = ("mask", "clip", "trunc")
DENOMINATORS = ("all", "kept")
ANCHORS = ("old", "behavior")
# log-ratios are clamped here before exponentiation: e^20 is finite in float32
MAX_LOG_RATIO = 20.0


@dataclass
class GateResult:
    # [B, T] weight of each token in the loss (0 outside the mask or where rejected)
    token_weight: Tensor
    # [B, T] bool: tokens counted in the loss denominator
    loss_mask: Tensor
    # [B] bool: sequence kept
    kept: Tensor
    # [B] ok | stale | ratio_low | ratio_high | veto
    reason: list[str]
    # [B] learner version − oldest sampled token's version (0 when none sampled)
    staleness: Tensor
    # [B] Σδ over sampled tokens
    seq_log_ratio: Tensor
    # [B] e^(mean δ)
    geo_ratio: Tensor
    # [B] sampled tokens given weight 0 by the gate
    tokens_masked: Tensor


def version_gate(
    behavior_logprob: Tensor,
    train_logprob: Tensor,
    loss_mask: Tensor,
    behavior_version: Tensor,
    learner_version: int,
    level: str = "off",
    mode: str = "trunc",
    band: tuple[float, float] = (0.5, 2.0),
    max_staleness: int | None = None,
    token_cap: float | None = None,
    denominator: str = "all",
    token_band: tuple[float, float] | None = None,
    veto: float | None = None,
    bypass: bool = False,
    anchor: str | None = "old",
) -> GateResult:
    """Per-sequence decisions and per-token weights for one batch (all inputs [B, T])."""
    if level not in LEVELS or mode not in MODES or denominator not in DENOMINATORS:
        raise ValueError(f"gate level/mode/denominator must be in {LEVELS}/{MODES}/{DENOMINATORS}.")
    low, high = band
    mask = loss_mask.bool()
    sampled = mask.sum(-1)  # [B]
    log_ratio = torch.where(mask, train_logprob - behavior_logprob, 0.0)  # [B, T]
    delta = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    seq_log_ratio = delta.sum(-1)  # [B]
    geo_log_ratio = seq_log_ratio / sampled.clamp(min=1)
    oldest = torch.where(mask, behavior_version, torch.iinfo(behavior_version.dtype).max).amin(-1)
    staleness = torch.where(sampled > 0, learner_version - oldest, 0)  # [B]
    stale = int((staleness > 0).sum())
    if bypass and stale:
        raise ValueError(
            f"gate.bypass takes the behavior log-probs as π_old, but {stale} sequence(s) were "
            f"sampled by older weights: set gate.bypass=false."
        )

    ratio = delta.exp()  # [B, T]
    keep_token = mask.clone()
    # 0 ok, 1 stale, 2 ratio_low, 3 ratio_high, 4 veto
    reason = torch.zeros_like(sampled)
    # each level's weights; tokens outside `keep_token` (within the mask) get 0 below
    weight = ratio
    if level == "off":
        weight = mask.float()
    elif level == "token":
        if mode == "mask":
            keep_token &= (ratio >= low) & (ratio <= high)
        elif mode == "clip":
            weight = ratio.clamp(min=low, max=high)
        else:
            weight = ratio.clamp(max=high)
    else:
        sequence_log_ratio = seq_log_ratio if level == "seq" else geo_log_ratio
        sequence_ratio = sequence_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
        reason = torch.where(sequence_ratio < low, 2, torch.where(sequence_ratio > high, 3, 0))
        if token_band is not None:
            keep_token &= (ratio >= token_band[0]) & (ratio <= token_band[1])
        if token_cap is not None:
            weight = ratio.clamp(max=token_cap)
    if veto is not None:
        outlier = mask & (log_ratio.abs() > math.log(veto))  # [B, T]
        reason = torch.where(outlier.any(-1), 4, reason)
    if max_staleness is not None:
        reason = torch.where(staleness > max_staleness, 1, reason)
    kept = reason == 0
    keep_token &= kept[:, None]
    if anchor == "behavior":
        # the loss's ratio to the behavior log-probs carries the correction
        weight = mask.float()
    weight = weight * keep_token
    names = ("ok", "stale", "ratio_low", "ratio_high", "veto")
    return GateResult(
        token_weight=weight,
        loss_mask=mask if denominator == "all" else keep_token,
        kept=kept,
        reason=[names[r] for r in reason.tolist()],
        staleness=staleness,
        seq_log_ratio=seq_log_ratio,
        geo_ratio=geo_log_ratio.exp(),
        tokens_masked=(mask & ~keep_token).sum(-1),
    )


def gate_metrics(gate: GateResult, loss_mask: Tensor) -> dict[str, float]:
    """Per-step aggregates: kept and stale fractions, the fraction of sampled tokens filtered,
    staleness."""
    sampled = loss_mask.bool().sum().clamp(min=1)
    return {
        "gate/kept_frac": float(gate.kept.float().mean()),
        "gate/stale_frac": sum(r == "stale" for r in gate.reason) / max(len(gate.reason), 1),
        "gate/is_filter_ratio": float(gate.tokens_masked.sum() / sampled),
        "gate/weight_mean": float(gate.token_weight.sum() / sampled),
        "async/mean_staleness": float(gate.staleness.float().mean()),
    }
