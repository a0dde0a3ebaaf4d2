"""Where molt-wb finds what a run names: its configs and its agent plugins, from any folder.

The repository's `conf/` and `plugins/` are installed as the packages `workbench.conf` and
`workbench.plugins` (setup.py), so an editable checkout and a wheel find them the same way.

Configs: Hydra's search path holds the user's `--config-dir` folders first, in the order given
(theirs win a name clash, as with Hydra's own `--config-dir`), then the shipped configs,
`pkg://workbench.conf`.

Plugins: `agent.plugin` is, in the order tried,
- a .py file's path (`envs/maze.py`), relative to the current folder;
- a shipped plugin's name (`arith`: the module `workbench.plugins.arith`);
- a name an installed package registers in the `molt_wb.plugins` entry-point group (a shipped
  name is never shadowed by one: an installed package must not change what a shipped recipe runs);
- a module path (`mypkg.envs`): an installed module, else one in the current folder.
The module exports `AgentRunner`; a `:Class` suffix (`mypkg.envs:Maze`, `maze.py:Maze`) names
the class that serves as its `AgentRunner` instead (a module's `__getattr__` may make the class on
demand: `reasoning_gym:chain_sum`), and the class's own `make_dataset` / `eval_dataset` /
`warm_start`, where it has them, replace the module's.

After a shipped plugin's name, everything past the first colon is the name its `__getattr__` gets,
colons and all: `gem:game:Sudoku-v0-easy`, `openenv:http://127.0.0.1:8000`.

`agent.env_kwargs` (a dict) is bound where the plugin is loaded: the `AgentRunner` is constructed
with them, and `make_dataset` / `eval_dataset` get them as keyword arguments, so a task's settings
reach its episodes, its training data and its held-out split alike. `agent.reward` (`NAME:TARGET`)
wraps the `AgentRunner` in the shipped plugin NAME's `rewarded(runner, TARGET)`: another package's
reward in place of the Env's own (`verifiers:mytasks:SumTask`).
"""

import ast
import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

CONF_PACKAGE = "workbench.conf"
PLUGIN_PACKAGE = "workbench.plugins"
ENTRY_POINT_GROUP = "molt_wb.plugins"
# a plugin loaded with `:Class` or with env_kwargs, by its spec and kwargs: the same object every
# time it is asked for
_CLASS_VIEWS: dict[str, types.ModuleType] = {}
# what a `:Class` brings of its own in place of the module's
_CLASS_EXPORTS = ("make_dataset", "eval_dataset", "warm_start")
# what gets agent.env_kwargs besides the AgentRunner
_DATASET_EXPORTS = ("make_dataset", "eval_dataset")


@dataclass
class RegisteredPlugin:
    """One plugin `agent.plugin=NAME` can name, and where it came from."""

    name: str
    # shipped | entry point of <distribution> <version>
    origin: str
    # the module (or module:Class) it loads
    target: str
    # the first line of its module docstring (shipped), or why it is not used
    note: str = ""


def shipped_folder(package: str) -> Path:
    """The folder an installed package of molt-wb's shipped files lives in."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"molt-wb's shipped package {package} is not installed: reinstall molt-wb (`pip "
            f"install -e .` in a checkout, or the wheel)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


# ---- configs


def _user_folder(folder: str) -> Path:
    """A `--config-dir` folder, absolute; refused when it is not a folder."""
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(
            f"--config-dir {folder} is not a folder: give the folder that holds your config "
            f"groups (recipe/NAME.yaml, ...)."
        )
    return path


@contextlib.contextmanager
def hydra_search_path(config_dirs: list[str] | tuple[str, ...] = ()) -> Iterator[None]:
    """Initialise Hydra with the user's config folders ahead of the shipped configs (for
    `hydra.compose` inside the block)."""
    # hydra's own --config-dir builds its search path with these (hydra-core 1.3)
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra

    folders = [_user_folder(folder) for folder in config_dirs]
    search_path = create_config_search_path(f"pkg://{CONF_PACKAGE}")
    # each one before the shipped configs, after the ones given before it: the first given wins
    for folder in folders:
        search_path.prepend("command-line", f"file://{folder}", SearchPathQuery(provider="main"))
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name="molt-wb", config_search_path=search_path)
    try:
        yield
    finally:
        GlobalHydra.instance().clear()


# ---- plugins


def _is_shipped(name: str) -> bool:
    """Whether `name` is a shipped plugin's name (`arith`: plugins/arith.py)."""
    return name.isidentifier() and (shipped_folder(PLUGIN_PACKAGE) / f"{name}.py").exists()


