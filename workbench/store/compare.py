"""Runs side by side: the rows of `molt-wb compare` and `molt-wb sweeps`, read back from the
store."""

from collections import defaultdict

from workbench.store.query import (
    REWARD_CURVE,
    list_runs,
    open_run,
    resolve_run,
    run_row,
    run_seconds,
)

COLUMNS = (
    "run_id",
    "status",
    "final_reward",
    "best_reward",
    "kept_frac",
    "kept_token_frac",
    "mismatch_kl",
    "stale_frac",
    "tokens_per_s",
    "eval_reward",
    "distill_kl_first",
    "distill_kl",
    "wall_s",
)
# a run's figures under COLUMNS, from final_reward to distill_kl, read from its metrics
FIGURES = """
    select arg_max(value, step) filter (where key = 'reward/mean'),
           max(value) filter (where key = 'reward/mean'),
           avg(value) filter (where key = 'gate/kept_frac'),
           1 - avg(value) filter (where key = 'gate/is_filter_ratio'),
           avg(value) filter (where key = 'mismatch/kl'),
           avg(value) filter (where key = 'gate/stale_frac'),
           avg(value) filter (where key = 'perf/tokens_per_s'),
           arg_max(value, step) filter (where key = 'eval/reward'),
           arg_min(value, step) filter (where key = 'distill/kl'),
           arg_max(value, step) filter (where key = 'distill/kl')
    from metrics"""


def _swept_keys(runs):
    """The keys any of `runs` swept, sorted."""
    return sorted({key for run in runs for key in run.get("swept") or {}})


def sweeps(root="runs"):
    """One row per sweep id: runs, finished, failed, swept keys, created (newest first)."""
    by_sweep = defaultdict(list)
    for row in list_runs(root):
        if row.get("sweep_id"):
            by_sweep[row["sweep_id"]].append(row)
    table = []
    for sweep_id, runs in by_sweep.items():
        statuses = [run.get("status") for run in runs]
        table.append(
            {
                "sweep_id": sweep_id,
                "runs": len(runs),
                "finished": statuses.count("finished"),
                "failed": statuses.count("failed"),
                "swept": _swept_keys(runs),
                "created": min(run.get("created", 0) for run in runs),
            }
        )
    return sorted(table, key=lambda entry: -entry["created"])


def compare_rows(selection, root="runs"):
    """(swept keys, one row per run) for a sweep id or a list of run ids (unique prefixes
    allowed)."""
    runs = [r for r in list_runs(root) if len(selection) == 1 and r.get("sweep_id") == selection[0]]
    if not runs:
        runs = [run_row(resolve_run(run_id, root)) for run_id in selection]
    swept = _swept_keys(runs)
    rows = []
    for run in sorted(runs, key=lambda r: r.get("created", 0)):
        figures = open_run(run["run_id"], root).execute(FIGURES).fetchone()
        wall = run_seconds(run)
        rows.append(
            dict(
                zip(COLUMNS, (run["run_id"], run.get("status"), *figures, wall), strict=True),
                **{key: (run.get("swept") or {}).get(key) for key in swept},
            )
        )
    return swept, rows


def plot(rows, swept, root, path):
    """Reward curves of every run, and the fraction of sampled tokens the gate kept vs final reward
    (sequence-level gates drop whole sequences, token-level ones single tokens: both count here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, tradeoff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in rows:
        curve = open_run(row["run_id"], root).execute(REWARD_CURVE).fetchnumpy()
        label = ", ".join(f"{k}={row[k]}" for k in swept) or row["run_id"]
        curves.plot(curve["step"], curve["value"], label=label)
        kept = row["kept_token_frac"] if row["kept_token_frac"] is not None else 1.0
        final = row["final_reward"] or 0.0
        tradeoff.scatter(kept, final)
        tradeoff.annotate(label, (kept, final), fontsize=7)
    curves.set(xlabel="step", ylabel="reward/mean", title="reward")
    curves.legend(fontsize=7)
    tradeoff.set(
        xlabel="sampled tokens kept by the gate (mean)",
        ylabel="final reward",
        title="kept fraction vs reward",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
