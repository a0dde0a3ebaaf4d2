"""The token view's `gap cause` channel: each sampled token coloured by the largest part of its
off-policy gap (the `gap_*` columns of the run store), its parts in the side panel; a token whose
gap was not measured, or a run stored before the columns, grey."""

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("textual")
from workbench.store import open_run  # noqa: E402
from workbench.tui.app import InspectApp  # noqa: E402
from workbench.tui.channels import CHANNELS, GAP_PARTS  # noqa: E402
from workbench.tui.token_screen import _style  # noqa: E402

# the shared fixture trains a run first
pytestmark = pytest.mark.slow

# the channel's colour of each part, in GAP_PARTS order
COLOURS = ("yellow", "magenta", "cyan", "green")


def drive(
    app: InspectApp, script: Callable[[Any], Awaitable[Any]], size: tuple[int, int] = (100, 30)
) -> Any:
    """Run `script(pilot)` against the app headless; return what it returns."""

    async def main() -> Any:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            return await script(pilot)

    return asyncio.run(main())


def screen_text(app: InspectApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def rewrite(folder: Path, table: str, change: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite every shard of one table of a run folder through `change(pyarrow table)`."""
    for shard in sorted((folder / table).glob("*.parquet")):
        pq.write_table(change(pq.read_table(shard)), shard)


def gap_by_position(table: pa.Table) -> pa.Table:
    """Every token's parts set so that part `position % 4` is the largest (0.5 against 0.01)."""
    positions = table["position"].to_pylist()
    for index, name in enumerate(GAP_PARTS):
        values = [0.5 if p % 4 == index else -0.01 for p in positions]
        column = f"gap_{name}"
        table = table.drop_columns([column]).append_column(column, pa.array(values, pa.float32()))
    return table


def without_gap(table: pa.Table) -> pa.Table:
    return table.drop_columns([f"gap_{name}" for name in GAP_PARTS])


def open_gap_channel(root: Path, run_id: str) -> dict:
    """The token view of the run's first segment under the gap channel: styles, legend, side."""

    async def script(pilot):
        await pilot.press("2", "enter", "full_stop")
        screen = pilot.app.screen
        for _ in range(list(CHANNELS).index("gap cause")):
            await pilot.press("c")
        return {
            "channel": screen.channel,
            "legend": screen_text(pilot.app).splitlines()[1],
            "styles": [_style(screen.channel, token) for token in screen.tokens],
            "sampled": [t["position"] for t in screen.tokens if t["loss_mask"]],
            "cursor": screen.cursor,
            "side": str(screen.query_one("#side").render()),
        }

    return drive(InspectApp(str(root), run_id), script)


def test_the_real_run_stores_parts_that_sum_to_each_measured_tokens_gap(made_run) -> None:
    root, run_id = made_run
    residual, measured = (
        open_run(run_id, root)
        .execute(
            "select max(abs(train_logprob - behavior_logprob - gap_staleness - gap_routing "
            "- gap_sampler - gap_numerics)), count(gap_numerics) from tokens where loss_mask = 1"
        )
        .fetchone()
    )
    assert measured > 0 and residual < 1e-5


def test_each_sampled_token_takes_the_colour_of_its_largest_gap_part(made_run, tmp_path) -> None:
    root, run_id = made_run
    scored = tmp_path / "scored" / run_id
    old = tmp_path / "old" / run_id
    shutil.copytree(Path(root, run_id), scored)
    shutil.copytree(Path(root, run_id), old)
    rewrite(scored, "tokens", gap_by_position)
    rewrite(old, "tokens", without_gap)
    seen = open_gap_channel(scored.parent, run_id)
    assert seen["channel"] == "gap cause"
    assert all(name in seen["legend"] for name in GAP_PARTS)
    sampled = seen["sampled"]
    assert len({p % 4 for p in sampled}) > 1
    assert [seen["styles"][p] for p in sampled] == [COLOURS[p % 4] for p in sampled]
    assert f"(most: {GAP_PARTS[seen['cursor'] % 4]})" in seen["side"]
    # a run stored before the gap's columns (as a token not measured): no cause to show
    seen = open_gap_channel(old.parent, run_id)
    assert {seen["styles"][p] for p in seen["sampled"]} == {"grey50"}
    assert "gap       " not in seen["side"]