def _split_class(spec: str) -> tuple[str, str | None]:
    """`where:Class` as (where, Class); (spec, None) without a class. After a shipped plugin's name
    the whole rest is the name (`textarena:GuessTheNumber-v0`, `gem:game:Sudoku-v0-easy`)."""
    shipped, colon, rest = spec.partition(":")
    if colon and rest and _is_shipped(shipped):
        return shipped, rest
    where, colon, name = spec.rpartition(":")
    if not colon or not name.isidentifier():
        return spec, None
    return where, name


def _is_file(where: str) -> bool:
    """Whether a plugin spec (without its `:Class`) names a .py file."""
    return where.endswith(".py")


def absolute_plugin(spec: str) -> str:
    """A file-path plugin with its path made absolute (a run folder read from elsewhere, and
    `molt-wb resume` in another folder, find it); any other spec as it is."""
    where, class_name = _split_class(spec)
    if not _is_file(where) or not Path(where).exists():
        return spec
    absolute = str(Path(where).resolve())
    if class_name is None:
        return absolute
    return f"{absolute}:{class_name}"


def _load_file(path: Path) -> types.ModuleType:
    """The module of a .py file, imported once per process under a name its path gives."""
    name = f"molt_wb_plugin_{path.stem}"
    if name not in sys.modules:
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        try:
            loader.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    loaded = Path(sys.modules[name].__file__).resolve()
    if loaded != path.resolve():
        raise ValueError(
            f"Plugin files {loaded} and {path} share a name, and one process imports one module of "
            f"a name: rename one of them."
        )
    return sys.modules[name]


def _entry_points(name: str) -> list[metadata.EntryPoint]:
    """The entry points of the molt_wb.plugins group registered under `name`."""
    return [point for point in metadata.entry_points(group=ENTRY_POINT_GROUP) if point.name == name]


def _names_part_of(missing: str | None, module: str) -> bool:
    """Whether a missing module's name is `module` or a package above it."""
    return missing is not None and (module == missing or module.startswith(f"{missing}."))


def _module_of(where: str, spec: str) -> types.ModuleType:
    """The module `where` names: a file, a shipped plugin, an entry point or a module path."""
    if _is_file(where):
        path = Path(where)
        if not path.exists():
            raise ValueError(f"Agent plugin file {where} does not exist: fix the path.")
        return _load_file(path)
    if "." not in where and (shipped_folder(PLUGIN_PACKAGE) / f"{where}.py").exists():
        return importlib.import_module(f"{PLUGIN_PACKAGE}.{where}")
    points = _entry_points(where) if "." not in where else []
    if len(points) > 1:
        owners = ", ".join(sorted(f"{point.dist.name} ({point.value})" for point in points))
        raise ValueError(
            f"Agent plugin {where!r} is registered by several installed packages, {owners}: "
            f"give agent.plugin as the module path of the one you mean."
        )
    if points:
        return importlib.import_module(points[0].module)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        # a module the plugin imports is missing: that error is the one to show
        if not _names_part_of(error.name, where):
            raise
    # the console script's path lacks the current folder that `python -m` would put first (a Ray
    # actor starts in the driver's folder, with it on its path)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        if not _names_part_of(error.name, where):
            raise
        raise ValueError(
            f"Agent plugin {spec!r} was not found: give agent.plugin as a shipped or registered "
            f"plugin's name (`molt-wb plugins` lists them), a module path importable from this "
            f"folder (mypkg.envs or mypkg.envs:Class) or a .py file's path."
        ) from None


def _runner_class(spec: str, where: str) -> str | None:
    """The `:Class` a spec names, or for a registered name the class its entry point names."""
    _, class_name = _split_class(spec)
    if class_name or _is_file(where) or "." in where:
        return class_name
    if (shipped_folder(PLUGIN_PACKAGE) / f"{where}.py").exists():
        return None
    points = _entry_points(where)
    return points[0].attr if points else None


