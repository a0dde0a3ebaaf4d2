"""One run made by the real loop, shared by every TUI test: the arith task as a ChatAgent (so
loopback requests are recorded), a tiny MoE policy (so routing rows exist), async depth 1 with a
seq gate at max staleness 0 (so stale segments are dropped), three steps. And one step of the geo3k
recipe, for a vision-language run's images."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RUN = [
    "+recipe=arith",
    "agent.plugin=chat_minimal",
    "model=tiny-moe",
    "trainer.steps=3",
    "trainer.async_depth=1",
    "gate.level=seq",
    "gate.max_staleness=0",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=2",
    "trainer.group_size=4",
]


@pytest.fixture(scope="session")
def made_run(tmp_path_factory, ray_head):
    """(root, run_id) of the real run, plus a copy tagged with a sweep id (for the runs screen's
    sweep filter)."""
    root = tmp_path_factory.mktemp("tui-runs")
    run_id = train(root, ray_head, *RUN)
    copy = root / "20000101-000000-5eed"
    shutil.copytree(root / run_id, copy)
    row = json.loads((copy / "run.json").read_text())
    row.update(run_id=copy.name, sweep_id="sweep-tui-test", created=row["created"] - 3600)
    (copy / "run.json").write_text(json.dumps(row))
    return str(root), run_id


def train(root, ray_address: str, *overrides: str) -> str:
    """Run `molt-wb train` into `root`, joined to the Ray at `ray_address`; the run id."""
    result = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "train", *overrides, f"run.root={root}"],
        env=dict(os.environ, RAY_ADDRESS=ray_address),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (run_id,) = [p.name for p in root.iterdir()]
    return run_id


@pytest.fixture(scope="session")
def vl_run(tmp_path_factory, ray_head):
    """(root, run_id) of one geo3k step on the tiny vision-language policy, two segments of one
    image (~30 s)."""
    root = tmp_path_factory.mktemp("tui-vl-runs")
    overrides = [
        "+recipe=geo3k",
        "trainer.steps=1",
        "trainer.prompts_per_step=1",
        "trainer.group_size=2",
        "model.warm_start_steps=0",
        "tracking=none",
        "run.progress=false",
    ]
    return str(root), train(root, ray_head, *overrides)


# the colours of a repainted image's quadrants: top left, top right, bottom left, bottom right
QUADRANTS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255))


@pytest.fixture(scope="session")
def painted_vl_run(vl_run, tmp_path_factory):
    """(root, run_id, QUADRANTS) of a copy of the vision-language run whose image files are
    repainted in four flat quadrants, so that a terminal's cells can be checked against them."""
    from PIL import Image

    root, run_id = vl_run
    copy = tmp_path_factory.mktemp("tui-vl-painted") / run_id
    shutil.copytree(Path(root, run_id), copy)
    for path in (copy / "images").iterdir():
        size = Image.open(path).size
        half = (size[0] // 2, size[1] // 2)
        painted = Image.new("RGB", size, QUADRANTS[3])
        for index, colour in enumerate(QUADRANTS[:3]):
            corner = (half[0] * (index % 2), half[1] * (index // 2))
            painted.paste(colour, (*corner, corner[0] + half[0], corner[1] + half[1]))
        painted.save(path, format="PNG")
    return str(copy.parent), run_id, QUADRANTS
