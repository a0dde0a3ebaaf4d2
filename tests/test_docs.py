"""The docs say what the code does: the plugin pages' code blocks run as written, the generated
references cover every config key and store column, the site builds strictly offline, and the
README stays short, dated nowhere, with the two set-up commands CI runs."""

import asyncio
import dataclasses
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.api import ChatContext, Result, load_plugin

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README = REPO / "README.md"
# the pages whose every code block a test runs
PLUGIN_PAGES = ("environments.md", "chat-agents.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# a block that opens with `# NAME.py` is that file's whole text
FILE_HEADER = re.compile(r"# ([\w-]+\.py)\n")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
CLOCK = re.compile(r"\b\d{1,2}:\d\d\b")


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return FENCE.findall(text)


def page_blocks(page: str) -> list[tuple[str, str]]:
    return code_blocks((DOCS / page).read_text())


def write_files(blocks: list[tuple[str, str]], folder: Path) -> list[str]:
    """Write the blocks that are files (`# NAME.py` first) into `folder`; their names."""
    names = []
    for language, code in blocks:
        header = FILE_HEADER.match(code)
        if language == "python" and header:
            (folder / header.group(1)).write_text(code)
            names.append(header.group(1))
    return names


def load_reference():
    """docs/gen/reference.py, the generator of the reference pages."""
    spec = importlib.util.spec_from_file_location("docs_reference", DOCS / "gen" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the plugin pages' code blocks


@pytest.mark.parametrize("page", PLUGIN_PAGES)
def test_every_code_block_on_a_plugin_page_is_python_or_bash(page):
    blocks = page_blocks(page)
    assert blocks
    assert {language for language, _ in blocks} <= {"python", "bash"}


def test_the_environment_pages_blocks_run_in_order_and_step_the_envs(tmp_path, monkeypatch):
    blocks = page_blocks("environments.md")
    files = write_files(blocks, tmp_path)
    assert files == ["my_env.py", "calc_env.py"]
    monkeypatch.chdir(tmp_path)
    namespace = {}
    ran = 0
    for language, code in blocks:
        if language == "python" and not FILE_HEADER.match(code):
            # the "try it by hand" blocks: load_plugin the files and step them, asserting
            exec(compile(code, "environments.md", "exec"), namespace)
            ran += 1
    assert ran == 2
    # each file is a plugin the loader accepts, and its Env earns a reward from a sample
    for name in files:
        plugin = load_plugin(name)
        env = plugin.AgentRunner()
        env.reset({"problem": "What is 1 + 2?", "answer": 3})
        assert isinstance(env.step("3"), Result)


@pytest.fixture(scope="module")
def loopback(tiny_path, tokenizer):
    """A real loopback server on the tiny model's torch engine."""
    from workbench.engines.base import SamplingParams
    from workbench.engines.torch_engine import TorchEngine
    from workbench.server.loopback import LoopbackServer

    engine = TorchEngine(tiny_path)
    params = SamplingParams(max_tokens=8, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))
    server = LoopbackServer(engine, tokenizer, params, seed=0)
    yield server
    server.stop()


def run_episode(agent_class: type, server, sample: dict, rollout_id: int):
    """One episode of a ChatAgent on its own session, as a rollout worker runs it: its Result
    and the session's segments."""
    session = server.open_session(rollout_id)
    ctx = ChatContext(
        base_url=session["openai_base_url"],
        anthropic_base_url=session["anthropic_base_url"],
        api_key=session["api_key"],
        model="policy",
        prompt=sample["problem"],
        label=sample["answer"],
        sample=sample,
        max_tokens=8,
        temperature=1.0,
    )
    result = agent_class().run(ctx)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    segments, requests = server.close_session(session["session"])
    return result, segments, requests


def test_the_chat_agent_pages_agents_run_against_a_loopback_server(tmp_path, monkeypatch, loopback):
    blocks = page_blocks("chat-agents.md")
    files = write_files(blocks, tmp_path)
    assert files == ["my_agent.py", "sure_agent.py"]
    monkeypatch.chdir(tmp_path)
    calls = {"my_agent.py": 1, "sure_agent.py": 2}
    for rollout_id, name in enumerate(files):
        plugin = load_plugin(name)
        sample = plugin.make_dataset(1, 0)[0]
        result, segments, requests = run_episode(plugin.AgentRunner, loopback, sample, rollout_id)
        assert isinstance(result, Result) and result.reward in (0.0, 1.0)
        # every call went through the server, and the policy's tokens were recorded
        assert len(requests) == calls[name]
        assert sum(int(sum(s.loss_mask)) for s in segments) > 0
    assert load_plugin("sure_agent.py").AgentRunner is not None


def bash_commands() -> list[tuple[str, str]]:
    """(page, command) of every bash block on the plugin pages."""
    return [
        (page, code.strip())
        for page in PLUGIN_PAGES
        for language, code in page_blocks(page)
        if language == "bash"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "command"), bash_commands())