def _plain(env_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """agent.env_kwargs as a plain dict (Hydra gives a DictConfig)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(env_kwargs, DictConfig):
        return OmegaConf.to_container(env_kwargs, resolve=True)
    return dict(env_kwargs or {})


def _accepts(function: Any, kwargs: dict[str, Any], spec: str, what: str) -> None:
    """Refuse env_kwargs that `function` (a plugin's Env class or dataset maker) does not take."""
    import inspect

    try:
        inspect.signature(function).bind_partial(**kwargs)
    except TypeError as error:
        raise ValueError(
            f"Agent plugin {spec!r}: its {what} does not take agent.env_kwargs "
            f"{sorted(kwargs)} ({error}): give only the keys it accepts, or none."
        ) from None


def _bind(spec: str, view: types.ModuleType, kwargs: dict[str, Any]) -> None:
    """Make the view's AgentRunner construct with `kwargs` and its dataset makers take them."""
    runner = view.AgentRunner
    _accepts(runner, kwargs, spec, runner.__name__)

    def __init__(self: Any) -> None:
        runner.__init__(self, **kwargs)

    # a subclass, so that isinstance/issubclass checks (Env or ChatAgent) still hold
    view.AgentRunner = type(runner.__name__, (runner,), {"__init__": __init__})
    for name in _DATASET_EXPORTS:
        if hasattr(view, name):
            _accepts(getattr(view, name), kwargs, spec, name)
            setattr(view, name, functools.partial(getattr(view, name), **kwargs))


def _rewarded(runner: type, reward: str) -> type:
    """The AgentRunner `runner` scored by `agent.reward` (`NAME:TARGET`) in place of its own
    rewards: the shipped plugin NAME's `rewarded(runner, TARGET)`."""
    name, colon, target = reward.partition(":")
    module = importlib.import_module(f"{PLUGIN_PACKAGE}.{name}") if _is_shipped(name) else None
    if not colon or not target or not hasattr(module, "rewarded"):
        raise ValueError(
            f"agent.reward={reward} names no reward: give it as verifiers:MODULE:TaskClass (a "
            f"verifiers Task whose @vf.reward functions score the episode), or leave it unset."
        )
    return module.rewarded(runner, target)


def load_plugin(
    spec: str, env_kwargs: Mapping[str, Any] | None = None, reward: str | None = None
) -> types.ModuleType:
    """Import the plugin `agent.plugin` names (see this module's docstring for the forms), with
    `agent.env_kwargs` bound to its AgentRunner and dataset makers, and scored by `agent.reward`
    when it is set."""
    where, _ = _split_class(spec)
    module = _module_of(where, spec)
    class_name = _runner_class(spec, where)
    kwargs = _plain(env_kwargs)
    if class_name is None:
        if not hasattr(module, "AgentRunner"):
            raise ValueError(
                f"Agent plugin {spec!r} does not export AgentRunner: add `AgentRunner = YourEnv` "
                f"or name the class as {where}:YourEnv."
            )
        if not kwargs and not reward:
            return module
    elif not hasattr(module, class_name):
        raise ValueError(f"Agent plugin {spec!r}: module {module.__name__} has no {class_name}.")
    key = f"{spec} {sorted(kwargs.items())!r} {reward}"
    # the module's other exports (make_dataset, warm_start) with that class as its AgentRunner
    if key not in _CLASS_VIEWS:
        view = types.ModuleType(module.__name__, module.__doc__)
        view.__dict__.update(vars(module))
        if class_name is not None:
            view.AgentRunner = getattr(module, class_name)
            for name in _CLASS_EXPORTS:
                if hasattr(view.AgentRunner, name):
                    setattr(view, name, getattr(view.AgentRunner, name))
        if kwargs:
            _bind(spec, view, kwargs)
        if reward:
            view.AgentRunner = _rewarded(view.AgentRunner, reward)
        _CLASS_VIEWS[key] = view
    return _CLASS_VIEWS[key]


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, read without importing it."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    return paragraph.split(". ")[0].removesuffix(".")


def registered_plugins() -> list[RegisteredPlugin]:
    """Every plugin that a bare name reaches: the shipped ones, then the entry points."""
    shipped_dir = shipped_folder(PLUGIN_PACKAGE)
    shipped = sorted(path for path in shipped_dir.glob("*.py") if path.stem != "__init__")
    found = [
        RegisteredPlugin(path.stem, "shipped", f"{PLUGIN_PACKAGE}.{path.stem}", _summary(path))
        for path in shipped
    ]
    names = {plugin.name for plugin in found}
    counts: dict[str, int] = {}
    points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name)
    for point in points:
        counts[point.name] = counts.get(point.name, 0) + 1
    for point in points:
        note = ""
        if point.name in names:
            note = (
                f"not used: the shipped {point.name} comes first; give agent.plugin={point.value}"
            )
        elif counts[point.name] > 1:
            note = f"not used: several packages register {point.name}; give its module path"
        origin = f"entry point of {point.dist.name} {point.dist.version}"
        found.append(RegisteredPlugin(point.name, origin, point.value, note))
    return found


def where_found() -> dict[str, str]:
    """Where the shipped configs and plugins were found, and how many plugins entry points add."""
    plugins = registered_plugins()
    shipped = sum(plugin.origin == "shipped" for plugin in plugins)
    return {
        "configs": f"{shipped_folder(CONF_PACKAGE)} (pkg://{CONF_PACKAGE})",
        "plugins": f"{shipped_folder(PLUGIN_PACKAGE)} ({shipped} shipped, "
        f"{len(plugins) - shipped} from the {ENTRY_POINT_GROUP} entry points)",
    }
