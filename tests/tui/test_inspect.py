"""`molt-wb inspect` driven headless (Textual's Pilot) on a run made by the real loop: every screen,
the main key paths, values and colours checked against the store itself."""

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

pytest.importorskip("textual")
from textual.widgets import DataTable  # noqa: E402

from workbench import cli  # noqa: E402
from workbench.store import open_run  # noqa: E402
from workbench.store.schema import FAILED_EPISODES, METRICS  # noqa: E402
from workbench.tui import data as tui_data  # noqa: E402
from workbench.tui.app import InspectApp  # noqa: E402
from workbench.tui.channels import CHANNELS  # noqa: E402
from workbench.tui.data import Filter  # noqa: E402
from workbench.tui.run_screen import RunScreen  # noqa: E402
from workbench.tui.token_screen import SegmentImage, TokenScreen, _style  # noqa: E402

# the shared fixture trains a run first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_ray")]


def screen_text(app) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def token_styles(screen) -> list[str]:
    """The style of every token of a token view under its channel (the cursor's not included)."""
    return [_style(screen.channel, token) for token in screen.tokens]


def drive(app, script, size=(100, 30)):
    """Run `script(pilot)` against the app headless; return what it returns."""

    async def main():
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            return await script(pilot)

    return asyncio.run(main())


def tree_digest(folder: str) -> str:
    return hashlib.sha256(
        b"".join(
            p.name.encode() + p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()
        )
    ).hexdigest()


def test_the_runs_screen_lists_runs_newest_first_and_filters_by_sweep(made_run):
    root, run_id = made_run

    async def script(pilot):
        table = pilot.app.screen.query_one("#runs", DataTable)
        ids = [table.get_row_at(i)[0] for i in range(table.row_count)]
        await pilot.press("s", *"sweep-tui")
        await pilot.pause()
        swept = [table.get_row_at(i)[0] for i in range(table.row_count)]
        text = screen_text(pilot.app)
        await pilot.press("escape", "enter")
        await pilot.pause()
        return ids, swept, pilot.app.screen, text

    ids, swept, screen, text = drive(InspectApp(root), script)
    assert ids == [run_id, "20000101-000000-5eed"]  # the copy is an hour older
    assert swept == ["20000101-000000-5eed"] and "sweep-tui-test" in text
    assert isinstance(screen, RunScreen) and screen.data.run["run_id"] == "20000101-000000-5eed"


def test_overview_shows_headline_numbers_plots_and_config(made_run):
    root, run_id = made_run
    db = open_run(run_id, root)
    segments, tokens = db.execute("select count(*), sum(num_tokens) from segments").fetchone()

    async def script(pilot):
        before = screen_text(pilot.app)
        pilot.app.screen.query_one("Collapsible").collapsed = False
        await pilot.pause()
        return before, screen_text(pilot.app), pilot.app.screen.query_one("#plot-reward-mean").plt

    before, expanded, _ = drive(InspectApp(root, run_id), script)
    assert (
        f"segments {segments}" in before
        and f"tokens {tokens}" in before
        and "status finished" in before
    )
    assert "steps 3/3" in before and "reward/mean" in before and "▶ resolved config" in before
    assert '"tiny-moe"' in expanded and '"tiny-moe"' not in before


