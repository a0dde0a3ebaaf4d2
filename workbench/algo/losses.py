"""Policy-gradient losses: the PPO-clip surrogate over masked tokens, with explicit aggregation.

Only tokens where `loss_mask` is true contribute anything, values and gradients alike; positions
outside the mask may hold any value (even -inf) without leaking NaN into the loss.

`POLICY_LOSSES` maps each `algo.policy_loss` name to its loss, registered with `@policy_loss`:
a new loss is one function at the end of this module and its test in tests/algo/test_losses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing import Any

AGGREGATIONS = ("token_mean", "seq_mean", "constant")
KL_ESTIMATORS = ("k1", "k2", "k3")
PolicyLoss = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""algo.policy_loss -> loss(logprob, old_logprob, advantages, loss_mask, sampled_mask, **options):
(loss, metrics). `sampled_mask` holds every token the rollout sampled, before the gate; `options`
are those of `policy_gradient_loss` after `loss_mask`."""


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob [B, T] of each token under the causal-LM logits [B, T, V] of the step before it.

    out[:, 0] = 0; out[:, t] = log_softmax(logits[:, t-1] / temperature)[token_ids[:, t]],
    computed as gathered logit - logsumexp so no full log-softmax copy is made.
    """
    return token_logprobs_entropy(logits, token_ids, temperature, entropy=False)[0]


def token_logprobs_entropy(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs`, and the entropy [B, T] of each distribution those are taken from (same
    layout: out[:, 0] = 0; `logits_entropy` of the same scaled logits). None unless `entropy`;
    without a graph unless `entropy_grad`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    scaled = logits[:, :-1].float()  # [B, T-1, V]
    if temperature != 1.0:
        scaled = scaled / temperature
    next_ids = token_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    normaliser = torch.logsumexp(scaled, dim=-1)  # [B, T-1]
    picked = scaled.gather(-1, next_ids).squeeze(-1) - normaliser  # [B, T-1]
    first = torch.zeros_like(picked[:, :1])
    logprob = torch.cat([first, picked], dim=1)  # [B, T]
    if not entropy:
        return logprob, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        per_position = torch.cat([first, logits_entropy(scaled, normaliser)], dim=1)  # [B, T]
    return logprob, per_position


def logits_entropy(scaled: Tensor, normaliser: Tensor) -> Tensor:
    """Entropy [...] of softmax(scaled) over the last dimension, given its logsumexp `normaliser`
    [...]: logsumexp(s) − Σ softmax(s)·s, with softmax(s) the one more full-vocabulary tensor.

    An id whose logit is −inf (one the model bans, such as a vision marker) has probability 0 and
    adds 0 (0·log 0 = 0), not 0·(−inf) = NaN."""
    probs = (scaled - normaliser.unsqueeze(-1)).exp()  # [..., V]
    # a batched dot product: no third full-vocabulary tensor for probs * scaled
    dot = torch.einsum("...v,...v->...", probs, scaled)
    if dot.isnan().any():
        # only where some logit is -inf: that term is set to 0, its gradient with it
        dot = torch.einsum("...v,...v->...", probs, scaled.masked_fill(scaled.isneginf(), 0.0))
    return normaliser - dot


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is true (along dim, or over all); 0 where none are."""
    mask = mask.bool()
    # dim None: sums over all
    return torch.where(mask, x, 0.0).sum(dim) / mask.sum(dim).clamp(min=1)


def approx_kl(logp: Tensor, logq: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Schulman's estimate of KL(p || q) from samples of p, masked mean over tokens (scalar).

    With log r = logq - logp:  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(
            f"Unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}."
        )
    log_r = torch.where(mask.bool(), logq - logp, 0.0)  # [B, T]
    if estimator == "k1":
        per_token = -log_r
    elif estimator == "k2":
        per_token = log_r**2 / 2
    else:
        per_token = torch.expm1(log_r) - log_r
    return masked_mean(per_token, mask)


def ppo_surrogate(
    logprob: Tensor, ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO-clip per token [B, T]: -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A);
    and where the clipped term is strictly smaller (the min picks it, so the gradient is 0)."""
    unclipped = ratio * advantages  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages  # [B, T]
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def cispo_surrogate(
    logprob: Tensor, ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO per token [B, T]: -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logprob (the
    clipped ratio is a constant weight, so clipped tokens still get gradient); and where the ratio
    lies outside the band."""
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()  # [B, T]
    outside = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)  # [B, T]
    return -weight * advantages * logprob, outside


