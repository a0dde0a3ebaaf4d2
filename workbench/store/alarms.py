"""Run-health alarms: rules over a run's metrics, each with its threshold under `alarm.*`, checked
by the store actor as each step's metrics are written (never on the learner's path).

A rule fires at the step its condition starts to hold: one row of the `alarms` table (the step, the
rule, the metric, its value, the threshold, the evidence in one sentence) and one printed line; it
fires again only after its condition has cleared. Windowed rules compare the mean of a metric over
the run's last `alarm.window` steps with its mean over the run's first `alarm.window` steps (the
baseline). Three of the metrics they read are derived here from the step's episodes and stored
with the others: `health/turn_len_frac`, `health/tool_calls` and `health/correctness`. A run
resumed or restarted replays its stored metrics through the rules first, silently, so a rule
that fired before does not fire twice.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a step's points of one metric: (step, value), in step order
Points = list[tuple[int, float]]
# the alarms a run fired, in step order (the summary, the TUI)
FIRED = "select step, rule, evidence from alarms order by step, rule"
# the least tool calls per episode a rate is taken as (a rate of 0 has no ratio)
TOOL_CALL_FLOOR = 0.1


@dataclass(frozen=True)
class Firing:
    """One alarm: which rule, on which metric, its value against the threshold, and why."""

    rule: str
    metric: str
    value: float
    threshold: float
    evidence: str


def health_metrics(
    episodes: list[dict[str, Any]], max_tokens: int, correctness_key: str
) -> dict[str, float]:
    """The step's health metrics from its segments as {rollout_id, segment_idx, turn_spans,
    info}: the mean sampled turn's length over `max_tokens`, and per episode (its last segment's
    `info`) the mean of `info["tool_calls"]` and of `info[correctness_key]` where the plugin
    reports them."""
    metrics = {}
    turns = [end - start for episode in episodes for start, end in episode["turn_spans"]]
    if turns and max_tokens:
        metrics["health/turn_len_frac"] = sum(turns) / len(turns) / max_tokens
    last: dict[int, dict[str, Any]] = {}
    for episode in sorted(episodes, key=lambda e: e["segment_idx"]):
        last[episode["rollout_id"]] = episode["info"] or {}
    for metric, key in (
        ("health/tool_calls", "tool_calls"),
        ("health/correctness", correctness_key),
    ):
        values = [float(info[key]) for info in last.values() if _number(info.get(key))]
        if values:
            metrics[metric] = sum(values) / len(values)
    return metrics


def _number(value: Any) -> bool:
    """A number a plugin reported (a bool counts as 0 or 1)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


def mean(points: Points) -> float:
    return sum(value for _, value in points) / len(points)


def span(points: Points) -> str:
    """`steps A-B` of a window."""
    return f"steps {points[0][0]}-{points[-1][0]}"


# ---- the rules: each reads the metrics' points and returns a Firing while its condition holds