def test_segments_filters_match_sql_counts_and_sorting_and_paging_work(made_run, monkeypatch):
    root, run_id = made_run
    db = open_run(run_id, root)
    total = db.execute("select count(*) from segments").fetchone()[0]
    dropped = db.execute(
        "select count(*) from gate_decisions where decision = 'dropped'"
    ).fetchone()[0]
    prompt = db.execute(
        "select prompt_text from segments order by step, rollout_id limit 1"
    ).fetchone()[0]
    question = prompt.split("\n")[1].split("<")[0]  # "What is 1 + 3?"
    same_question = db.execute(
        "select count(*) from segments where prompt_text ilike ?", [f"%{question}%"]
    ).fetchone()[0]
    longest = db.execute("select max(num_tokens) from segments").fetchone()[0]
    tenth = db.execute(
        "select rollout_id from segments order by step, rollout_id, segment_idx limit 1 offset 10"
    ).fetchone()[0]
    # the fixture gives the filters something to do
    assert 0 < dropped < total and 0 < same_question < total
    monkeypatch.setattr(tui_data, "PAGE", 10)
    monkeypatch.setattr("workbench.tui.run_screen.PAGE", 10)

    async def script(pilot):
        screen = pilot.app.screen
        seen = {}
        table = screen.query_one("#segments-table", DataTable)
        status = lambda: str(screen.query_one("#segments-status").render())  # noqa: E731
        await pilot.press("2")
        seen["header"] = next(
            line for line in screen_text(pilot.app).splitlines() if "rollout_id" in line
        )
        seen["first"] = status()
        seen["rows"] = table.row_count
        await pilot.press("right_square_bracket")
        seen["page2"] = status()
        seen["page2_first"] = table.get_row_at(0)[1]
        await pilot.press(*["right_square_bracket"] * 3)
        seen["last"] = status()
        await pilot.press(*["left_square_bracket"] * 3)
        await pilot.press("d")
        seen["dropped"] = (status(), {table.get_row_at(i)[6] for i in range(table.row_count)})
        await pilot.press("d", "slash", *"reward>=0.5")
        seen["reward"] = table.row_count
        screen.query_one("#filter").value = question
        await pilot.pause()
        seen["text"] = status()
        screen.query_one("#filter").value = ""
        await pilot.pause()
        # the num_tokens header
        x = sum(c.get_render_width(table) for c in list(table.columns.values())[:4])
        await pilot.click("#segments-table", offset=(x + 2, 0))
        await pilot.pause()
        seen["sorted"] = (status(), int(table.get_row_at(0)[4]))
        await pilot.press("o")
        seen["next_sort"] = status()
        return seen

    seen = drive(InspectApp(root, run_id), script)
    assert seen["header"].split()[:5] == [
        "step",
        "rollout_id",
        "segment_idx",
        "reward",
        "num_tokens",
    ]
    assert seen["first"].startswith(f"rows 1-10 of {total}") and seen["rows"] == 10
    assert seen["page2"].startswith(f"rows 11-20 of {total}") and int(seen["page2_first"]) == tenth
    # ] past the end stays
    assert seen["last"].startswith(f"rows {(total - 1) // 10 * 10 + 1}-{total} of {total}")
    assert seen["dropped"][0].startswith(f"rows 1-{min(dropped, 10)} of {dropped}") and seen[
        "dropped"
    ][1] == {"dropped"}
    assert "only dropped" in seen["dropped"][0]
    assert (
        seen["reward"]
        == db.execute("select count(*) from segments where reward >= 0.5").fetchone()[0]
    )
    assert seen["text"].startswith(f"rows 1-{min(same_question, 10)} of {same_question}")
    assert "sort num_tokens ↓" in seen["sorted"][0] and seen["sorted"][1] == longest
    assert "sort versions ↑" in seen["next_sort"]