def test_the_plugin_pages_train_commands_run_as_written(page, command, tmp_path):
    write_files(page_blocks(page), tmp_path)
    environment = dict(os.environ)
    environment["PATH"] = str(Path(sys.executable).parent) + os.pathsep + environment["PATH"]
    done = subprocess.run(
        shlex.split(command), cwd=tmp_path, env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finished: 2/2 steps" in done.stdout + done.stderr


# ---- generated references


def test_the_config_reference_lists_every_key_with_its_docstring():
    reference = load_reference()
    page = reference.config_page()
    keys = [key["key"] for key in reference.config_keys()]
    assert {"seed", "trainer.async_depth", "model.lora.rank", "tracking.wandb.mode"} <= set(keys)
    for key in keys:
        assert f"`{key}`" in page
    assert all(key["doc"] for key in reference.config_keys())
    # every preset under conf/
    for preset in (REPO / "conf").glob("*/*.yaml"):
        assert f"| `{preset.parent.name}` | `{preset.stem}` |" in page


def test_a_config_key_without_a_docstring_stops_the_reference():
    reference = load_reference()

    @dataclasses.dataclass
    class Undocumented:
        documented: int = 1
        """What it does."""
        bare: int = 2

    with pytest.raises(reference.ReferenceError, match="Config key x.bare has no docstring"):
        reference.config_keys(Undocumented, "x.")


def test_the_store_reference_describes_every_column_of_every_table():
    from workbench.store.schema import TABLES

    page = load_reference().store_page()
    for name, schema in TABLES.items():
        assert f"## `{name}`" in page
        for column in schema.names:
            assert f"| `{column}` |" in page


def test_a_store_column_without_a_description_stops_the_reference(monkeypatch):
    import pyarrow as pa

    from workbench.store import schema

    reference = load_reference()
    widened = schema.METRICS.append(pa.field("unit", pa.string()))
    monkeypatch.setitem(schema.TABLES, "metrics", widened)
    with pytest.raises(reference.ReferenceError, match="metrics.unit has no description"):
        reference.store_page()


def test_the_site_builds_strictly_offline(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)]
    # Material's banner about MkDocs 2 is not a warning of this site's
    environment = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(mkdocs, cwd=REPO, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("reference/config/index.html", "reference/store/index.html", "api/index.html"):
        assert (tmp_path / page).exists()
    # the plugin API is rendered from its docstrings
    assert "One episode of an environment" in (tmp_path / "api" / "index.html").read_text()


# ---- the README


def test_the_readme_is_short_and_opens_with_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    commands = [code.strip() for language, code in code_blocks(text) if language == "bash"][:2]
    assert commands == [
        "apt-get update && apt-get install -y bubblewrap  # the jail for model-written code (sudo "
        "unless root)\npython3 -m venv .venv && . .venv/bin/activate && pip install -e . "
        "&& molt-wb train +recipe=geo3k",
        "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'\npip install "
        "--no-deps gem-llm==0.1.0 verifiers==0.4.0  # pins clash with hydra's and the SDKs'\n"
        "python -m pytest -q -n 2 --dist loadfile",
    ]


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("**/*.md"))], ids=lambda p: p.name)
def test_prose_holds_no_dates_or_clock_times(path):
    # code blocks may hold run ids and timestamps; prose may not
    prose = FENCE.sub("", path.read_text())
    assert not DATE.findall(prose), f"{path.name}: a date in prose"
    assert not CLOCK.findall(prose), f"{path.name}: a clock time in prose"


def test_the_readmes_docs_index_links_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", README.read_text())
    assert links
    for link in links:
        assert (REPO / link).exists(), link


def test_the_built_site_is_ignored_by_git():
    assert "site/" in (REPO / ".gitignore").read_text().splitlines()
