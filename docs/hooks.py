"""MkDocs hook: adds the generated reference pages (docs/gen/reference.py) to the site at build
time, so the config and store references are never out of date."""

import importlib.util
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

GENERATOR = Path(__file__).resolve().parent / "gen" / "reference.py"


def load_generator():
    """docs/gen/reference.py as a module (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("molt_wb_docs_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add each generated page to the site's files before the nav is built."""
    for path, render in load_generator().PAGES.items():
        files.append(File.generated(config, path, content=render()))
    return files
