"""The `molt-wb` command line: train, sft, runs, export, doctor, prepare."""

import contextlib
import csv as csv_module
import datetime
import json
import os
import shutil
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from workbench import about
from workbench.api import load_plugin
from workbench.config import ConfigError, compose_config, expand_sweep
from workbench.extras import missing, needs
from workbench.run import bundle_commands, check_template
from workbench.store.query import root_option

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="molt-wb: a research workbench for agentic RL on language models.",
)
# the --root of every command that reads run folders
ROOT = typer.Option("runs", help="Folder of run folders (run.root); run.root=DIR works alike.")
# train's and resume's: run.root=DIR, as the config has it, unless given
RUN_ROOT = typer.Option(None, "--root", help="Folder of run folders: the same as run.root=DIR.")
# a command whose extra arguments are Hydra overrides
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
# the user's config folders, searched before the shipped conf/ (theirs win a name clash)
CONFIG_DIR = typer.Option(
    [], help="A folder of your own configs (recipe/NAME.yaml, ...); repeatable."
)
# molt-wb --version
app.callback()(about.options)


def console():
    """A rich console; piped output gets wide lines so ids are never cut."""
    return Console(width=None if sys.stdout.isatty() else 200)


def fail(message, code=2):
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


class RunFolders(typer.core.TyperCommand):
    """A command that reads run folders: `run.root=DIR` is its `--root DIR`, so one way to name
    the folder works on every command (train and resume take both as well)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        args = [f"--root={a.split('=', 1)[1]}" if a.startswith("run.root=") else a for a in args]
        return super().parse_args(ctx, args)


@contextlib.contextmanager
def user_errors():
    """A mistake the user can fix (a ValueError: a ConfigError, an unknown run, ...) ends the
    command with its one sentence, no traceback."""
    try:
        yield
    except ValueError as error:
        fail(error)


@app.command(context_settings=OVERRIDES)
def train(ctx: typer.Context, config_dir: list[str] = CONFIG_DIR, root: str | None = RUN_ROOT):
    """Train a policy. Arguments are Hydra overrides: `+recipe=arith trainer.steps=10
    engine.temperature=0.9`.

    `-m`/`--multirun` (anywhere on the line) runs every combination of comma-separated values as
    its own run, all tagged with one sweep id; `sweep.parallel=N` runs N at once. `resume=RUN_ID`
    continues a run from its latest checkpoint (see `molt-wb resume`). Config groups: model,
    engine, agent, algo, gate, trainer, tracking, ray; see conf/ and the README for every key.
    """
    from omegaconf import OmegaConf

    from workbench.run.checkpoint import resume_config
    from workbench.run.run_folder import new_run_id

    overrides = [a for a in ctx.args if a not in ("-m", "--multirun")]
    multirun = len(overrides) != len(ctx.args)
    if root:
        overrides.append(f"run.root={root}")
    resume = [a.split("=", 1)[1] for a in overrides if a.startswith("resume=")]
    with user_errors():
        if resume:
            if multirun:
                raise ConfigError("resume= continues one run: drop -m.")
            kept = [a for a in overrides if not a.startswith("resume=")]
            configs = [resume_config(resume[0], kept)]
            jobs = []
        else:
            jobs = [(overrides, {})]
            sweep = []
            if multirun:
                jobs = expand_sweep(overrides)
                sweep = [f"run.sweep_id=sweep-{new_run_id()}"]
            configs = [compose_config(job + sweep, config_dir) for job, _ in jobs]
    # a resumed run (no jobs) keeps the swept values it has
    for cfg, (_, swept) in zip(configs, jobs, strict=False):
        OmegaConf.update(cfg, "run.swept", swept, merge=False)
    # torch and transformers come with the loop: `runs`, `compare` and `--help` start without
    from workbench.run import cluster, loop, run_folder, summary
    from workbench.run.faults import RunFailed

    parallel = configs[0].sweep.parallel if multirun else 1
    # the policy's template checked once per (model, history_rewrite): rendering only, no forward
    check_template.warn_at_start(configs)
    if multirun:
        # once, sized for the largest job (times sweep.parallel)
        try:
            cluster.init_ray(configs[0], sized_for=configs)
        except ConfigError as error:
            fail(error)
    if parallel > 1:
        for cfg in configs:
            OmegaConf.update(cfg, "run.progress", False)

    def run(cfg):
        try:
            run_id = loop.train(cfg)
            typer.echo(summary.render(summary.figures(run_id, cfg.run.root), cfg.run.root))
            return True
        except ConfigError as error:
            if not multirun:
                fail(error)
            run_folder.record_refused(cfg, str(error))
            typer.secho(f"run {cfg.run.id} refused: {error}", fg="red", err=True)
        # a failed job of a sweep is recorded as failed and the sweep goes on
        except Exception as error:
            if not multirun:
                if not isinstance(error, RunFailed):
                    raise
                # one sentence, no traceback
                fail(error, 1)
            typer.secho(f"run {cfg.run.id} failed: {error}", fg="red", err=True)
        return False

    try:
        if parallel > 1:
            with ThreadPoolExecutor(parallel) as pool:
                outcomes = list(pool.map(run, configs))
        else:
            outcomes = [run(cfg) for cfg in configs]
    except KeyboardInterrupt:
        hint = ""
        if len(configs) == 1 and configs[0].run.id:
            from workbench.run.recovery import resume_command

            hint = f" Continue it with: {resume_command(configs[0])}"
        typer.echo(f"interrupted; what was written is kept.{hint}", err=True)
        raise typer.Exit(130) from None
    if multirun:
        sweep_root = configs[0].run.root
        option = root_option(sweep_root)
        typer.echo(
            f"sweep {configs[0].run.sweep_id}: {sum(outcomes)}/{len(outcomes)} runs finished; "
            f"molt-wb compare {configs[0].run.sweep_id}{option}"
        )
    if not all(outcomes):
        raise typer.Exit(1)


@app.command(context_settings=OVERRIDES)
def sft(
    ctx: typer.Context,
    data: str = typer.Argument(..., help="A .jsonl or .parquet file with a `messages` column."),
    config_dir: list[str] = CONFIG_DIR,
):
    """Supervised fine-tuning on conversations in OpenAI chat format (images as `image_url` parts
    of inline base64), the loss on assistant tokens only, through the RL learner; a run that
    `inspect`, `eval` and `export` read (metrics: loss/policy is the loss, loss/grad_norm,
    loss/tokens).

    Arguments after DATA are Hydra overrides as for `train`: `model.path=...`, trainer.steps
    (optimizer steps), trainer.prompts_per_step (conversations per step), trainer.lr,
    trainer.checkpoint_every, seed.
    """
    from workbench.run import model_paths
    from workbench.run.sft import SETTINGS, conversations, run

    with user_errors():
        cfg = compose_config([*ctx.args, *SETTINGS], config_dir)
        model_path = model_paths.policy_path(cfg)
        demonstrations = conversations(data, model_path)
    typer.echo(run(cfg, demonstrations, model_path))


@app.command(context_settings=OVERRIDES)
def resume(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., help="The run (a unique prefix of its id)."),
    root: str | None = RUN_ROOT,
):
    """Continue a run from its latest checkpoint, with its saved config: same run id, versions and
    data continue; a run with no checkpoint yet starts again from step 0 in its folder.

    Extra arguments are key=value overrides on the saved config (`trainer.steps=200` extends a
    run); `--root DIR` or `run.root=DIR` finds it. Rows written after that checkpoint are dropped
    and written again.
    """
    ctx.args = [f"resume={run_id}", *ctx.args]
    train(ctx, root=root)


@app.command(context_settings=OVERRIDES)
def tune(
    ctx: typer.Context,
    trials: int = typer.Option(10, help="Trials to run (more, when resuming)."),
    metric: str = typer.Option("best", help="What a trial maximises: best, final or per_second."),
    startup: int = typer.Option(4, help="Trials that finish before the pruner stops any."),
    warmup: int = typer.Option(10, help="Steps every trial runs before it can be pruned."),
    resume: str | None = typer.Option(None, help="Continue this study (a .optuna.db file)."),
    config_dir: list[str] = CONFIG_DIR,
):
    """Search config keys with an Optuna study: `+recipe=arith 'gate.band.0=interval(0.3,0.99)'
    'gate.max_staleness=int(interval(0,3))' --trials 12`.

    Arguments are Hydra overrides; a list, choice(), range() or interval() is searched. Every
    trial is a run tagged with the study's sweep id (`molt-wb compare` reads them); one whose
    `reward/mean` (averaged over 10 steps) falls below the median of finished trials at the same
    step is stopped (median pruner). --metric: the best or final `reward/mean` of a run, or its
    final per wall second. The study is kept in run.root as <sweep id>.optuna.db; --resume
    continues it.
    """
    if missing("tune"):
        fail(needs("molt-wb tune", "tune"))
    from workbench.run.tune import run_study

    with user_errors():
        run_study(ctx.args, trials, metric, startup, warmup, resume, config_dir)


@app.command(context_settings=OVERRIDES)
def serve(
    ctx: typer.Context,
    sessions: int = typer.Option(1, help="Number of sessions to open."),
    json_lines: bool = typer.Option(
        False, "--json", help="One JSON line per session, for scripts."
    ),
    config_dir: list[str] = CONFIG_DIR,
):
    """Serve the policy on a loopback server for agent development; every session is recorded as a
    run.

    Arguments are Hydra overrides (`model.path=...`, `engine.max_tokens=64`). Prints each
    session's OpenAI base URL, Anthropic URL and key. Ctrl-C or SIGTERM flushes the run store and
    exits.
    """
    with user_errors():
        cfg = compose_config(ctx.args, config_dir)
    # the server's threads inherit this
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    from workbench.run.serve import Recorder

    recorder = Recorder(cfg, sessions)
    for info in recorder.infos:
        if json_lines:
            typer.echo(json.dumps(info))
        else:
            key = info["api_key"]
            typer.echo(
                f"session {info['session']}\n"
                f"  OpenAI:    OpenAI(base_url={info['openai_base_url']!r}, api_key={key!r})\n"
                f"  Anthropic: Anthropic(base_url={info['anthropic_base_url']!r}, api_key={key!r})"
            )
    if not json_lines:
        typer.echo(
            f"recording into run {cfg.run.id} ({cfg.run.root}/{cfg.run.id}); Ctrl-C to stop."
        )
    sys.stdout.flush()
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
    recorder.close()
    typer.echo(f"run {cfg.run.id} saved: {os.path.join(cfg.run.root, cfg.run.id)}", err=True)


@app.command(cls=RunFolders)
def runs(
    run_id: str | None = typer.Argument(
        None, help="A run id or a unique prefix: print its summary instead of the list."
    ),
    root: str = ROOT,
    limit: int = typer.Option(50, help="Show at most this many runs, newest first."),
):
    """List runs: id, recipe, status, steps, mean reward, created; or one run's summary: reward
    curve, invariants, where the time went."""
    from workbench.run import summary
    from workbench.store.query import RUN_COLUMNS, list_runs, run_cells

    if run_id:
        with user_errors():
            typer.echo(summary.render(summary.figures(run_id, root), root))
        return
    table = Table(*RUN_COLUMNS)
    for row in list_runs(root)[:limit]:
        table.add_row(*run_cells(row, "%Y-%m-%d %H:%M"))
    console().print(table)


@app.command("sweeps", cls=RunFolders)
def list_sweeps(root: str = ROOT):
    """List sweeps: id, runs, finished, failed, swept keys, created."""
    from workbench.store.compare import sweeps

    table = Table("sweep", "runs", "finished", "failed", "swept", "created")
    for row in sweeps(root):
        table.add_row(
            row["sweep_id"],
            str(row["runs"]),
            str(row["finished"]),
            str(row["failed"]),
            ", ".join(row["swept"]),
            datetime.datetime.fromtimestamp(row["created"]).strftime("%Y-%m-%d %H:%M"),
        )
    console().print(table)


@app.command(cls=RunFolders)
def compare(
    selection: Annotated[
        list[str], typer.Argument(help="A sweep id, or run ids (unique prefixes).")
    ],
    root: str = ROOT,
    csv: bool = typer.Option(False, "--csv", help="CSV on stdout."),
    json_out: bool = typer.Option(False, "--json", help="JSON (one object per run) on stdout."),
    plot_path: str | None = typer.Option(
        None, "--plot", help="Write reward curves and kept-vs-reward to PNG."
    ),
):
    """Runs side by side: swept values, final and best reward, kept fraction, KL, stale fraction,
    tokens/s, wall time."""
    if plot_path and missing("plot"):
        fail(needs("compare --plot", "plot"))
    from workbench.store.compare import COLUMNS, compare_rows, plot
    from workbench.store.query import cell

    with user_errors():
        swept, rows = compare_rows(selection, root)
    columns = [*COLUMNS[:1], *swept, *COLUMNS[1:]]
    if json_out:
        typer.echo(json.dumps(rows, indent=1))
    elif csv:
        writer = csv_module.DictWriter(sys.stdout, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    else:
        table = Table(*columns)
        for row in rows:
            table.add_row(*(cell(row[c]) for c in columns))
        console().print(table)
    if plot_path:
        plot(rows, swept, root, plot_path)
        typer.echo(f"wrote {plot_path}", err=True)


@app.command("eval", cls=RunFolders, context_settings=OVERRIDES)
def eval_command(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., help="Run id (a unique prefix is enough)."),
    checkpoint: str | None = typer.Argument(
        None,
        help="A checkpoint folder or step number; default the latest, else the run's starting "
        "policy.",
    ),
    root: str = ROOT,
):
    """Score a checkpoint on the run's held-out split without training; extra `eval.*` overrides
    set the sampling (eval.samples=4)."""
    from workbench.run.evaluate import from_checkpoint

    overrides = list(ctx.args)
    # `molt-wb eval RUN eval.samples=4`: an override, not a checkpoint
    if checkpoint and "=" in checkpoint:
        overrides = [checkpoint, *overrides]
        checkpoint = None
    with user_errors():
        row = from_checkpoint(run_id, checkpoint, root, overrides)
    typer.echo(
        f"eval {row['split']} step {row['step']}: n={row['n']} "
        f"mean_reward={row['mean_reward']:.4f} accuracy={row['accuracy']:.4f} ({row['checkpoint']})"
    )


@app.command(cls=RunFolders)
def export(
    run_id: Annotated[str, typer.Argument(help="Run id (a unique prefix is enough).")],
    where: Annotated[
        list[str],
        typer.Argument(
            help="[CHECKPOINT] OUT: a checkpoint folder or step number (default the latest), "
            "and the folder to write."
        ),
    ],
    root: str = ROOT,
    merged: bool = typer.Option(
        False, "--merged", help="A LoRA run's: the base with the adapter merged in."
    ),
):
    """Write a checkpoint's policy as a Hugging Face folder (weights, config, tokenizer and
    processor files) that transformers and vLLM load; a LoRA run's is its PEFT adapter folder,
    or with --merged the whole merged model."""
    from workbench.run.evaluate import resolve_checkpoint
    from workbench.store.query import resolve_run

    *checkpoint, out = where
    with user_errors():
        run_dir = resolve_run(run_id, root)
        policy, version = resolve_checkpoint(run_dir, checkpoint[0] if checkpoint else None)
    if policy is None or len(checkpoint) > 1:
        fail(f"Run {run_dir.name} has no checkpoint to export: give RUN [CHECKPOINT] OUT.")
    if os.path.exists(out) and os.listdir(out):
        fail(f"{out} exists and is not empty: give a new folder to export into.")
    # a LoRA checkpoint's policy is its adapter: --merged writes the base with it merged in (peft)
    lora = (policy / "adapter_config.json").exists()
    if merged and lora and missing("lora"):
        fail(needs("export --merged of a LoRA run", "lora"))
    shutil.copytree(policy, out, dirs_exist_ok=True)
    if merged and lora:
        from workbench.models.lora import merged_model

        merged_model(str(policy)).save_pretrained(out)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            os.remove(os.path.join(out, name))
    typer.echo(f"exported {run_dir.name} at version {version} to {out}")


@app.command(cls=RunFolders)
def inspect(
    run_id: str | None = typer.Argument(
        None, help="A run id or a unique prefix; none lists the runs."
    ),
    root: str = ROOT,
    sweep: str = typer.Option("", help="List only the runs of this sweep id (or part of it)."),
    poll: float = typer.Option(2.0, help="Seconds between re-reads of a live run."),
):
    """Browse runs in a terminal UI: overview plots, segments, gate decisions, requests, and every
    token of a segment."""
    if missing("tui"):
        fail(needs("molt-wb inspect", "tui"))
    from workbench.store.query import resolve_run
    from workbench.tui.app import InspectApp

    with user_errors():
        run_id = run_id and resolve_run(run_id, root).name
    InspectApp(root, run_id, sweep, poll).run()


# molt-wb doctor (workbench/about.py)
app.command()(about.doctor)

# molt-wb bundle RUN STEP and molt-wb replay FILE (workbench/run/bundle_commands.py)
app.command(cls=RunFolders)(bundle_commands.bundle)
app.command()(bundle_commands.replay)
# molt-wb check-template MODEL (workbench/run/check_template.py)
app.command("check-template")(check_template.command)


app.command("plugins")(about.plugins)

prepare_app = typer.Typer(
    no_args_is_help=True, help="Convert a public data set into the shape a recipe reads."
)
app.add_typer(prepare_app, name="prepare")


@prepare_app.command("geo3k")
def prepare_geo3k(
    src: str = typer.Argument(
        ...,
        help="A split folder of the Geometry3K release (<id>/data.json, img_diagram.png) or a "
        "hiyouga/geometry3k .parquet/.jsonl.",
    ),
    out: str = typer.Argument(
        ..., help="Output file: .parquet (images as bytes) or .jsonl (images as base64)."
    ),
):
    """Convert Geometry3K into the Parquet/JSONL shape `+recipe=geo3k data.path=OUT` reads; choice
    letters become values."""
    with user_errors():
        rows = load_plugin("geo3k_data").prepare(src, out)
    typer.echo(f"wrote {rows} samples to {out}")


# the docstrings are wrapped at 100 columns in the source, not in the help: each paragraph on one
# line, which the help rewraps to the terminal's width
for command in app.registered_commands + prepare_app.registered_commands:
    paragraphs = command.callback.__doc__.split("\n\n")
    command.callback.__doc__ = "\n\n".join(" ".join(p.split()) for p in paragraphs)


def main(argv=None):
    app(args=argv)


if __name__ == "__main__":
    main()
