"""Where each model checkpoint comes from: the policy every actor loads and the teacher of
on-policy distillation; a new source of weights (a hub, a warm start) is added here.
"""

from pathlib import Path

from workbench.api import load_plugin
from workbench.checkpoint import latest
from workbench.models.tiny import tiny_model_path


def policy_path(cfg) -> str:
    """The checkpoint every actor loads: a resumed run's latest, model.path, or the tiny model
    (warm-started if the recipe says so)."""
    # torch: imported only where a warm start may be built
    from workbench.models.warm_start import warm_started_path

    # a LoRA run resumes on its base: the checkpoint holds the adapter (models/lora.py)
    if cfg.run.resume and not cfg.model.lora.rank:
        return str(latest(Path(cfg.run.root) / cfg.run.id) / "policy")
    if cfg.model.path:
        return str(cfg.model.path)
    path = tiny_model_path(cfg.model.name)
    if cfg.model.warm_start_steps:
        plugin = load_plugin(cfg.agent.plugin)
        # a ChatAgent plugin names the Env plugin it shares demos with
        plugin = getattr(plugin, "WARM_START_AS", plugin)
        path = warm_started_path(
            path,
            plugin,
            Path(plugin.__file__).read_text(),
            cfg.model.warm_start_steps,
            cfg.model.warm_start_lr,
            cfg.seed,
            cfg.model.warm_start_batch,
        )
    return str(path)


def teacher_path(cfg) -> str:
    """The frozen teacher of on-policy distillation: algo.teacher_path, or the tiny base model
    warm-started `algo.teacher_warm_start_steps` steps on the plugin (it shares the policy's
    tokenizer)."""
    from workbench.models.warm_start import warm_started_path

    if cfg.algo.teacher_path:
        return str(cfg.algo.teacher_path)
    plugin = load_plugin(cfg.agent.plugin)
    return str(
        warm_started_path(
            tiny_model_path(cfg.model.name),
            plugin,
            Path(plugin.__file__).read_text(),
            cfg.algo.teacher_warm_start_steps,
            cfg.model.warm_start_lr,
            cfg.seed,
        )
    )
