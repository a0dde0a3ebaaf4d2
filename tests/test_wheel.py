"""The built package works from any folder, as a researcher who installs molt-wb meets it.

Built once (`python -m build`: the sdist, then the wheel from the sdist), installed without `-e`
into a fresh venv, and run from an empty folder: `--version`, `doctor`, `plugins`, a shipped
recipe, and the project of docs/your-project.md: its recipe found through `--config-dir`, its
environment by file path, then by the name its package registers in the `molt_wb.plugins`
entry-point group.

The fresh venv reads its dependencies from this test's environment through a .pth line (a .pth
line adds a folder to the path without running that folder's .pth files, so the editable molt-wb
finder there never loads): molt-wb itself comes from the wheel only. `.ci/wheel_check.sh` installs
the wheel with its dependencies from the registry.
"""

import json
import os
import re
import shlex
import site
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# one short step of a small batch: these tests prove the install, not learning
SHORT = [
    "trainer.steps=1",
    "trainer.prompts_per_step=2",
    "trainer.group_size=2",
    "tracking=none",
    "run.progress=false",
]
# the "Your own project" page: its files and its train commands are the ones run here
PAGE = REPO / "docs" / "your-project.md"
FILE_BLOCK = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```', re.MULTILINE | re.DOTALL)


def page_files() -> dict[str, str]:
    """The page's file blocks (```python title="say_digit.py"), by file name."""
    return dict(FILE_BLOCK.findall(PAGE.read_text()))


def page_train_commands() -> list[list[str]]:
    """The page's `molt-wb train` lines, as arguments after `molt-wb`."""
    lines = PAGE.read_text().splitlines()
    return [shlex.split(line)[1:] for line in lines if line.startswith("molt-wb train ")]


def write_project(folder: Path) -> None:
    """The page's project: its environment and its recipe."""
    files = page_files()
    for name in ("say_digit.py", "conf/recipe/say_digit.yaml"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(files[name])


@dataclass
class Install:
    """A fresh venv with the wheel installed, and the artifacts it came from."""

    venv: Path
    wheel: Path
    sdist: Path
    site_packages: Path

    def molt_wb(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        """Run the installed console script in `cwd`, with nothing of the checkout on its path."""
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        return subprocess.run(
            [str(self.venv / "bin" / "molt-wb"), *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )


def run(*command: str | Path, cwd: Path | None = None) -> str:
    """Run a build or install step; its output on failure."""
    result = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def pip_into(venv: Path, *args: str | Path) -> None:
    """This environment's pip, installing into `venv` (offline: nothing comes from the registry)."""
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", *args)


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    # offline: the build backend of this environment, no isolated download of setuptools
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO)
    wheel = next(dist.glob("*.whl"))
    sdist = next(dist.glob("*.tar.gz"))
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    purelib = run(
        venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"
    )
    site_packages = Path(purelib.strip())
    (site_packages / "test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip_into(venv, "--no-deps", wheel)
    # the page's package (mypkg/envs.py: the environment), built with this environment's
    # setuptools, as a user's would be
    project = root / "mypkg_project"
    (project / "mypkg").mkdir(parents=True)
    (project / "pyproject.toml").write_text(page_files()["pyproject.toml"])
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "envs.py").write_text(page_files()["say_digit.py"])
    pip_into(venv, "--no-deps", "--no-build-isolation", project)
    return Install(venv, wheel, sdist, site_packages)


def finished_run(folder: Path) -> dict:
    """The one run under `folder/runs`: its run.json, which must say finished."""
    (run_json,) = (folder / "runs").glob("*/run.json")
    row = json.loads(run_json.read_text())
    assert row["status"] == "finished", row
    return row


def test_the_wheel_and_the_sdist_carry_the_configs_plugins_and_license(install: Install) -> None:
    names = zipfile.ZipFile(install.wheel).namelist()
    assert "workbench/conf/config.yaml" in names
    assert "workbench/conf/recipe/arith.yaml" in names
    assert "workbench/plugins/arith.py" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    top = install.sdist.name.removesuffix(".tar.gz")
    members = set(tarfile.open(install.sdist).getnames())
    for path in ("LICENSE", "conf/recipe/arith.yaml", "plugins/arith.py", "setup.py"):
        assert f"{top}/{path}" in members


def test_version_is_the_package_metadata(install: Install, tmp_path: Path) -> None:
    result = install.molt_wb("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"molt-wb {metadata.version('molt-wb')}"


def test_doctor_finds_configs_and_plugins_inside_the_installed_package(
    install: Install, tmp_path: Path
) -> None:
    result = install.molt_wb("doctor", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if " " in line)
    assert lines["configs"].startswith(str(install.site_packages / "workbench" / "conf"))
    assert lines["plugins"].startswith(str(install.site_packages / "workbench" / "plugins"))
    assert "1 from the molt_wb.plugins entry points" in lines["plugins"]
    # an extra this environment lacks is installed from where molt-wb came, not as in a clone
    assert f"vllm extra   missing (pip install '{install.wheel}[vllm]')" in result.stdout
    assert "pip install -e" not in result.stdout


def test_plugins_lists_the_shipped_ones_and_the_entry_point_with_its_package(
    install: Install, tmp_path: Path
) -> None:
    result = install.molt_wb("plugins", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "shipped" in rows["arith"] and "workbench.plugins.arith" in rows["arith"]
    assert "entry point of mypkg 0.1.0" in rows["say_digit"]
    assert "mypkg.envs:SayDigit" in rows["say_digit"]


@pytest.mark.slow
def test_a_shipped_recipe_trains_from_an_empty_folder(install: Install, tmp_path: Path) -> None:
    result = install.molt_wb("train", "+recipe=arith", *SHORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    row = finished_run(tmp_path)
    assert row["recipe"] == "arith"
    # no checkout to describe: the run says which release made it
    assert row["code_version"] == f"molt-wb {metadata.version('molt-wb')}"


@pytest.mark.slow
def test_the_pages_user_project_trains_through_config_dir_and_a_file_plugin(
    install: Install, tmp_path: Path
) -> None:
    write_project(tmp_path)
    command = page_train_commands()[0]
    assert command == ["train", "--config-dir", "conf", "+recipe=say_digit"]
    result = install.molt_wb(*command, *SHORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert finished_run(tmp_path)["recipe"] == "say_digit"
    # the plugin's path as the run folder keeps it: absolute, so it is found from anywhere
    (config,) = (tmp_path / "runs").glob("*/config.yaml")
    assert f"plugin: {tmp_path / 'say_digit.py'}:SayDigit" in config.read_text()


@pytest.mark.slow
def test_the_pages_package_trains_by_the_name_its_entry_point_registers(
    install: Install, tmp_path: Path
) -> None:
    write_project(tmp_path)
    command = page_train_commands()[-1]
    assert "agent.plugin=say_digit" in command
    result = install.molt_wb(*command, *SHORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (config,) = (tmp_path / "runs").glob("*/config.yaml")
    assert "plugin: say_digit\n" in config.read_text()
    finished_run(tmp_path)
