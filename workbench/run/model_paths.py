"""Where each model checkpoint comes from: the policy every actor loads and the teacher of
on-policy distillation; a new source of weights (a hub, a warm start) is added here.
"""

from pathlib import Path

from workbench.algo.advantages import ADVANTAGES
from workbench.api import load_plugin
from workbench.models.pretrained import local_path, named_path
from workbench.run.checkpoint import latest
from workbench.run.progress import StartClock


def policy_path(cfg, clock: StartClock | None = None):
    """The checkpoint every actor loads: a resumed run's latest, model.path (a .gguf file
    converted once), or the built-in model `model.name` (warm-started if the recipe says so; the
    seconds of each on `clock`). Absolute: the actors may run in another working directory."""
    # a LoRA run resumes on its base: the checkpoint holds the adapter (models/lora.py); a run
    # resumed before its first checkpoint starts again from its first policy
    checkpoint = cfg.run.resume and latest(Path(cfg.run.root) / cfg.run.id)
    if checkpoint and not cfg.model.lora.rank:
        return str((checkpoint / "policy").absolute())
    if cfg.model.path:
        return str(Path(local_path(cfg.model.path)).absolute())
    return warm_started(cfg, cfg.model.warm_start_steps, clock)


def teacher_path(cfg):
    """The frozen teacher of on-policy distillation: algo.teacher_path, or the tiny base model
    warm-started `algo.teacher_warm_start_steps` steps on the plugin (it shares the policy's
    tokenizer); None when the algorithm has none."""
    if not ADVANTAGES[cfg.algo.advantage].teacher:
        return None
    if cfg.algo.teacher_path:
        return str(Path(cfg.algo.teacher_path).absolute())
    return warm_started(cfg, cfg.algo.teacher_warm_start_steps)


def warm_started(cfg, steps, clock: StartClock | None = None):
    """The built-in model `model.name` (tiny, or pretrained: models/pretrained.py) after `steps`
    warm-start steps on the plugin (0: as built); the seconds of its build (or download) and its
    warm start on `clock` (each about 0 once cached)."""
    # torch: imported only where a warm start may be built
    from workbench.run.sft import warm_started_path

    clock = clock or StartClock()
    with clock.timed("model_build"):
        path = named_path(cfg.model.name)
    if not steps:
        return str(path)
    plugin = load_plugin(cfg.agent.plugin, cfg.agent.env_kwargs)
    # a ChatAgent plugin names the Env plugin it shares demos with
    plugin = getattr(plugin, "WARM_START_AS", plugin)
    source = Path(plugin.__file__).read_text()
    model = cfg.model
    with clock.timed("warm_start"):
        return str(
            warm_started_path(
                path, plugin, source, steps, model.warm_start_lr, cfg.seed, model.warm_start_batch
            )
        )
