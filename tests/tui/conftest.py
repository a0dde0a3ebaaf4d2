"""One run made by the real loop, shared by every TUI test: the arith task as a ChatAgent (so
loopback requests are recorded), a tiny MoE policy (so routing rows exist), async depth 1 with a
seq gate at max staleness 0 (so stale segments are dropped), three steps."""

import json
import shutil
import subprocess
import sys

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
def made_run(tmp_path_factory):
    """(root, run_id) of the real run, plus a copy tagged with a sweep id (for the runs screen's
    sweep filter)."""
    root = tmp_path_factory.mktemp("tui-runs")
    result = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "train", *RUN, f"run.root={root}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (run_id,) = [p.name for p in root.iterdir()]
    copy = root / "20000101-000000-5eed"
    shutil.copytree(root / run_id, copy)
    row = json.loads((copy / "run.json").read_text())
    row.update(run_id=copy.name, sweep_id="sweep-tui-test", created=row["created"] - 3600)
    (copy / "run.json").write_text(json.dumps(row))
    return str(root), run_id
