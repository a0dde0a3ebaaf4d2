"""GGUF files (llama.cpp's format) as ordinary Hugging Face checkpoint folders.

transformers reads a GGUF file (with the `gguf` package, the `gguf` extra): the tokenizer, the
chat template and the weights, de-quantised to float32. The model it loads is flagged as
quantised and refuses `save_pretrained`, so the conversion builds the same architecture from its
config with the flag dropped, loads the de-quantised state dict into it and saves that: a plain
float32 folder every actor (and vLLM) loads by path in well under a second, converted once per
file into the model cache.
"""

import hashlib
import sys
from pathlib import Path

from workbench.models.tiny import built_into, cache_root, one_builder

# bump when the conversion's output changes: a new cache folder, never a stale one
CONVERTER_VERSION = 1


def converted_path(gguf_file: str | Path) -> Path:
    """The model-cache folder that holds (or will hold) the conversion of `gguf_file`; named by
    its file name, size and modification time, so an edited file converts again."""
    source = Path(gguf_file).resolve()
    stat = source.stat()
    key = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{source.stem}-gguf-{digest}"


def converted(gguf_file: str | Path, target: Path | None = None) -> Path:
    """The Hugging Face folder converted from `gguf_file` (into `target`, else the model cache),
    built on the first call; later calls return it at once. Safe under concurrent callers."""
    source = Path(gguf_file)
    if not source.is_file():
        raise ValueError(f"{source} is not a file: give the path of a .gguf file.")
    target = target or converted_path(source)
    if (target / "config.json").exists():
        return target
    with one_builder(target):
        if (target / "config.json").exists():
            return target
        _say(f"converting {source.name} to a float32 Hugging Face folder (once) ...")
        tokenizer, model = load(source)
        with built_into(target) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    _say(f"converted into {target}")
    return target


def load(gguf_file: Path) -> tuple:
    """The tokenizer and a float32 causal LM read from `gguf_file`, the model rebuilt from its
    config without the GGUF quantisation flag (so it saves like any model)."""
    # torch and transformers load here: config and the CLI import this module for its names only
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as error:
        # an architecture or quantisation transformers cannot read, or no GGUF at all
        raise ValueError(
            f"transformers cannot read {gguf_file} as a causal LM ({error}): give a GGUF file of "
            f"an architecture transformers supports (llama, qwen2, mistral, ...)."
        ) from None
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return tokenizer, model


def _say(line: str) -> None:
    """One progress line on stderr (stdout may be a command's output)."""
    print(f"molt-wb: {line}", file=sys.stderr, flush=True)
