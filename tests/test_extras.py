"""Every optional extra is optional: with the extras' packages hidden from every process (Ray's
workers too), as on a bare `pip install -e .`, the main commands run, and a feature switched on
without its extra is refused at start-up in one sentence naming the extra to install."""

import csv
import io
import os
import site
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from workbench.extras import EXTRAS

# every module an extra brings, as the bare install lacks them
HIDDEN = sorted(module for modules in EXTRAS.values() for module in modules)
SHORT_RUN = [
    "+recipe=arith",
    "trainer.steps=1",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python that sees this environment with the extras' modules absent: a venv whose one .pth
    file adds this environment's site-packages and marks those modules as not importable
    (`sys.modules[name] = None`: `import` raises ModuleNotFoundError, `find_spec` says None). Ray
    starts its workers with the driver's interpreter, so they run without the extras too."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    adds = "; ".join(f"site.addsitedir({path!r})" for path in sites)
    prelude = f"import site, sys; {adds}; sys.modules.update(dict.fromkeys({HIDDEN!r}))\n"
    (venv / "lib" / version / "site-packages" / "bare.pth").write_text(prelude)
    return str(venv / "bin" / "python")


def molt_wb(python: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`molt-wb ARGS` run by `python` (in `cwd`: its default run root is `cwd/runs`)."""
    return subprocess.run(
        [python, "-m", "workbench.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
    )


def test_every_extra_of_pyproject_is_known_to_doctor_and_the_refusals() -> None:
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"]) - {"test"}
    assert extras == set(EXTRAS)


def test_the_bare_python_lacks_every_extra_and_nothing_else(bare_python: str) -> None:
    code = (
        "import importlib.util as u, sys;"
        "import torch, transformers, ray, duckdb, hydra, wandb, typer, workbench.cli;"
        f"print(sorted(m for m in {HIDDEN!r} if u.find_spec(m) is None))"
    )
    result = subprocess.run([bare_python, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == repr(HIDDEN)


def test_help_and_doctor_work_and_doctor_lists_each_extra_as_missing(bare_python: str) -> None:
    help_text = molt_wb(bare_python, "--help")
    assert help_text.returncode == 0 and "train" in help_text.stdout
    doctor = molt_wb(bare_python, "doctor")
    assert doctor.returncode == 0, doctor.stderr
    for extra in EXTRAS:
        line = f"{extra + ' extra':<12} missing (pip install -e '.[{extra}]')"
        assert line in doctor.stdout.splitlines()


def test_doctor_lists_each_installed_extra_as_present() -> None:
    doctor = molt_wb(sys.executable, "doctor")
    # the test extra installs these (not vllm, bench)
    for extra in ("lora", "mlflow", "plot", "tui", "tune", "docs", "gguf"):
        assert f"{extra + ' extra':<12} present" in doctor.stdout.splitlines()


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (
            ["train", "+recipe=arith", "model.lora.rank=8"],
            "model.lora.rank=8 needs the lora extra: pip install -e '.[lora]'.",
        ),
        (
            ["train", "+recipe=geo3k", "model.lora.rank=4"],
            "model.lora.rank=4 needs the lora extra: pip install -e '.[lora]'.",
        ),
        (
            ["train", "+recipe=arith", "tracking.mlflow.enabled=true"],
            "tracking.mlflow.enabled=true needs the mlflow extra: pip install -e '.[mlflow]'.",
        ),
        (["tune", "+recipe=arith"], "molt-wb tune needs the tune extra: pip install -e '.[tune]'."),
        (["inspect"], "molt-wb inspect needs the tui extra: pip install -e '.[tui]'."),
        (
            ["compare", "run-x", "--plot", "x.png"],
            "compare --plot needs the plot extra: pip install -e '.[plot]'.",
        ),
    ],
)
def test_a_feature_without_its_extra_is_refused_in_one_sentence_naming_it(
    bare_python: str, tmp_path: Path, args: list[str], sentence: str
) -> None:
    result = molt_wb(bare_python, *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == f"error: {sentence}\n"


def test_a_pretrained_model_with_no_copy_held_is_refused_without_the_gguf_extra(
    bare_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an empty model cache: the registry's GGUF would have to be converted
    monkeypatch.setenv("MOLT_WB_CACHE", str(tmp_path / "cache"))
    result = molt_wb(bare_python, "train", "+recipe=arith", "model=smollm2-135m", cwd=tmp_path)
    assert result.returncode == 2
    sentence = (
        "model=smollm2-135m (converted from GGUF) needs the gguf extra: pip install -e '.[gguf]'."
    )
    assert result.stderr == f"error: {sentence}\n"


def test_export_merged_of_a_lora_run_without_its_extra_is_refused_before_it_writes(
    bare_python: str, tmp_path: Path
) -> None:
    run = tmp_path / "runs" / "lora"
    run.mkdir(parents=True)
    (run / "run.json").write_text("{}")
    # a LoRA checkpoint's policy is its PEFT adapter folder
    policy = run / "checkpoints" / "step-000002" / "policy"
    policy.mkdir(parents=True)
    (policy / "adapter_config.json").write_text("{}")
    out = tmp_path / "merged"
    result = molt_wb(bare_python, "export", "lora", "2", str(out), "--merged", cwd=tmp_path)
    assert result.returncode == 2
    sentence = "export --merged of a LoRA run needs the lora extra: pip install -e '.[lora]'."
    assert result.stderr == f"error: {sentence}\n"
    assert not out.exists()


def test_engine_vllm_without_its_extra_names_the_install(bare_python: str, tmp_path: Path) -> None:
    result = molt_wb(bare_python, "train", "+recipe=arith", "engine=vllm", cwd=tmp_path)
    assert result.returncode == 2
    assert "pip install -e '.[vllm]'" in result.stderr and "Traceback" not in result.stderr


def test_the_main_recipes_config_validates_without_any_extra(bare_python: str) -> None:
    code = "from workbench.config import compose_config; compose_config(['+recipe=geo3k'])"
    result = subprocess.run([bare_python, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_train_runs_and_compare_csv_work_without_any_extra(
    bare_python: str, tmp_path: Path
) -> None:
    root = str(tmp_path / "runs")
    train = molt_wb(bare_python, "train", *SHORT_RUN, f"run.root={root}", "run.id=bare")
    assert train.returncode == 0, train.stderr
    assert "reward" in train.stdout
    runs = molt_wb(bare_python, "runs", "--root", root)
    assert runs.returncode == 0 and "bare" in runs.stdout
    compare = molt_wb(bare_python, "compare", "bare", "--root", root, "--csv")
    assert compare.returncode == 0, compare.stderr
    [row] = csv.DictReader(io.StringIO(compare.stdout))
    assert row["run_id"] == "bare"
