"""`molt-wb inspect`: a Textual app over one run folder (or all of them), read-only and live.

Screens: runs (filterable by sweep) → run (overview · segments · gate · requests · failures tabs) → token
view of one segment, where every sampled token is coloured by a chosen channel.
"""

from __future__ import annotations

import json
import math

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import (
    Collapsible,
    DataTable,
    Footer,
    Header,
    Input,
    Static,
    TabbedContent,
    TabPane,
)
from textual_plotext import PlotextPlot

from workbench.tui.data import PAGE, PLOTS, SEGMENT_COLUMNS, Filter, RunData, read_runs

# channel: (value of a sampled token, [(upper bound, colour, legend)]); a token takes the first bin its value is below
CHANNELS = {
    "behavior logprob": (
        lambda t: t["behavior_logprob"],
        [
            (-2.3, "red", "p<.1"),
            (-0.69, "dark_orange", "p<.5"),
            (-0.105, "yellow", "p<.9"),
            (math.inf, "green", "p≥.9"),
        ],
    ),
    "δ train−behavior": (
        lambda t: abs(t["train_logprob"] - t["behavior_logprob"]),
        [
            (0.01, "green", "|δ|<.01"),
            (0.1, "yellow", "<.1"),
            (0.5, "dark_orange", "<.5"),
            (math.inf, "red", "≥.5"),
        ],
    ),
    "IS weight": (
        lambda t: abs(t["is_weight"] - 1),
        [
            (0.01, "green", "≈1"),
            (0.1, "yellow", "±.1"),
            (0.5, "dark_orange", "±.5"),
            (math.inf, "red", "far/0"),
        ],
    ),
    "version": (
        lambda t: t["staleness"],
        [(0.5, "green", "on-policy"), (1.5, "yellow", "1 behind"), (math.inf, "red", "≥2 behind")],
    ),
    "routing": (
        lambda t: len(t["mismatched_layers"]),
        [(0.5, "green", "same experts"), (math.inf, "red", "mismatch")],
    ),
}
TOKEN_FIELDS = (
    "position",
    "token_id",
    "loss_mask",
    "behavior_logprob",
    "train_logprob",
    "behavior_version",
    "is_weight",
)
HELP = """[b]molt-wb inspect[/b] — keys
runs:     enter open · s sweep filter · q quit
run:      1 overview · 2 segments · 3 gate · 4 requests · 5 failures · esc back
segments: enter token view · / filter · d only dropped · m only mismatches
          o or a click on a header: sort · ] [ next/previous page
          filter words: dropped  mismatch  reward>=0.5  reward<1  any text
token:    ← → token · home end · . next sampled · c channel · n p segment
          prompt/env tokens dim; ▸ ◂ a sampled turn; ▣ image
everywhere: ? help · q quit"""


def colour(channel: str, token: dict) -> str:
    value_of, bins = CHANNELS[channel]
    value = value_of(token)
    return next(c for bound, c, _ in bins if value < bound)


