"""Policy-gradient losses: the PPO-clip surrogate over masked tokens, with explicit aggregation.

Only tokens where `loss_mask` is true contribute anything, values and gradients alike; positions
outside the mask may hold any value (even -inf) without leaking NaN into the loss.
"""

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean", "constant")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_logprobs(logits: Tensor, token_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob [B, T] of each token under the causal-LM logits [B, T, V] of the step before it.

    out[:, 0] = 0; out[:, t] = log_softmax(logits[:, t-1] / temperature)[token_ids[:, t]],
    computed as gathered logit - logsumexp so no full log-softmax copy is made.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}.")
    scaled = logits[:, :-1].float()  # [B, T-1, V]
    if temperature != 1.0:
        scaled = scaled / temperature
    next_ids = token_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = scaled.gather(-1, next_ids).squeeze(-1) - torch.logsumexp(scaled, dim=-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)  # [B, T]


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over positions where mask is true (along dim, or over all); 0 where none are."""
    mask = mask.bool()
    total = torch.where(mask, x, 0.0).sum() if dim is None else torch.where(mask, x, 0.0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


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
    loss_type: str = "ppo",
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (or CISPO) loss over masked tokens, and its metrics.

    Per token, with ratio = exp(logprob - old_logprob):
        ppo:   loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) * is_weight
        cispo: loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logprob * is_weight
               (the clipped ratio is a constant weight, so clipped tokens still get gradient)
    advantages A is [B] (one per sequence) or [B, T]; is_weight [B, T] is detached (default 1).
    aggregation: token_mean = sum / number of masked tokens; seq_mean = mean, over sequences
    with at least one masked token, of each sequence's token mean; constant = sum / constant_denominator.

    metrics (python floats, over masked tokens): clip_frac = fraction of tokens where the clipped
    term is strictly smaller than the unclipped one (so the min picks it and the gradient is 0;
    cispo: where the ratio lies outside the band);
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
    unclipped = ratio * advantages  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages  # [B, T]
    if loss_type == "cispo":
        weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()  # [B, T]
        per_token = -weight * advantages * torch.where(mask, logprob, 0.0)  # [B, T]
    else:
        per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    per_token = torch.where(mask, per_token, 0.0)  # [B, T]

    if aggregation == "token_mean":
        loss = per_token.sum() / mask.sum().clamp(min=1)
    elif aggregation == "seq_mean":
        seq_loss = per_token.sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        has_tokens = mask.any(-1)  # [B]
        loss = torch.where(has_tokens, seq_loss, 0.0).sum() / has_tokens.sum().clamp(min=1)
    else:
        loss = per_token.sum() / constant_denominator

    with torch.no_grad():
        any_token = bool(mask.any())
        metrics = {
            "clip_frac": masked_mean(
                (
                    (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
                    if loss_type == "cispo"
                    else clipped < unclipped
                ).float(),
                mask,
            ).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask].max().item() if any_token else 0.0,
            "approx_kl": approx_kl(old_logprob, logprob, mask, "k3").item(),
        }
    return loss, metrics


def sequence_ratio_logprob(logprob: Tensor, old_logprob: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO as a stand-in for `logprob`: feeding the result to `policy_gradient_loss` (seq_mean) is GSPO.

    Every token's ratio becomes the sequence ratio s = exp(mean over sampled tokens of
    logprob − old_logprob), while its gradient stays that of the token: s·∇log π. Clipping then
    acts on s, per sequence (GSPO uses a narrow band, e.g. clip_low 3e-4, clip_high 4e-4).
    """
    mask = loss_mask.bool()  # [B, T]
    log_seq_ratio = torch.where(mask, logprob - old_logprob, 0.0).sum(-1) / mask.sum(-1).clamp(
        min=1
    )  # [B]
    return old_logprob + log_seq_ratio.detach()[:, None] + (logprob - logprob.detach())  # [B, T]
