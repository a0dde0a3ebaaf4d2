"""Where configs and plugins are found: a user's config folders ahead of the shipped ones, and
every form of `agent.plugin` (shipped name, entry point, module path, file path, `:Class`).

Entry points are registered the way an installed package registers them: a `.dist-info` folder
with an `entry_points.txt`, on the path."""

import sys
from pathlib import Path

import pytest

from workbench.config import ConfigError, compose_config
from workbench.locate import load_plugin, registered_plugins

ENV = """
from workbench.api import Env, Result


class Echo(Env):
    def reset(self, sample):
        return sample["problem"]

    def step(self, action):
        return Result(reward=1.0)


def make_dataset(size, seed):
    return [{"id": i, "problem": "Say 1.", "answer": "1"} for i in range(size)]
"""


def recipe(folder: Path, name: str, recipe_name: str) -> None:
    """Write conf/recipe/NAME.yaml under `folder`, setting `recipe: recipe_name`."""
    (folder / "recipe").mkdir(parents=True, exist_ok=True)
    (folder / "recipe" / f"{name}.yaml").write_text(f"# @package _global_\nrecipe: {recipe_name}\n")


def register(folder: Path, distribution: str, **points: str) -> None:
    """An installed package `distribution` registering `name = target` in molt_wb.plugins."""
    info = folder / f"{distribution}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in points.items())
    (info / "entry_points.txt").write_text(f"[molt_wb.plugins]\n{lines}")


def test_a_user_config_folder_wins_a_name_clash_and_adds_its_own_recipes(tmp_path: Path) -> None:
    recipe(tmp_path, "arith", "mine")
    recipe(tmp_path, "fresh", "fresh")
    assert compose_config(["+recipe=arith"], [str(tmp_path)]).recipe == "mine"
    assert compose_config(["+recipe=fresh", "model=small"], [str(tmp_path)]).recipe == "fresh"
    # the shipped recipe, without the folder
    assert compose_config(["+recipe=arith"]).recipe == "arith"


def test_the_first_config_folder_given_wins(tmp_path: Path) -> None:
    recipe(tmp_path / "a", "same", "from_a")
    recipe(tmp_path / "b", "same", "from_b")
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    assert compose_config(["+recipe=same"], folders).recipe == "from_a"


def test_a_config_folder_that_does_not_exist_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--config-dir .*nowhere is not a folder"):
        compose_config([], [str(tmp_path / "nowhere")])


def test_a_recipe_of_ones_own_without_its_folder_says_to_give_it() -> None:
    with pytest.raises(ConfigError, match="give its folder with --config-dir"):
        compose_config(["+recipe=not_shipped"])


def test_a_shipped_name_loads_the_installed_module() -> None:
    assert load_plugin("arith").__name__ == "workbench.plugins.arith"


def test_a_file_path_and_a_named_class_in_it(tmp_path: Path) -> None:
    (tmp_path / "echo_file.py").write_text(ENV)
    plugin = load_plugin(f"{tmp_path / 'echo_file.py'}:Echo")
    assert plugin.AgentRunner.__name__ == "Echo"
    assert len(plugin.make_dataset(3, 0)) == 3
    # without the class, the module must export AgentRunner
    with pytest.raises(ValueError, match="does not export AgentRunner"):
        load_plugin(str(tmp_path / "echo_file.py"))
    with pytest.raises(ValueError, match="has no Missing"):
        load_plugin(f"{tmp_path / 'echo_file.py'}:Missing")


def test_a_module_path_is_found_in_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_pkg").mkdir()
    (tmp_path / "echo_pkg" / "__init__.py").write_text("")
    (tmp_path / "echo_pkg" / "envs.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    # as under the console script: the current folder is not on the path
    monkeypatch.setattr(
        sys, "path", [path for path in sys.path if path not in ("", ".", str(tmp_path))]
    )
    assert load_plugin("echo_pkg.envs:Echo").AgentRunner.__name__ == "Echo"


def test_a_file_plugin_is_kept_with_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_kept.py").write_text(ENV)
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(["agent.plugin=echo_kept.py:Echo"])
    assert cfg.agent.plugin == f"{tmp_path / 'echo_kept.py'}:Echo"


def test_an_unknown_plugin_names_every_form_it_could_take() -> None:
    with pytest.raises(ValueError, match="molt-wb plugins.*mypkg.envs:Class.*file's path"):
        load_plugin("no_such_plugin_anywhere")


def test_an_entry_point_registers_a_plugin_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_registered.py").write_text(ENV)
    register(tmp_path, "echo-dist", echo_by_name="echo_registered:Echo")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_plugin("echo_by_name").AgentRunner.__name__ == "Echo"
    (row,) = [plugin for plugin in registered_plugins() if plugin.name == "echo_by_name"]
    assert (row.origin, row.target, row.note) == (
        "entry point of echo-dist 1.0",
        "echo_registered:Echo",
        "",
    )


def test_an_entry_point_never_shadows_a_shipped_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "echo_shadow.py").write_text(ENV)
    register(tmp_path, "shadow-dist", arith="echo_shadow:Echo")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_plugin("arith").__name__ == "workbench.plugins.arith"
    (row,) = [
        plugin for plugin in registered_plugins() if plugin.origin.endswith("shadow-dist 1.0")
    ]
    assert row.note.startswith("not used: the shipped arith comes first")


def test_a_name_two_packages_register_is_refused_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    register(tmp_path, "first-dist", twice="first_mod:Echo")
    register(tmp_path, "second-dist", twice="second_mod:Echo")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="registered by several.*first-dist.*second-dist"):
        load_plugin("twice")


def test_a_recipe_without_its_package_header_says_what_its_first_line_must_be(
    tmp_path: Path,
) -> None:
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "headless.yaml").write_text("# a comment first\nrecipe: headless\n")
    with pytest.raises(ConfigError, match="first line must be `# @package _global_`"):
        compose_config(["+recipe=headless"], [str(tmp_path)])


def test_two_plugin_files_of_one_name_are_refused_naming_both(tmp_path: Path) -> None:
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same_stem.py").write_text(ENV)
    load_plugin(f"{tmp_path / 'one' / 'same_stem.py'}:Echo")
    with pytest.raises(ValueError, match="share a name.*rename one"):
        load_plugin(f"{tmp_path / 'two' / 'same_stem.py'}:Echo")