def visible(piece: str) -> str:
    """A token's text as it may be drawn: newlines kept (after a ↵), other control characters escaped."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in piece).replace(
        "\n", "↵\n"
    )


class Help(ModalScreen):
    BINDINGS = [("escape,question_mark,q", "app.pop_screen", "Close")]

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")


class RunsScreen(Screen):
    BINDINGS = [
        Binding("s", "focus('#sweep')", "Sweep filter"),
        Binding("escape", "focus('#runs')", "Table", show=False),
    ]

    def compose(self) -> ComposeResult:
        yield Header()
        yield Input(self.app.sweep, placeholder="sweep id filter (s)", id="sweep")
        yield DataTable(id="runs", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(
            "id", "recipe", "status", "steps", "reward", "created", "sweep"
        )
        self.load()
        self.set_interval(self.app.poll, self.load)
        self.query_one(DataTable).focus()

    def load(self, *_) -> None:
        import datetime

        table, sweep = self.query_one(DataTable), self.query_one(Input).value.strip()
        rows = [r for r in read_runs(self.app.root) if sweep in (r.get("sweep_id") or "")]
        if rows == getattr(self, "shown", None):
            return
        self.shown, cursor = rows, table.cursor_row
        table.clear()
        for r in rows:
            reward = r.get("reward_mean")
            table.add_row(
                r["run_id"],
                str(r.get("recipe") or "-"),
                r.get("status", "?"),
                f"{r.get('steps_done', 0)}/{r.get('steps', '?')}",
                "-" if reward is None else f"{reward:.3f}",
                datetime.datetime.fromtimestamp(r.get("created", 0)).strftime("%m-%d %H:%M"),
                r.get("sweep_id") or "",
                key=r["run_id"],
            )
        table.move_cursor(row=cursor)
        self.sub_title = f"{len(rows)} runs under {self.app.root}" + (
            f" · sweep ~ {sweep}" if sweep else ""
        )

    on_input_changed = load

    def on_input_submitted(self) -> None:
        self.query_one(DataTable).focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.app.push_screen(RunScreen(RunData(event.row_key.value, self.app.root)))


class RunScreen(Screen):
    BINDINGS = [
        Binding("1", "tab('overview')", "Overview"),
        Binding("2", "tab('segments')", "Segments"),
        Binding("3", "tab('gate')", "Gate"),
        Binding("4", "tab('requests')", "Requests"),
        Binding("5", "tab('failures')", "Failures"),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("d", "toggle('dropped')", "Dropped"),
        Binding("m", "toggle('mismatch')", "Mismatch"),
        Binding("o", "next_sort", "Sort"),
        Binding("right_square_bracket", "page(1)", "Page", key_display="]"),
        Binding("left_square_bracket", "page(-1)", show=False),
        Binding("escape", "back", "Back"),
    ]

    def __init__(self, data: RunData):
        super().__init__()
        self.data, self.filter, self.sort, self.descending = data, Filter(), "step", False
        self.offsets = {"segments": 0, "gate": 0, "requests": 0, "failures": 0}

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(initial="overview"):
            with TabPane("1 Overview", id="overview"), VerticalScroll():
                yield Static(id="headline")
                with Collapsible(title="resolved config", collapsed=True):
                    yield Static(json.dumps(self.data.run.get("config"), indent=1), id="config")
                for key in PLOTS:
                    yield PlotextPlot(id="plot-" + key.replace("/", "-"), classes="plot")
            with TabPane("2 Segments", id="segments"):
                yield Input(
                    placeholder="filter: dropped mismatch reward>=0.5 text (/)", id="filter"
                )
                yield Static(id="segments-status", classes="status")
                yield DataTable(id="segments-table", cursor_type="row", zebra_stripes=True)
            for name, title in (
                ("gate", "3 Gate"),
                ("requests", "4 Requests"),
                ("failures", "5 Failures"),
            ):
                with TabPane(title, id=name):
                    yield Static(id=f"{name}-status", classes="status")
                    yield DataTable(id=f"{name}-table", cursor_type="row", zebra_stripes=True)
                    if name == "failures":
                        yield Static(id="failures-traceback")
        yield Footer()

    def on_mount(self) -> None:
        self.title, self.sub_title = (
            f"run {self.data.run['run_id']}",
            str(self.data.run.get("recipe") or ""),
        )
        table = self.query_one("#segments-table", DataTable)
        for column in SEGMENT_COLUMNS:
            table.add_column(column, key=column)
        self.load()
        self.set_interval(self.app.poll, self.poll)

    def poll(self) -> None:
        if self.data.refresh():
            self.load()

    def load(self) -> None:
        headline = self.data.headline()
        self.query_one("#headline", Static).update(
            "  ".join(
                f"[b]{k}[/b] {v:.4g}"
                if isinstance(v, float)
                else f"[b]{k}[/b] {'-' if v is None else v}"
                for k, v in headline.items()
            )
        )
        for key in PLOTS:
            plot, points = (
                self.query_one("#plot-" + key.replace("/", "-"), PlotextPlot),
                self.data.series(key),
            )
            plot.plt.clear_data()
            plot.plt.title(key + ("" if points else " (not recorded)"))
            if points:
                plot.plt.plot([p[0] for p in points], [p[1] for p in points], marker="braille")
            plot.refresh()
        self.load_segments()
        for name, table in (
            ("gate", "gate_decisions"),
            ("requests", "requests"),
            ("failures", "failed_episodes"),
        ):
            columns, rows = self.data.page(table, self.offsets[name])
            self.fill(self.query_one(f"#{name}-table", DataTable), columns, rows)
            hint = (
                "the highlighted episode's traceback below"
                if name == "failures"
                else "enter opens the segment"
            )
            self.query_one(f"#{name}-status", Static).update(
                f"rows {self.offsets[name] + bool(rows)}-{self.offsets[name] + len(rows)} · {hint} · ] [ page"
            )

    def load_segments(self) -> None:
        count = self.data.segment_count(self.filter)
        rows = self.data.segment_page(
            self.filter, self.offsets["segments"], self.sort, self.descending
        )
        self.fill(self.query_one("#segments-table", DataTable), None, rows)
        first = self.offsets["segments"] + 1 if rows else 0
        self.query_one("#segments-status", Static).update(
            f"rows {first}-{self.offsets['segments'] + len(rows)} of {count} · sort {self.sort} {'↓' if self.descending else '↑'}"
            + (" · only dropped" if self.filter.dropped else "")
            + (" · only mismatches" if self.filter.mismatch else "")
        )

    @staticmethod
    def fill(table: DataTable, columns, rows) -> None:
        cursor = table.cursor_row
        table.clear(columns=columns is not None)
        for column in columns or []:
            table.add_column(column, key=column)
        for row in rows:
            table.add_row(
                *(f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v) for v in row)
            )
        table.move_cursor(row=cursor)

    def action_tab(self, name: str) -> None:
        self.query_one(TabbedContent).active = name
        self.query_one(f"#{name}-table" if name != "overview" else VerticalScroll).focus()

    def action_filter(self) -> None:
        self.action_tab("segments")
        self.query_one("#filter", Input).focus()

    def action_toggle(self, word: str) -> None:
        box = self.query_one("#filter", Input)
        words = box.value.split()
        box.value = " ".join([w for w in words if w != word] if word in words else [*words, word])
        self.action_tab("segments")

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter, self.offsets["segments"] = Filter.parse(event.value), 0
        self.load_segments()

    def on_input_submitted(self) -> None:
        self.query_one("#segments-table", DataTable).focus()

    def action_page(self, delta: int) -> None:
        name = self.query_one(TabbedContent).active
        if name in self.offsets:
            old, self.offsets[name] = self.offsets[name], max(0, self.offsets[name] + delta * PAGE)
            self.load() if name != "segments" else self.load_segments()
            if (
                delta > 0 and not self.query_one(f"#{name}-table", DataTable).row_count
            ):  # past the end: stay
                self.offsets[name] = old
                self.load() if name != "segments" else self.load_segments()

    def action_back(self) -> None:
        if isinstance(self.focused, Input):
            self.query_one("#segments-table", DataTable).focus()
        else:
            self.app.pop_screen()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        self.sort_by(str(event.column_key.value))

    def action_next_sort(self) -> None:
        self.sort_by(SEGMENT_COLUMNS[(SEGMENT_COLUMNS.index(self.sort) + 1) % len(SEGMENT_COLUMNS)])

    def sort_by(self, column: str) -> None:
        """Sort on `column` (largest first for numbers worth ranking); sorting on it again flips the order."""
        self.descending = (
            not self.descending
            if column == self.sort
            else column in ("reward", "mismatched", "num_tokens")
        )
        self.sort, self.offsets["segments"] = column, 0
        self.load_segments()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "failures-table" and event.data_table.row_count:
            row = dict(
                zip(
                    [str(c.label) for c in event.data_table.columns.values()],
                    event.data_table.get_row(event.row_key),
                )
            )
            self.query_one("#failures-traceback", Static).update(
                self.data.traceback(int(row["step"]), int(row["rollout_id"]))
            )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        table = event.data_table
        if (
            table.id == "failures-table"
        ):  # a failed episode has no segment; its traceback is shown below
            return
        row = dict(
            zip([str(c.label) for c in table.columns.values()], table.get_row(event.row_key))
        )
        step, rollout = int(row["step"]), int(row["rollout_id"])
        step, segment = (
            (step, int(row["segment_idx"]))
            if "segment_idx" in row
            else self.data.siblings(rollout)[0]
        )  # a request: its rollout's first
        self.app.push_screen(TokenScreen(self.data, step, rollout, segment))


class TokenScreen(Screen):
    BINDINGS = [
        Binding("left", "move(-1)", "Token ←", show=False),
        Binding("right", "move(1)", "Token →", show=False),
        Binding("home", "move(-1e9)", show=False),
        Binding("end", "move(1e9)", show=False),
        Binding("full_stop", "next_sampled", "Next sampled", key_display="."),
        Binding("c", "channel", "Channel"),
        Binding("n", "segment(1)", "Next seg"),
        Binding("p", "segment(-1)", "Prev seg"),
        Binding("escape", "app.pop_screen", "Back"),
    ]

    def __init__(self, data: RunData, step: int, rollout_id: int, segment_idx: int):
        super().__init__()
        self.data, self.channel, self.cursor = data, next(iter(CHANNELS)), 0
        self.open(step, rollout_id, segment_idx)

    def open(self, step: int, rollout_id: int, segment_idx: int) -> None:
        self.segment_key, self.segment = (
            (step, rollout_id, segment_idx),
            self.data.segment(step, rollout_id, segment_idx),
        )
        routing, self.rollout_segments = (
            self.data.routing(step, rollout_id, segment_idx),
            self.data.siblings(rollout_id),
        )
        self.route_layers = sorted(routing)
        self.tokens = [
            dict(zip(TOKEN_FIELDS, row)) for row in self.data.tokens(step, rollout_id, segment_idx)
        ]
        for token in self.tokens:
            token["text"] = self.data.piece(token["token_id"])
            token["staleness"] = self.segment["learner_version"] - token["behavior_version"]
            token["mismatched_layers"] = {
                layer: routing[layer][token["position"]]
                for layer in self.route_layers
                if token["position"] in routing[layer]
            }
        self.cursor = min(self.cursor, max(len(self.tokens) - 1, 0))

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="legend")
        with Horizontal():
            with VerticalScroll(id="tokens-scroll", can_focus=False):
                yield Static(id="tokens")
            yield Static(id="side")
        yield Footer()

    def on_mount(self) -> None:
        self.render_all()

    def token_styles(self) -> list[str]:
        """The style of every token under the current channel (the cursor's not included)."""
        return [colour(self.channel, t) if t["loss_mask"] else "dim" for t in self.tokens]

    def render_all(self) -> None:
        s = self.segment
        self.title = f"rollout {s['rollout_id']} · segment {s['segment_idx'] + 1}/{len(self.rollout_segments)} · step {s['step']}"
        self.sub_title = (
            f"reward {s['reward']:.3g} · seal {s['seal_reason']} · finish {s['finish_reason']}"
        )
        legend = Text.assemble(
            ("channel ", "bold"),
            (self.channel, "bold underline"),
            "  ",
            ("prompt/env", "dim"),
            "  ",
        )
        for _, c, label in CHANNELS[self.channel][1]:
            legend.append(f"■ {label} ", style=c)
        if s["images"]:
            legend.append("\nimages: " + ", ".join(s["images"]), style="italic")
        self.query_one("#legend", Static).update(legend)
        text, starts, ends, images = (
            Text(),
            {a for a, _ in s["turn_spans"]},
            {b for _, b in s["turn_spans"]},
            iter(s["images"]),
        )
        for i, (token, style) in enumerate(zip(self.tokens, self.token_styles())):
            if i in ends:
                text.append("◂", style="bold magenta")
            if i in starts:
                text.append("▸", style="bold magenta")
            piece = token["text"]
            if piece == "<|vision_start|>":
                piece = f"▣{next(images, 'image')}"
            elif piece == "<|image_pad|>":
                piece = "▪"
            if i == self.cursor:
                self.cursor_offset = len(text)
            text.append(visible(piece), style=style + (" reverse" if i == self.cursor else ""))
        if len(self.tokens) in ends:
            text.append("◂", style="bold magenta")
        text.append(f" ⏹ {s['seal_reason']}", style="bold")
        self.text = text
        self.query_one("#tokens", Static).update(text)
        self.render_side()
        self.call_after_refresh(self.follow)

    def follow(self) -> None:
        """Scroll so the cursor's line is in view (lines as rich wraps them at the pane's width)."""
        scroll = self.query_one("#tokens-scroll", VerticalScroll)
        width, height = (
            scroll.scrollable_content_region.width,
            scroll.scrollable_content_region.height,
        )
        if width > 0 and self.tokens:
            line = len(self.text[: self.cursor_offset + 1].wrap(self.app.console, width)) - 1
            if not scroll.scroll_y <= line < scroll.scroll_y + height:
                scroll.scroll_to(y=max(0, line - height // 2), animate=False)

    def render_side(self) -> None:
        if not self.tokens:
            self.query_one("#side", Static).update("no tokens stored")
            return
        t = self.tokens[self.cursor]
        sampled = bool(t["loss_mask"])
        lines = [
            f"[b]token[/b] {t['position'] + 1}/{len(self.tokens)}",
            f"id        {t['token_id']}",
            f"text      {t['text']!r}",
            f"kind      {'sampled' if sampled else 'prompt/env'}",
        ]
        if sampled:
            lines += [
                f"behavior  {t['behavior_logprob']:.4f}",
                f"train     {t['train_logprob']:.4f}",
                f"δ         {t['train_logprob'] - t['behavior_logprob']:+.4f}",
                f"version   {t['behavior_version']} (learner {self.segment['learner_version']})",
                f"IS weight {t['is_weight']:.4f}",
            ]
        else:
            lines.append(f"train     {t['train_logprob']:.4f}")
        if self.route_layers:
            lines.append(
                "routing   "
                + " ".join(
                    f"L{layer}{'✗' if layer in t['mismatched_layers'] else '✓'}"
                    for layer in self.route_layers
                )
            )
            lines += [
                f"  L{layer} rollout {_experts(rollout)} learner {_experts(learner)}"
                for layer, (rollout, learner) in t["mismatched_layers"].items()
            ]
        self.query_one("#side", Static).update("\n".join(lines))

    def action_move(self, delta: float) -> None:
        self.cursor = int(min(max(self.cursor + delta, 0), max(len(self.tokens) - 1, 0)))
        self.render_all()

    def action_next_sampled(self) -> None:
        later = [i for i in range(self.cursor + 1, len(self.tokens)) if self.tokens[i]["loss_mask"]]
        self.action_move(later[0] - self.cursor if later else 0)

    def action_channel(self) -> None:
        names = list(CHANNELS)
        self.channel = names[(names.index(self.channel) + 1) % len(names)]
        self.render_all()

    def action_segment(self, delta: int) -> None:
        index = self.rollout_segments.index((self.segment_key[0], self.segment_key[2])) + delta
        if 0 <= index < len(self.rollout_segments):
            self.open(
                self.rollout_segments[index][0],
                self.segment_key[1],
                self.rollout_segments[index][1],
            )
            self.render_all()


class InspectApp(App):
    TITLE = "molt-wb inspect"
    CSS = """
    Input { border: none; height: 1; }
    .status { height: 1; color: $text-muted; }
    .plot { height: 12; }
    #legend { height: auto; max-height: 3; }
    #failures-traceback { height: auto; max-height: 12; border-top: solid $accent; }
    #side { width: 30; border-left: solid $accent; padding: 0 1; }
    #help { width: 80; height: auto; border: thick $accent; background: $surface; padding: 1 2; }
    Help { align: center middle; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    def __init__(
        self, root: str = "runs", run_id: str | None = None, sweep: str = "", poll: float = 2.0
    ):
        super().__init__()
        self.root, self.run_id, self.sweep, self.poll = root, run_id, sweep, poll

    def on_mount(self) -> None:
        self.push_screen(RunsScreen())
        if self.run_id:
            self.push_screen(RunScreen(RunData(self.run_id, self.root)))

    def action_help(self) -> None:
        self.push_screen(Help())


def _experts(ids) -> str:
    return ",".join(str(i) for i in ids) if ids is not None else "?"
