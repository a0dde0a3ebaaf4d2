"""The colour channels of the token view: what value of a sampled token each one shows, and how.

A channel is (value of a sampled token, [(upper bound, colour, legend)]); a token takes the first
bin its value is below. Add a channel here: the token view cycles through CHANNELS in this order.
"""

import math

# the off-policy gap's parts, in the order of models/gap.py's PARTS (not imported: torch)
GAP_PARTS = ("staleness", "routing", "sampler", "numerics")


def dominant_gap(token: dict) -> int | None:
    """The index in GAP_PARTS of the part with the largest magnitude of the token's off-policy
    gap (models/gap.py); None where the gap was not measured."""
    parts = [token.get(f"gap_{name}") for name in GAP_PARTS]
    if None in parts:
        return None
    return max(range(len(parts)), key=lambda i: abs(parts[i]))


CHANNELS = {
    "behavior logprob": (
        lambda t: t["behavior_logprob"],
        [
            (-2.3, "red", "p<.1"),
            (-0.69, "dark_orange", "p<.5"),
            (-0.105, "yellow", "p<.9"),
            (math.inf, "green", "p≥.9"),
        ],
    ),
    "δ train−behavior": (
        lambda t: abs(t["train_logprob"] - t["behavior_logprob"]),
        [
            (0.01, "green", "|δ|<.01"),
            (0.1, "yellow", "<.1"),
            (0.5, "dark_orange", "<.5"),
            (math.inf, "red", "≥.5"),
        ],
    ),
    "IS weight": (
        lambda t: abs(t["is_weight"] - 1),
        [
            (0.01, "green", "≈1"),
            (0.1, "yellow", "±.1"),
            (0.5, "dark_orange", "±.5"),
            (math.inf, "red", "far/0"),
        ],
    ),
    "version": (
        lambda t: t["staleness"],
        [(0.5, "green", "on-policy"), (1.5, "yellow", "1 behind"), (math.inf, "red", "≥2 behind")],
    ),
    "routing": (
        lambda t: len(t["mismatched_layers"]),
        [(0.5, "green", "same experts"), (math.inf, "red", "mismatch")],
    ),
    # the learner's entropy of the distribution the token was drawn from, in nats
    "entropy": (
        lambda t: t["entropy"],
        [
            (0.1, "green", "H<.1"),
            (0.5, "yellow", "<.5"),
            (1.5, "dark_orange", "<1.5"),
            (math.inf, "red", "≥1.5 nats"),
        ],
    ),
    # the largest part of the token's off-policy gap: the cause of most of its δ
    "gap cause": (
        dominant_gap,
        [
            (0.5, "yellow", "staleness"),
            (1.5, "magenta", "routing"),
            (2.5, "cyan", "sampler"),
            (math.inf, "green", "numerics"),
        ],
    ),
}


def colour(channel, token):
    value_of, bins = CHANNELS[channel]
    value = value_of(token)
    if value is None:
        # not stored: a run older than its column, or a token no learner scored
        return "grey50"
    return next(c for bound, c, _ in bins if value < bound)