def test_token_view_shows_pieces_values_and_colours_of_a_known_segment(made_run):
    root, run_id = made_run
    db = open_run(run_id, root)
    step, rollout, segment, prompt, spans, turn_rewards = db.execute(
        "select step, rollout_id, segment_idx, prompt_text, turn_spans, turn_rewards from segments "
        "order by step, rollout_id limit 1"
    ).fetchone()
    first_sampled = spans[0][0]
    token_id, behavior, train, version, advantage, turn = db.execute(
        "select token_id, behavior_logprob, train_logprob, behavior_version, advantage, turn "
        "from tokens "
        "where step = ? and rollout_id = ? and segment_idx = ? and position = ?",
        [step, rollout, segment, first_sampled],
    ).fetchone()

    async def script(pilot):
        seen = {}
        await pilot.press("2", "enter")
        screen = pilot.app.screen
        seen["screen"] = screen
        seen["key"] = screen.segment_key
        seen["open"] = screen_text(pilot.app)
        await pilot.press("full_stop")  # the first sampled token
        seen["cursor"] = screen.cursor
        seen["side"] = str(screen.query_one("#side").render())
        seen["styles"] = token_styles(screen)
        seen["rendered"] = screen.text
        for _ in range(3):
            # behavior logprob -> δ -> IS weight -> version
            await pilot.press("c")
        seen["version_channel"] = screen.channel
        seen["version_styles"] = token_styles(screen)
        seen["legend"] = screen_text(pilot.app).splitlines()[1]
        seen["image panel"] = screen.query_one("#images").display
        seen["images"] = list(screen.query(SegmentImage))
        await pilot.press("escape")
        seen["back"] = pilot.app.screen
        return seen

    seen = drive(InspectApp(root, run_id), script)
    assert isinstance(seen["screen"], TokenScreen) and seen["key"] == (step, rollout, segment)
    question = prompt.split("\n")[1].split("<")[0]
    assert "<|im_start|>user↵" in seen["open"] and question in seen["open"]
    assert seen["cursor"] == first_sampled
    assert f"id        {token_id}" in seen["side"] and f"behavior  {behavior:.4f}" in seen["side"]
    assert (
        f"train     {train:.4f}" in seen["side"]
        and f"δ         {train - behavior:+.4f}" in seen["side"]
    )
    # the episode's first turn, and its reward: the ChatAgent's, at its last (here only) turn
    assert turn == 0 and f"turn      1 (reward {turn_rewards[0]:.4g})" in seen["side"]
    assert f"advantage {advantage:+.4f}" in seen["side"]
    # tiny-moe: 3 sparse layers, replay agrees
    assert "routing   L0✓ L1✓ L2✓" in seen["side"]
    # colour of the known token under the logprob channel, by hand: p < .1 red, < .5 orange,
    # < .9 yellow, else green
    if behavior < -2.3:
        expected = "red"
    elif behavior < -0.69:
        expected = "dark_orange"
    elif behavior < -0.105:
        expected = "yellow"
    else:
        expected = "green"
    assert seen["styles"][first_sampled] == expected and seen["styles"][0] == "dim"
    # the cursor on it
    assert any(span.style == f"{expected} reverse" for span in seen["rendered"].spans)
    # step 0: on-policy
    assert seen["version_channel"] == "version"
    assert seen["version_styles"][first_sampled] == "green"
    assert "channel version" in seen["legend"] and "on-policy" in seen["legend"]
    # a text-only segment: no image panel
    assert seen["image panel"] is False and seen["images"] == []
    assert isinstance(seen["back"], RunScreen)


def cell(strips, x: int, y: int):
    """The one segment drawn at cell (x, y) of a screen's strips."""
    (segment,) = list(strips[y].crop(x, x + 1))
    return segment