def kl_acceleration(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """loss/kl_ref (algo.kl_coef > 0): its rise over the last window is at least
    `alarm.kl_min_rise` and more than `alarm.kl_acceleration` times its rise over the window
    before."""
    points = series("loss/kl_ref")
    size = cfg.window
    if len(points) < 3 * size:
        return None
    windows = [points[-3 * size : -2 * size], points[-2 * size : -size], points[-size:]]
    before = mean(windows[1]) - mean(windows[0])
    rise = mean(windows[2]) - mean(windows[1])
    threshold = max(cfg.kl_acceleration * max(before, 0.0), cfg.kl_min_rise)
    if rise < threshold:
        return None
    return Firing(
        "kl_acceleration",
        "loss/kl_ref",
        rise,
        threshold,
        f"loss/kl_ref rose {rise:.3g} from {span(windows[1])} to {span(windows[2])}, after "
        f"{before:.3g} the window before: more than {cfg.kl_acceleration:g} times as fast",
    )


def entropy_collapse(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """policy/entropy: its mean over the last window is below `alarm.entropy_collapse` times
    the baseline's."""
    points = series("policy/entropy")
    if len(points) < 2 * cfg.window:
        return None
    baseline = points[: cfg.window]
    recent = points[-cfg.window :]
    threshold = cfg.entropy_collapse * mean(baseline)
    if mean(recent) >= threshold:
        return None
    return Firing(
        "entropy_collapse",
        "policy/entropy",
        mean(recent),
        threshold,
        f"policy/entropy {mean(recent):.3g} over {span(recent)}, below {cfg.entropy_collapse:g} "
        f"times its {mean(baseline):.3g} over {span(baseline)}",
    )


def length_drift(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """health/turn_len_frac: the mean sampled turn reaches `alarm.length_frac` of
    engine.max_tokens over the last window, having been below it over the baseline."""
    points = series("health/turn_len_frac")
    if len(points) < 2 * cfg.window:
        return None
    baseline = points[: cfg.window]
    recent = points[-cfg.window :]
    if mean(recent) < cfg.length_frac or mean(baseline) >= cfg.length_frac:
        return None
    return Firing(
        "length_drift",
        "health/turn_len_frac",
        mean(recent),
        cfg.length_frac,
        f"turns are {mean(recent):.0%} of engine.max_tokens over {span(recent)} (at least "
        f"{cfg.length_frac:.0%}), up from {mean(baseline):.0%} over {span(baseline)}",
    )


def tool_call_shift(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """health/tool_calls: the mean calls per episode over the last window fell below the
    baseline's over `alarm.tool_call_shift`, or rose above `alarm.tool_call_shift` times it while
    reward/mean rose less than `alarm.reward_rise` (calls the reward does not explain)."""
    points = series("health/tool_calls")
    rewards = series("reward/mean")
    if len(points) < 2 * cfg.window or len(rewards) < 2 * cfg.window:
        return None
    baseline = points[: cfg.window]
    recent = points[-cfg.window :]
    before = max(mean(baseline), TOOL_CALL_FLOOR)
    now = max(mean(recent), TOOL_CALL_FLOOR)
    reward_rise = mean(rewards[-cfg.window :]) - mean(rewards[: cfg.window])
    fell = now < before / cfg.tool_call_shift
    rose = now > before * cfg.tool_call_shift and reward_rise < cfg.reward_rise
    if not (fell or rose):
        return None
    threshold = before / cfg.tool_call_shift if fell else before * cfg.tool_call_shift
    change = "fell" if fell else f"rose while reward/mean moved {reward_rise:+.3g}, so"
    return Firing(
        "tool_call_shift",
        "health/tool_calls",
        mean(recent),
        threshold,
        f"tool calls per episode {change} from {mean(baseline):.3g} over {span(baseline)} to "
        f"{mean(recent):.3g} over {span(recent)}: past {cfg.tool_call_shift:g} times either way",
    )


def reward_without_correctness(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """reward/mean against health/correctness (a plugin that reports `info[alarm.correctness_key]`
    beside its reward): the reward's mean rose by `alarm.reward_rise` from the baseline while the
    correctness's did not rise."""
    correct = series("health/correctness")
    steps = {step for step, _ in correct}
    rewards = [point for point in series("reward/mean") if point[0] in steps]
    if len(correct) < 2 * cfg.window or len(rewards) != len(correct):
        return None
    size = cfg.window
    reward_rise = mean(rewards[-size:]) - mean(rewards[:size])
    correct_rise = mean(correct[-size:]) - mean(correct[:size])
    if reward_rise < cfg.reward_rise or correct_rise > 0:
        return None
    return Firing(
        "reward_without_correctness",
        "reward/mean",
        reward_rise,
        cfg.reward_rise,
        f"reward/mean rose {reward_rise:+.3g} from {span(rewards[:size])} to "
        f"{span(rewards[-size:])} while the verifier's {cfg.correctness_key} moved "
        f"{correct_rise:+.3g}",
    )


def seals(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """identity/segments_per_episode − 1: the step's episodes sealed more than
    `alarm.max_seals_per_episode` times each on average."""
    points = series("identity/segments_per_episode")
    if not points or points[-1][1] - 1 <= cfg.max_seals_per_episode:
        return None
    step, segments = points[-1]
    return Firing(
        "seals",
        "identity/segments_per_episode",
        segments - 1,
        cfg.max_seals_per_episode,
        f"episodes at step {step} sealed {segments - 1:.3g} times each (more than "
        f"{cfg.max_seals_per_episode:g}): each seal prefills the history again "
        f"(molt-wb check-template names the turns a template rewrites)",
    )


def identity_violations(series: Callable[[str], Points], cfg: Any) -> Firing | None:
    """identity/violations: more than `alarm.max_identity_violations` segments at a step whose
    trainer input differs from the sampled ids."""
    points = series("identity/violations")
    if not points or points[-1][1] <= cfg.max_identity_violations:
        return None
    step, violations = points[-1]
    return Firing(
        "identity_violations",
        "identity/violations",
        violations,
        cfg.max_identity_violations,
        f"{violations:.0f} segments at step {step} trained on ids that are not the sampled ones",
    )


RULES: dict[str, Callable[[Callable[[str], Points], Any], Firing | None]] = {
    "kl_acceleration": kl_acceleration,
    "entropy_collapse": entropy_collapse,
    "length_drift": length_drift,
    "tool_call_shift": tool_call_shift,
    "reward_without_correctness": reward_without_correctness,
    "seals": seals,
    "identity_violations": identity_violations,
}


class Alarms:
    """The rules over one run's metrics as they arrive, step by step."""

    def __init__(self, cfg: Any, history: dict[int, dict[str, float]] | None = None):
        """`cfg`: the `alarm` config; `history`: the run's stored metrics by step, replayed
        silently (a resumed run's rules start where they were)."""
        self.cfg = cfg
        self.points: dict[str, Points] = defaultdict(list)
        # rules whose condition held at the last step: they fire again only once it clears
        self.holding: set[str] = set()
        for step in sorted(history or {}):
            self.observe(step, history[step])

    def observe(self, step: int, metrics: dict[str, float]) -> list[Firing]:
        """Take one step's metrics; the rules whose condition starts to hold at it."""
        if not self.cfg.enabled:
            return []
        for key, value in metrics.items():
            # a NaN or infinite value is counted and warned about elsewhere (store/nonfinite.py)
            if math.isfinite(value):
                self.points[key].append((step, float(value)))
        fired = []
        for name, rule in RULES.items():
            firing = rule(self.points.__getitem__, self.cfg)
            if firing and name not in self.holding:
                fired.append(firing)
            if firing:
                self.holding.add(name)
            else:
                self.holding.discard(name)
        return fired


def stored_metrics(run_dir: str | Path) -> dict[int, dict[str, float]]:
    """A run folder's stored metrics by step: {step: {key: value}} (none before its first)."""
    import pyarrow.parquet as pq

    folder = Path(run_dir, "metrics")
    if not any(folder.glob("*.parquet")):
        return {}
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    columns = pq.read_table(folder, columns=["step", "key", "value"]).to_pydict()
    for step, key, value in zip(columns["step"], columns["key"], columns["value"], strict=True):
        by_step[step][key] = value
    return dict(by_step)


class Announcer:
    """The driver's side of the alarms: the rows a run folder's `alarms` table gained since the
    last call, as the lines a run prints (the store actor's own output goes to Ray's logs)."""

    def __init__(self, run_dir: str | Path, runs_command: str):
        self.folder = Path(run_dir, "alarms")
        self.runs_command = runs_command
        # a resumed run's earlier alarms were announced by the process that ran them
        self.seen = {shard.name for shard in self.folder.glob("part-*.parquet")}

    def lines(self) -> list[str]:
        """`alarm at step S, RULE: EVIDENCE (molt-wb runs RUN)` for each new row, in order."""
        import pyarrow.parquet as pq

        lines = []
        for shard in sorted(self.folder.glob("part-*.parquet")):
            if shard.name in self.seen:
                continue
            self.seen.add(shard.name)
            for row in pq.read_table(shard, columns=["step", "rule", "evidence"]).to_pylist():
                lines.append(
                    f"alarm at step {row['step']}, {row['rule']}: {row['evidence']} "
                    f"({self.runs_command})"
                )
        return lines
