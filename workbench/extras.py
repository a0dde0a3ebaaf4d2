"""The optional extras of pyproject.toml: the modules each brings, whether they import here, and the
one sentence that refuses a feature switched on without its extra.

A bare `pip install -e .` trains, lists runs, compares them and runs `doctor`; each extra adds one
feature, and no module imports an extra's package unless that feature is on. Config validation
(`config.validate`) and the commands that need an extra (`inspect`, `tune`, `compare --plot`) ask
here before they start anything.
"""

import functools
import importlib.util
import json
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote

# extra (pyproject.toml's [project.optional-dependencies], but `test`) -> the top-level modules it
# installs that molt-wb, its benches or its docs build import; `bench`'s psutil is left out: Ray
# ships its own copy on every install
EXTRAS: dict[str, tuple[str, ...]] = {
    "lora": ("peft",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),
    "plot": ("matplotlib",),
    "tui": ("textual", "textual_plotext", "textual_image"),
    "tune": ("optuna",),
    "vllm": ("vllm",),
    "bench": ("trl",),
    "docs": ("mkdocs",),
    "gguf": ("gguf",),
    "envs": ("textarena", "openenv", "reasoning_gym"),
    # what verifiers imports; verifiers itself (and gem-llm) go in with --no-deps beside it, their
    # pins clash with hydra's and the SDKs' (docs/bring-your-env.md)
    "verifiers": ("verifiers",),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # a parent package that is absent, or a module whose __spec__ is unset
        return False


def missing(extra: str) -> list[str]:
    """The modules of `extra` that do not import in this environment (none: the extra is here)."""
    return [module for module in EXTRAS[extra] if not _importable(module)]


@functools.cache
def _source() -> str:
    """What pip installs molt-wb from here, for `install`: "-e ." in a clone (its package sits
    beside its pyproject.toml), the folder or file a package was installed from (PEP 610's
    direct_url.json), else the registry's name."""
    if (Path(__file__).resolve().parent.parent / "pyproject.toml").is_file():
        return "-e ."
    try:
        direct = metadata.distribution("molt-wb").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        direct = None
    url = json.loads(direct or "{}").get("url", "")
    if url.startswith("file://"):
        return unquote(url.removeprefix("file://"))
    return "molt-wb"


def install(extra: str) -> str:
    """The command that installs `extra`: into a clone's environment (`pip install -e
    '.[lora]'`), or beside an installed package, from where it came."""
    source = _source()
    if source == "-e .":
        return f"pip install -e '.[{extra}]'"
    return f"pip install '{source}[{extra}]'"


def needs(feature: str, extra: str) -> str:
    """The one sentence that refuses `feature` without `extra`."""
    return f"{feature} needs the {extra} extra: {install(extra)}."
