"""Searched sweeps: `molt-wb tune`, an Optuna study over config keys whose every trial is a run
tagged with the study's sweep id; how a trial is sampled, watched and scored changes here.

The search space is written in Hydra's sweep grammar, as for `molt-wb train -m`: a list, choice()
or range() is searched as categories, interval() as a float (int(interval(...)) an integer,
tag(log, interval(...)) on a log scale). Each trial trains in a process of its own, which sends
the tuner each step's `reward/mean` as it logs the step and waits for the median pruner's verdict
on it (averaged over the last `SMOOTH` steps): a trial that falls behind stops at that very step, as
Ctrl-C stops `molt-wb train` (the run is kept, status interrupted). Which trial is pruned, and
where, depends on the steps it reported, never on how fast it runs. The study lives beside the
runs, in `<run.root>/<sweep id>.optuna.db`, and `--resume` continues it.
"""

import datetime
import multiprocessing
import os
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from hydra.errors import HydraException
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from workbench.config import ConfigError, compose_config
from workbench.run import progress, run_folder
from workbench.store.compare import compare_rows
from workbench.store.query import root_option

SUFFIX = ".optuna.db"
# what a trial maximises, from its `molt-wb compare` row
METRICS = {
    "best": lambda row: row["best_reward"],
    "final": lambda row: row["final_reward"],
    "per_second": lambda row: row["final_reward"] / row["wall_s"],
}
# the exit status of a run stopped as Ctrl-C stops it
INTERRUPTED = 130
# the pruner sees each step's `reward/mean` averaged over this many steps up to it: one step's
# batch is too noisy to judge by (a trial's best single step is nearly always above the median)
SMOOTH = 10


def search_space(line):
    """(the fixed overrides, {key: Optuna distribution} of the searched ones) of a tune line."""
    try:
        parsed = OverridesParser.create().parse_overrides(line)
    except HydraException as error:
        first = str(error).splitlines()[0]
        raise ConfigError(f"Bad override ({first}); see `molt-wb tune --help`.") from None
    fixed = []
    space = {}
    for override in parsed:
        value = override.value()
        try:
            if isinstance(value, IntervalSweep):
                kind = IntDistribution if isinstance(value.start, int) else FloatDistribution
                space[override.key_or_group] = kind(value.start, value.end, log="log" in value.tags)
            elif isinstance(value, (ChoiceSweep, RangeSweep)):
                choices = list(override.sweep_string_iterator())
                space[override.key_or_group] = CategoricalDistribution(choices)
            elif override.is_sweep_override():
                raise ValueError("only choice(), range() and interval() are searched")
            else:
                fixed.append(override.input_line)
        except ValueError as error:
            reason = str(error).rstrip(".")
            raise ConfigError(f"{override.input_line} cannot be searched: {reason}.") from None
    if not space:
        raise ConfigError(
            "Nothing to search: give a key a range, e.g. 'gate.band.0=interval(0.3,0.99)' or "
            "'gate.max_staleness=int(interval(0,3))'."
        )
    return fixed, space


def run_study(line, trials, metric, startup, warmup, resume=None, config_dirs=()):
    """`molt-wb tune`: open a new study of `line` (or the one in the file `resume`), run `trials`
    trials, print a line for each and the study's summary; `config_dirs`: the user's config
    folders (--config-dir), kept with the study."""
    if resume and line:
        raise ConfigError("--resume continues a study with its own line: drop the overrides.")
    if resume:
        tuner = Tuner(resume)
    else:
        tuner = Tuner.new(line, metric, startup, warmup, config_dirs)
    try:
        for _ in range(trials):
            print(tuner.describe(tuner.run_trial()), flush=True)
    except KeyboardInterrupt:
        print(f"interrupted; continue with: molt-wb tune --resume {tuner.path}", file=sys.stderr)
        sys.exit(130)
    print(tuner.summary())