def test_a_vision_language_segment_shows_its_own_image_in_cells_of_the_images_colours(
    painted_vl_run,
):
    root, run_id, quadrants = painted_vl_run
    step, rollout, segment, images = (
        open_run(run_id, root)
        .execute(
            "select step, rollout_id, segment_idx, images from segments "
            "order by step, rollout_id limit 1"
        )
        .fetchone()
    )

    async def script(pilot):
        await pilot.press("2", "enter")
        await pilot.pause()
        screen = pilot.app.screen
        widgets = [(widget.image, widget.content_region) for widget in screen.query(SegmentImage)]
        strips = screen._compositor.render_strips()
        return screen.segment_key, widgets, strips

    key, widgets, strips = drive(InspectApp(root, run_id), script)
    assert key == (step, rollout, segment) and len(images) == 1
    ((image, area),) = widgets
    assert Path(image) == Path(root, run_id, "images", images[0]).resolve()
    # headless, textual-image would draw grey shades: half-block cells instead
    assert area.width >= 20 and area.height >= 10
    rows = [strip.crop(area.x, area.right).text for strip in strips[area.y : area.bottom]]
    assert rows == ["▀" * area.width] * area.height
    # the middle of each quadrant: both halves of the cell in that quadrant's colour
    for index, colour in enumerate(quadrants):
        x = area.x + area.width * (1 + 2 * (index % 2)) // 4
        y = area.y + area.height * (1 + 2 * (index // 2)) // 4
        style = cell(strips, x, y).style
        assert style.color.triplet == style.bgcolor.triplet == colour, (index, x, y)


def test_a_stale_segment_is_coloured_by_version_and_gate_and_request_rows_jump_to_their_segment(
    made_run,
):
    root, run_id = made_run
    db = open_run(run_id, root)
    gate_rows = db.execute("select count(*) from gate_decisions").fetchone()[0]
    first = db.execute(
        "select step, rollout_id, segment_idx, decision from gate_decisions "
        "order by step, rollout_id limit 1"
    ).fetchone()
    stale = db.execute(
        "select step, rollout_id, segment_idx, learner_version - min_version from segments "
        "where learner_version > min_version order by step, rollout_id limit 1"
    ).fetchone()

    async def script(pilot):
        await pilot.press("3")
        table = pilot.app.screen.query_one("#gate-table", DataTable)
        rows = table.row_count
        cells = table.get_row_at(0)
        await pilot.press("enter")
        gate_key = pilot.app.screen.segment_key
        await pilot.press("escape", "4")
        requests = pilot.app.screen.query_one("#requests-table", DataTable)
        requests = (requests.row_count, requests.get_row_at(0)[2])
        await pilot.press("enter")
        request_key = pilot.app.screen.segment_key
        await pilot.press("escape")
        pilot.app.push_screen(TokenScreen(pilot.app.screen.data, *stale[:3]))
        await pilot.pause()
        for _ in range(3):
            await pilot.press("c")
        return rows, cells, gate_key, requests, request_key, pilot.app.screen

    rows, cells, gate_key, requests, request_key, token_screen = drive(
        InspectApp(root, run_id), script
    )
    assert rows == gate_rows and gate_key == first[:3] and first[3] in cells
    assert requests[0] == db.execute("select count(*) from requests").fetchone()[0] > 0
    rollout = db.execute("select rollout_id from requests order by time limit 1").fetchone()[0]
    assert (
        int(requests[1]) == rollout
        and request_key
        == db.execute(
            "select step, rollout_id, segment_idx from segments "
            "where rollout_id = ? order by segment_idx",
            [rollout],
        ).fetchone()
    )
    sampled = [i for i, t in enumerate(token_screen.tokens) if t["loss_mask"]]
    assert {token_styles(token_screen)[i] for i in sampled} == {
        "yellow" if stale[3] == 1 else "red"
    }


def test_help_quit_and_an_80x24_terminal(made_run):
    root, run_id = made_run

    async def script(pilot):
        await pilot.press("question_mark")
        help_text = screen_text(pilot.app)
        await pilot.press("escape", "2", "enter", "full_stop")
        small = screen_text(pilot.app)
        await pilot.press("q")
        return help_text, small, pilot.app.is_running

    help_text, small, running = drive(InspectApp(root, run_id), script, size=(80, 24))
    assert "molt-wb inspect — keys" in help_text and "c channel" in help_text
    lines = small.splitlines()
    assert len(lines) == 24 and all(len(line) <= 80 for line in lines)
    # side panel and footer fit
    assert any("IS weight" in line for line in lines) and "Channel" in lines[-1]
    assert not running


def test_text_snapshots_of_key_screens_at_80x24(made_run):
    root, run_id = made_run
    prompt, length = (
        open_run(run_id, root)
        .execute("select prompt_text, num_tokens from segments order by step, rollout_id limit 1")
        .fetchone()
    )

    async def script(pilot):
        shots = [screen_text(pilot.app)]
        await pilot.press("2")
        shots.append(screen_text(pilot.app))
        await pilot.press("enter")
        shots.append(screen_text(pilot.app))
        return [shot.splitlines() for shot in shots]

    overview, segments, tokens = drive(InspectApp(root, run_id), script, size=(80, 24))
    assert overview[0].strip() == f"⭘                     run {run_id} — arith".strip()
    assert overview[1].rstrip() == " 1 Overview  2 Segments  3 Gate  4 Requests  5 Failures"
    assert overview[3].startswith("status finished  steps 3/3  segments 24  tokens ")
    assert (
        segments[5].rstrip()
        == " step  rollout_id  segment_idx  reward  num_tokens  versions  decision  seal_r"
    )
    assert segments[6].split()[:3] == ["0", "0", "0"] and segments[-1].startswith(
        " 1 Overview  2 Segments  3 Gate"
    )
    assert tokens[1].rstrip() == "channel behavior logprob  prompt/env  ■ p<.1 ■ p<.5 ■ p<.9 ■ p≥.9"
    user, question, assistant = (line.split("│")[0].rstrip() for line in tokens[2:5])
    assert (user, question, assistant) == (
        "<|im_start|>user↵",
        prompt.split("\n")[1] + "↵",
        "<|im_start|>assistant↵",
    )
    assert (
        tokens[2].split("│")[1].strip() == f"token 1/{length}"
        and tokens[3].split("│")[1].strip() == "id        1"
    )


def test_the_app_reads_the_store_read_only_and_follows_a_live_run(made_run, tmp_path):
    root, run_id = made_run
    before = tree_digest(root)
    live = tmp_path / run_id
    shutil.copytree(
        Path(root) / run_id,
        live,
        ignore=shutil.ignore_patterns("part-000002.parquet", "part-000001.parquet"),
    )
    row = json.loads((live / "run.json").read_text())
    (live / "run.json").write_text(json.dumps({**row, "status": "running", "steps_done": 1}))
    total = open_run(run_id, root).execute("select count(*) from segments").fetchone()[0]

    async def script(pilot):
        status = lambda: str(pilot.app.screen.query_one("#segments-status").render())  # noqa: E731
        headline = lambda: str(pilot.app.screen.query_one("#headline").render())  # noqa: E731
        early_headline = headline()
        await pilot.press("2")
        early = status()
        for name in ("segments", "tokens", "gate_decisions", "routing", "metrics", "requests"):
            for shard in (Path(root) / run_id / name).glob("part-00000[12].parquet"):
                shutil.copy(shard, live / name / shard.name)
        (live / "run.json").write_text(json.dumps(row))
        for _ in range(50):
            await pilot.pause(0.1)
            if status() != early:
                break
        return early, status(), early_headline, headline()

    early, late, early_headline, late_headline = drive(
        InspectApp(str(tmp_path), run_id, poll=0.2), script
    )
    assert not early.endswith(f"of {total} · sort step ↑") and late.startswith(
        f"rows 1-{total} of {total}"
    )
    assert (
        "status running  steps 1/3" in early_headline
        and "status finished  steps 3/3" in late_headline
    )
    assert tree_digest(root) == before


def test_inspect_command_errors_are_one_sentence(made_run, monkeypatch):
    root, run_id = made_run
    result = CliRunner().invoke(cli.app, ["inspect", run_id[:-1] + "x", "--root", root])
    assert (
        result.exit_code == 2
        and f"No run '{run_id[:-1]}x' under {root}/. Close matches: {run_id}" in result.output
    )
    # as if textual were not installed
    monkeypatch.setitem(__import__("sys").modules, "textual", None)
    result = CliRunner().invoke(cli.app, ["inspect", "--root", root])
    assert result.exit_code == 2 and "pip install -e '.[tui]'" in result.output


@pytest.mark.parametrize(
    "line, expected",
    [
        ("dropped reward>=0.5 What is", Filter(dropped=True, reward_min=0.5, text="What is")),
        ("mismatch reward<1", Filter(mismatch=True, reward_max=1.0)),
        ("", Filter()),
    ],
)
def test_filter_words_parse(line, expected):
    assert Filter.parse(line) == expected


def test_failed_episodes_tab_lists_failures_and_shows_the_highlighted_ones_traceback(
    made_run, tmp_path
):
    """Issue 10: a user's exception is shown with its traceback in the TUI, not lost in a worker
    log."""
    root, run_id = made_run
    shutil.copytree(Path(root) / run_id, tmp_path / run_id)
    rows = [
        {
            "run_id": run_id,
            "step": 1,
            "rollout_id": 40 + i,
            "group_id": 10,
            "worker": 0,
            "kind": "env_error",
            "error": f"ZeroDivisionError: episode {i}",
            "traceback": f"Traceback (most recent call last):\n  marker-{i}\n",
            "time": 1.0 + i,
        }
        for i in range(2)
    ]
    (tmp_path / run_id / "failed_episodes").mkdir(exist_ok=True)
    pq.write_table(
        pa.Table.from_pylist(rows, schema=FAILED_EPISODES),
        tmp_path / run_id / "failed_episodes" / "part-000000.parquet",
    )

    async def script(pilot):
        await pilot.press("5")
        await pilot.pause()
        table = pilot.app.screen.query_one("#failures-table")
        await pilot.press("down")
        await pilot.pause()
        return (
            table.row_count,
            [str(c.label) for c in table.columns.values()],
            str(pilot.app.screen.query_one("#failures-traceback").render()),
        )

    count, columns, traceback = drive(InspectApp(str(tmp_path), run_id), script)
    assert (
        count == 2
        and "traceback" not in columns
        and {"kind", "error", "rollout_id"} <= set(columns)
    )
    assert "marker-1" in traceback and "marker-0" not in traceback


def test_a_lora_runs_token_view_names_its_versions_adapter_versions(made_run, tmp_path):
    root, run_id = made_run
    shutil.copytree(Path(root, run_id), tmp_path / run_id)
    row = json.loads((tmp_path / run_id / "run.json").read_text())
    row["config"]["model"]["lora"] = {"rank": 8}
    (tmp_path / run_id / "run.json").write_text(json.dumps(row))

    async def script(pilot):
        await pilot.press("2", "enter", "full_stop")
        return str(pilot.app.screen.query_one("#side").render())

    side = drive(InspectApp(str(tmp_path), run_id), script)
    assert "adapter   0 (learner 0)" in side and "version   " not in side


def rewrite(folder: Path, table: str, change) -> None:
    """Rewrite every shard of one table of a run folder through `change(pyarrow table)`."""
    for shard in sorted((folder / table).glob("*.parquet")):
        pq.write_table(change(pq.read_table(shard)), shard)


def without_entropy(table: pa.Table) -> pa.Table:
    return table.drop_columns([name for name in table.column_names if name == "entropy"])


# one entropy per bin of the channel, by position: green, yellow, dark_orange, red
ENTROPIES = (0.05, 0.3, 1.0, 2.0)
BINS = ("green", "yellow", "dark_orange", "red")


def test_the_entropy_channel_and_plot_show_stored_entropies_and_a_run_stored_without_them(
    made_run, tmp_path
):
    root, run_id = made_run
    scored = tmp_path / "scored" / run_id
    old = tmp_path / "old" / run_id
    shutil.copytree(Path(root, run_id), scored)
    shutil.copytree(Path(root, run_id), old)

    def by_position(table: pa.Table) -> pa.Table:
        values = [ENTROPIES[position % 4] for position in table["position"].to_pylist()]
        return without_entropy(table).append_column("entropy", pa.array(values, pa.float32()))

    rewrite(scored, "tokens", by_position)
    metrics = {
        "run_id": [run_id] * 3,
        "step": [0, 1, 2],
        "key": ["policy/entropy"] * 3,
        "value": [0.9, 0.7, 0.4],
        "time": [0.0] * 3,
    }
    pq.write_table(pa.table(metrics, schema=METRICS), scored / "metrics" / "part-999999.parquet")
    # the run as stored before the columns and the metric existed
    rewrite(old, "tokens", lambda table: without_entropy(table).drop_columns(["turn"]))
    rewrite(old, "segments", lambda table: table.drop_columns(["turn_rewards"]))
    rewrite(
        old, "metrics", lambda table: table.filter(pc.not_equal(table["key"], "policy/entropy"))
    )

    async def script(pilot):
        plot = pilot.app.screen.query_one("#plot-policy-entropy").plt.monitor
        seen = {"title": plot.title, "curve": plot.y}
        await pilot.press("2", "enter", "full_stop")
        screen = pilot.app.screen
        for _ in range(list(CHANNELS).index("entropy")):
            await pilot.press("c")
        seen["channel"] = screen.channel
        seen["legend"] = screen_text(pilot.app).splitlines()[1]
        seen["styles"] = token_styles(screen)
        seen["sampled"] = [t["position"] for t in screen.tokens if t["loss_mask"]]
        seen["cursor"] = screen.cursor
        seen["side"] = str(screen.query_one("#side").render())
        return seen

    seen = drive(InspectApp(str(scored.parent), run_id), script)
    curve = open_run(run_id, str(scored.parent)).execute(
        "select avg(value) from metrics where key = 'policy/entropy' group by step order by step"
    )
    assert seen["title"] == "policy/entropy" and seen["curve"] == [[v for (v,) in curve.fetchall()]]
    assert seen["channel"] == "entropy" and "≥1.5 nats" in seen["legend"]
    # each sampled token in its entropy's bin, by hand; the rest dim
    sampled = seen["sampled"]
    assert len({position % 4 for position in sampled}) == 4
    assert [seen["styles"][p] for p in sampled] == [BINS[p % 4] for p in sampled]
    assert seen["styles"][0] == "dim"
    assert f"entropy   {ENTROPIES[seen['cursor'] % 4]:.4f}" in seen["side"]

    seen = drive(InspectApp(str(old.parent), run_id), script)
    assert seen["title"] == "policy/entropy (not recorded)"
    # opens; its sampled tokens grey under the channel, no entropy or turn in the side panel
    assert {seen["styles"][p] for p in seen["sampled"]} == {"grey50"}
    assert "IS weight" in seen["side"] and "entropy" not in seen["side"]
    assert "turn " not in seen["side"]
