"""A run's summary, printed when `molt-wb train` ends and by `molt-wb runs RUN_ID`: the reward
curve, the three invariants' figures and where the time went, read back from the run store.
"""

from collections import defaultdict

from workbench.run.memory import summary_line
from workbench.store import nonfinite
from workbench.store.alarms import FIRED
from workbench.store.gap import gap_line, gap_sizes
from workbench.store.query import (
    REWARD_CURVE,
    open_run,
    resolve_run,
    root_option,
    run_row,
    run_seconds,
)

SPARKS = "▁▂▃▄▅▆▇█"
# the first and last steps the reward rise is read over
EDGE = 5
# the start of a run before its first step (progress.StartClock), then each step's waits
PHASES = {
    "model_build": "model build",
    "warm_start": "warm start",
    "actor_start": "actor start",
    "rollout": "rollout",
    "train": "train",
}


def figures(run_id, root="runs"):
    """The summary's numbers: (step, mean reward) pairs, every metric's sum and mean over the steps,
    the run row, and the wall time."""
    folder = resolve_run(run_id, root)
    run = run_row(folder)
    rewards = []
    # a metric a run never logged reads 0
    sums = defaultdict(float)
    means = defaultdict(float)
    maxima = defaultdict(float)
    nonfinite_rows = []
    alarms = []
    gap = None
    # a run stopped before its first step has no metrics yet
    if (folder / "metrics").is_dir():
        db = open_run(folder.name, root)
        rewards = db.execute(REWARD_CURVE).fetchall()
        for key, total, mean, most in db.execute(
            "select key, sum(value), avg(value), max(value) from metrics group by key"
        ).fetchall():
            sums[key] = total
            means[key] = mean
            maxima[key] = most
        nonfinite_rows = db.execute(nonfinite.FIRST_STEPS).fetchall()
        alarms = db.execute(FIRED).fetchall()
        gap = gap_sizes(db)
    wall = run_seconds(run)
    return dict(
        run=run,
        folder=str(folder),
        rewards=rewards,
        sums=sums,
        means=means,
        maxima=maxima,
        wall_s=wall,
        nonfinite=nonfinite_rows,
        alarms=alarms,
        gap=gap,
    )


def alarm_lines(alarms):
    """The run-health alarms that fired (store/alarms.py), one line each, in step order."""
    if not alarms:
        return ["alarms     none fired"]
    labels = ["alarms"] + [""] * (len(alarms) - 1)
    return [
        f"{label:<10} step {step} {rule}: {evidence}"
        for label, (step, rule, evidence) in zip(labels, alarms, strict=True)
    ]


def sparkline(values, width=50):
    """Values as bars, in at most `width` characters (each the mean of its share of the
    values)."""
    # values per character, rounded up
    size = max(1, -(-len(values) // width))
    chunks = [values[start : start + size] for start in range(0, len(values), size)]
    buckets = [sum(chunk) / len(chunk) for chunk in chunks]
    low = min(buckets, default=0.0)
    span = max(max(buckets, default=0.0) - low, 1e-12)
    return "".join(SPARKS[round((value - low) / span * (len(SPARKS) - 1))] for value in buckets)


def render(numbers, root="runs"):
    """The summary as lines of text."""
    run = numbers["run"]
    rewards = [reward for _, reward in numbers["rewards"]]
    sums = numbers["sums"]
    means = numbers["means"]
    wall = numbers["wall_s"]
    lines = [
        f"run {run['run_id']} {run.get('status')}: {run.get('steps_done', 0)}/{run.get('steps')} "
        f"steps in {wall:.0f} s"
    ]
    if rewards:
        edge = max(1, min(EDGE, len(rewards) // 2))
        # max keeps the earliest of equal rewards
        best_step, best = max(numbers["rewards"], key=lambda point: point[1])
        lines.append(
            f"reward     {sparkline(rewards)}  first {edge} steps {sum(rewards[:edge]) / edge:.3f}"
            f" -> last {edge} {sum(rewards[-edge:]) / edge:.3f}, best {best:.3f} "
            f"(step {best_step})"
        )
    lines += [
        f"identity   {sums['identity/violations']:.0f} violations, "
        f"retokenize drift {means['identity/retokenize_drift']:.4f}",
        f"gate       kept {means['gate/kept_frac']:.3f}, mismatch KL {means['mismatch/kl']:.2e}",
        nonfinite.summary_line(numbers.get("nonfinite", [])),
        *alarm_lines(numbers.get("alarms", [])),
        *gap_line(numbers.get("gap")),
    ]
    if "routing/mismatch_token_frac" in means:
        lines.append(
            f"routing    tokens with a flipped route {means['routing/mismatch_token_frac']:.4f}; "
            f"KL with replay {means['mismatch/kl_replay']:.2e}, "
            f"without {means['mismatch/kl_no_replay']:.2e}"
        )
    maxima = numbers.get("maxima", {})
    memory = summary_line(maxima.get("memory/pss_peak_bytes", 0), maxima.get("memory/processes", 0))
    lines += [memory] if memory else []
    spent = {}
    for key, name in PHASES.items():
        seconds = sums[f"perf/{key}_s"]
        # a start-up phase cached by an earlier run took no time: not shown
        if seconds >= 0.05 or key in ("rollout", "train"):
            spent[name] = seconds
    # the rest: the data, the run folder, checkpoints, logging, Ray's shutdown
    spent["other"] = max(wall - sum(spent.values()), 0.0)
    shares = [
        f"{name} {seconds:.1f} s ({seconds / max(wall, 1e-9):.0%})"
        for name, seconds in spent.items()
    ]
    option = root_option(root)
    lines += [
        f"time       {', '.join(shares)}",
        f"folder     {numbers['folder']}",
        f"inspect    molt-wb inspect {run['run_id']}{option}   (SQL: workbench.store.open_run)",
    ]
    return "\n".join(lines)