class Tuner:
    """An Optuna study in `<run.root>/<sweep id>.optuna.db` and the runs of its trials."""

    def __init__(self, path, settings=None):
        """Open the study in the file `path`: new with `settings` (line, metric, startup, warmup),
        else the one there with its own."""
        self.path = Path(path)
        self.root = str(self.path.parent)
        self.name = self.path.name.removesuffix(SUFFIX)
        storage = f"sqlite:///{path}"
        if settings is None:
            if not self.path.is_file():
                raise ConfigError(
                    f"No study {path}: give the .optuna.db file `molt-wb tune` printed."
                )
            settings = optuna.load_study(study_name=self.name, storage=storage).user_attrs
        self.settings = settings
        self.fixed, self.space = search_space(settings["line"])
        self.study = optuna.create_study(
            storage=storage,
            study_name=self.name,
            direction="maximize",
            load_if_exists=True,
            pruner=optuna.pruners.MedianPruner(settings["startup"], settings["warmup"]),
        )
        # seeded by the trials so far: a resumed study draws new points, not the first session's
        self.study.sampler = optuna.samplers.TPESampler(seed=len(self.study.trials))
        for key, value in settings.items():
            self.study.set_user_attr(key, value)
        # trials of a session that was killed: their runs stopped with it
        for trial in self.study.get_trials(states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL)

    @classmethod
    def new(cls, line, metric, startup, warmup, config_dirs=()):
        """A new study of the line's searched keys in its run.root, refused at once if a key or
        the metric is unknown."""
        if metric not in METRICS:
            raise ConfigError(f"--metric {metric} is not one of {', '.join(METRICS)}.")
        fixed, space = search_space(line)
        # absolute: a resumed study finds them from any folder
        config_dirs = [str(Path(folder).absolute()) for folder in config_dirs]
        cfg = compose_config(fixed, config_dirs)
        absent = object()
        for key in space:
            if OmegaConf.select(cfg, key, default=absent) is absent:
                raise ConfigError(
                    f"{key} is not a config key: check it with `molt-wb train --help`."
                )
        name = datetime.datetime.now().strftime("tune-%Y%m%d-%H%M%S-") + os.urandom(2).hex()
        Path(cfg.run.root).mkdir(parents=True, exist_ok=True)
        settings = dict(
            line=line, metric=metric, startup=startup, warmup=warmup, config_dirs=config_dirs
        )
        return cls(Path(cfg.run.root, name + SUFFIX), settings)

    def run_trial(self):
        """Sample a point, train its run to the end or until the pruner stops it; its trial."""
        trial = self.study.ask(self.space)
        swept = {key: str(value) for key, value in trial.params.items()}
        overrides = [*self.fixed, *(f"{k}={v}" for k, v in swept.items())]
        try:
            cfg = compose_config(
                [*overrides, f"run.sweep_id={self.name}", f"run.root={self.root}"],
                self.settings.get("config_dirs", ()),
            )
        except ConfigError as error:
            print(f"trial {trial.number} refused: {error}", file=sys.stderr)
            return self.study.tell(trial, state=TrialState.FAIL)
        cfg.run.id = run_folder.new_run_id()
        cfg.run.swept = swept
        cfg.run.progress = False
        trial.set_user_attr("run_id", cfg.run.id)
        context = multiprocessing.get_context("spawn")
        tuner_end, run_end = context.Pipe()
        child = context.Process(target=_train, args=(cfg, run_end))
        child.start()
        # the child holds the run's end: its exit closes the pipe
        run_end.close()
        pruned = self._judge(trial, tuner_end)
        child.join()
        if pruned and child.exitcode == INTERRUPTED:
            return self.study.tell(trial, state=TrialState.PRUNED)
        if child.exitcode != 0:
            return self.study.tell(trial, state=TrialState.FAIL)
        _, rows = compare_rows([cfg.run.id], self.root)
        return self.study.tell(trial, METRICS[self.settings["metric"]](rows[0]))

    def _judge(self, trial: optuna.Trial, run: Connection) -> bool:
        """Report each step's `reward/mean` the trial's run sends (smoothed) and answer whether
        the pruner stops it there; whether it did. A finished run's whole curve is reported:
        later trials are measured against it."""
        rewards = []
        while True:
            try:
                step, reward = run.recv()
            except EOFError:
                # the run ended (finished, failed or interrupted) without being pruned
                return False
            rewards.append(reward)
            window = rewards[-SMOOTH:]
            trial.report(sum(window) / len(window), step)
            pruned = trial.should_prune()
            run.send(pruned)
            if pruned:
                return True

    def describe(self, trial: optuna.trial.FrozenTrial):
        """One line of a trial: its number, score (or pruned, failed), values and run."""
        outcome = trial.state.name.lower()
        if trial.state == TrialState.COMPLETE:
            outcome = f"{self.settings['metric']} reward {trial.value:.4g}"
        if trial.state == TrialState.PRUNED:
            outcome = f"pruned at step {trial.last_step}"
        values = " ".join(f"{key}={value}" for key, value in trial.params.items())
        return f"trial {trial.number} {outcome}: {values} (run {trial.user_attrs.get('run_id')})"

    def summary(self):
        """Trials, pruned, failed, the best trial, and the command that compares them."""
        states = [trial.state for trial in self.study.trials]
        best = ""
        if TrialState.COMPLETE in states:
            best = f"; best: {self.describe(self.study.best_trial)}"
        return (
            f"study {self.name}: {len(states)} trials, {states.count(TrialState.PRUNED)} pruned, "
            f"{states.count(TrialState.FAIL)} failed{best}\n"
            f"molt-wb compare {self.name}{root_option(self.root)}"
        )


def _train(cfg, tuner: Connection):
    """A trial's run, in a process of its own: each logged step's `reward/mean` goes to the tuner,
    whose verdict it waits for; pruned (or SIGINT) stops it as Ctrl-C stops `molt-wb train`."""
    from workbench.run import loop

    def judged(metrics: dict) -> None:
        # the loop step the metrics are of: each step trains trainer.minibatches versions
        step = int(metrics["train/version"]) // cfg.trainer.minibatches - 1
        tuner.send((step, metrics["reward/mean"]))
        if tuner.recv():
            raise KeyboardInterrupt

    progress.WATCHERS.append(judged)
    try:
        loop.train(cfg)
    except KeyboardInterrupt:
        # the run is kept, status interrupted; the exit status says it did not finish
        sys.exit(INTERRUPTED)
    except ConfigError as error:
        run_folder.record_refused(cfg, str(error))
        sys.exit(f"trial run {cfg.run.id} refused: {error}")