def policy_gradient_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token_mean",
    constant_denominator: float | None = None,
    is_weight: Tensor | None = None,
    surrogate: Callable[..., tuple[Tensor, Tensor]] = ppo_surrogate,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """A clipped policy-gradient loss over masked tokens (PPO-clip by default), and its metrics.

    Per token, with ratio = exp(logprob - old_logprob): loss = surrogate * is_weight, where
    `surrogate` is `ppo_surrogate` or `cispo_surrogate` (masked-out log-probs reach it as 0).
    advantages A is [B] (one per sequence) or [B, T]; is_weight [B, T] is detached (default 1).
    aggregation: token_mean = sum / number of masked tokens; seq_mean = mean, over sequences
    with at least one masked token, of each sequence's token mean; constant = sum /
    constant_denominator. With `entropy_coef`, minus entropy_coef times the token mean of `entropy`
    [B, T] over the mask (an entropy bonus; its gradient raises the entropy).

    metrics (python floats, over masked tokens): clip_frac = fraction of tokens the surrogate
    reports clipped (ppo: the clipped term is strictly smaller than the unclipped one, so the min
    picks it and the gradient is 0; cispo: the ratio lies outside the band);
    ratio_mean, ratio_max; approx_kl = k3 estimate of KL(old || new). An empty mask gives loss 0
    (still attached to the graph) and all metrics 0.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(
            f"Unknown loss aggregation {aggregation!r}; choose one of {', '.join(AGGREGATIONS)}."
        )
    if aggregation == "constant" and (constant_denominator is None or constant_denominator <= 0):
        raise ValueError("aggregation='constant' needs a positive constant_denominator; pass one.")
    mask = loss_mask.bool()  # [B, T]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1], broadcast over tokens
    log_ratio = torch.where(mask, logprob - old_logprob, 0.0)  # [B, T]; masked-out -> ratio 1
    ratio = torch.exp(log_ratio)  # [B, T]
    masked_logprob = torch.where(mask, logprob, 0.0)  # [B, T]
    per_token, clipped = surrogate(masked_logprob, ratio, advantages, clip_low, clip_high)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    per_token = torch.where(mask, per_token, 0.0)  # [B, T]

    if aggregation == "token_mean":
        loss = masked_mean(per_token, mask)
    elif aggregation == "seq_mean":
        seq_loss = masked_mean(per_token, mask, dim=-1)  # [B]
        # over the sequences with at least one token in the mask
        loss = masked_mean(seq_loss, mask.any(-1))
    else:
        loss = per_token.sum() / constant_denominator
    if entropy_coef:
        loss = loss - entropy_coef * masked_mean(entropy, mask)

    with torch.no_grad():
        any_token = bool(mask.any())
        metrics = {
            "clip_frac": masked_mean(clipped.float(), mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask].max().item() if any_token else 0.0,
            "approx_kl": approx_kl(old_logprob, logprob, mask, "k3").item(),
        }
    return loss, metrics


def sequence_ratio_logprob(logprob: Tensor, old_logprob: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO as a stand-in for `logprob`: fed to `policy_gradient_loss` (seq_mean), it is GSPO.

    Every token's ratio becomes the sequence ratio s = exp(mean over sampled tokens of
    logprob − old_logprob), while its gradient stays that of the token: s·∇log π. Clipping then
    acts on s, per sequence (GSPO uses a narrow band, e.g. clip_low 3e-4, clip_high 4e-4).
    """
    log_seq_ratio = masked_mean(logprob - old_logprob, loss_mask, dim=-1)  # [B]
    return old_logprob + log_seq_ratio.detach()[:, None] + (logprob - logprob.detach())  # [B, T]


# ---- the registry: `algo.policy_loss=NAME` selects POLICY_LOSSES[NAME]


def policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Register the decorated loss as `algo.policy_loss=name`."""

    def register(loss: PolicyLoss) -> PolicyLoss:
        POLICY_LOSSES[name] = loss
        return loss

    return register


@policy_loss("ppo")
def ppo_loss(
    logprob: Tensor,  # [B, T]
    old_logprob: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    loss_mask: Tensor,  # [B, T]
    sampled_mask: Tensor,  # [B, T]
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Token ratio, PPO-clip."""
    return policy_gradient_loss(logprob, old_logprob, advantages, loss_mask, **options)


@policy_loss("gspo")
def gspo_loss(
    logprob: Tensor,  # [B, T]
    old_logprob: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    loss_mask: Tensor,  # [B, T]
    sampled_mask: Tensor,  # [B, T]
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Sequence ratio (geometric mean of the ratios of the sampled tokens), clipped per sequence."""
    stand_in = sequence_ratio_logprob(logprob, old_logprob, sampled_mask)
    return policy_gradient_loss(stand_in, old_logprob, advantages, loss_mask, **options)


@policy_loss("cispo")
def cispo_loss(
    logprob: Tensor,  # [B, T]
    old_logprob: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    loss_mask: Tensor,  # [B, T]
    sampled_mask: Tensor,  # [B, T]
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE on log π, weighted by the clipped token ratio held constant."""
    return policy_gradient_loss(
        logprob, old_logprob, advantages, loss_mask, surrogate=cispo_surrogate, **options
    )


@policy_loss("sft")
def sft_loss(
    logprob: Tensor,  # [B, T]
    old_logprob: Tensor | None,  # [B, T], unread
    advantages: Tensor | None,  # unread
    loss_mask: Tensor,  # [B, T]
    sampled_mask: Tensor,  # [B, T]
    **options: Any,
) -> tuple[Tensor, dict[str, float]]:
    """Supervised (`molt-wb sft`, the warm start): minus the token mean of log π over the batch's
    trainable tokens; no ratio, advantage, IS weight or entropy bonus."""
    return -masked_mean(logprob, loss_mask), {"tokens": float(loss_mask.sum())}
