#!/usr/bin/env bash
# Issue 47, item 4: the package as a user installs it. `python -m build` makes the sdist and the
# wheel from it; both install without -e into a fresh venv (dependencies from the registry) and run
# from empty folders: --version, doctor, a short train of a shipped recipe, a user's project (a
# recipe found through --config-dir, an environment by its file path) and a plugin an installed
# package registers in the molt_wb.plugins entry-point group. Needs python3 and a reachable registry.
# MOLT_WB_DEPS_VENV=.venv takes the dependencies from that venv instead (faster; molt-wb itself
# still comes from the sdist and the wheel only).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# nothing of the checkout on the path; the suite's model cache (tiny models, warm starts) reused
unset PYTHONPATH
export MOLT_WB_CACHE="${MOLT_WB_CACHE:-$repo/.pytest_cache/molt-wb}"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled WANDB_SILENT=true
short="trainer.steps=1 trainer.prompts_per_step=2 trainer.group_size=2 tracking=none run.progress=false"

echo "== build the sdist, then the wheel from the sdist"
python3 -m venv "$work/tools"
"$work/tools/bin/pip" install -q build
"$work/tools/bin/python" -m build --outdir "$work/dist" "$repo"

echo "== the sdist, installed with its dependencies into a fresh venv, from an empty folder"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --upgrade pip
deps=()
if [[ -n "${MOLT_WB_DEPS_VENV:-}" ]]; then
    # a .pth line puts that venv's site-packages on the path without running its .pth files, so
    # an editable molt-wb installed there stays out
    purelib='import sysconfig; print(sysconfig.get_path("purelib"))'
    site=$("$work/venv/bin/python" -c "$purelib")
    "$MOLT_WB_DEPS_VENV/bin/python" -c "$purelib" > "$site/dependencies.pth"
    deps=(--no-deps)
fi
"$work/venv/bin/pip" install -q "${deps[@]}" "$work"/dist/molt_wb-*.tar.gz
molt_wb="$work/venv/bin/molt-wb"
mkdir "$work/empty_sdist"
(cd "$work/empty_sdist" && "$molt_wb" --version && "$molt_wb" doctor >/dev/null)

echo "== the wheel in its place, from another empty folder"
"$work/venv/bin/pip" install -q --force-reinstall --no-deps "$work"/dist/molt_wb-*.whl
mkdir "$work/empty"
cd "$work/empty"
"$molt_wb" --version
"$molt_wb" doctor | tee "$work/doctor.txt"
# the configs and plugins come from the installed package, not from the checkout
grep -q "^configs *$work/venv/.*/workbench/conf" "$work/doctor.txt"
grep -q "^plugins *$work/venv/.*/workbench/plugins" "$work/doctor.txt"
# shellcheck disable=SC2086
"$molt_wb" train +recipe=arith $short

echo "== a user's project: their recipe through --config-dir, their environment by file path"
mkdir -p "$work/project/conf/recipe"
cd "$work/project"
cat > say_digit.py <<'EOF'
"""Say back the digit asked for: "Say 7." -> "7"."""

import random
import re

from workbench.api import Env, Result


class SayDigit(Env):
    def reset(self, sample: dict) -> str:
        self.digit = sample["answer"]
        return sample["problem"]

    def step(self, action: str) -> Result:
        match = re.search(r"\d", action)
        return Result(reward=float(match is not None and match.group() == self.digit))


def make_dataset(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    digits = [str(rng.randrange(10)) for _ in range(size)]
    return [{"id": i, "problem": f"Say {d}.", "answer": d} for i, d in enumerate(digits)]
EOF
cat > conf/recipe/say_digit.yaml <<'EOF'
# @package _global_
recipe: say_digit
agent:
  plugin: say_digit.py:SayDigit
engine:
  max_tokens: 2
EOF
# shellcheck disable=SC2086
"$molt_wb" train --config-dir conf +recipe=say_digit $short

echo "== a plugin an installed package registers in the molt_wb.plugins entry-point group"
mkdir -p "$work/digits/molt_wb_digits"
cp say_digit.py "$work/digits/molt_wb_digits/__init__.py"
cat > "$work/digits/pyproject.toml" <<'EOF'
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "molt-wb-digits"
version = "0.2.0"

[project.entry-points."molt_wb.plugins"]
digits = "molt_wb_digits:SayDigit"
EOF
"$work/venv/bin/pip" install -q "$work/digits"
cd "$work/empty"
"$molt_wb" plugins | tee "$work/plugins.txt"
grep -q "digits *entry point of molt-wb-digits 0.2.0" "$work/plugins.txt"
# shellcheck disable=SC2086
"$molt_wb" train agent.plugin=digits $short
echo "wheel check passed"
