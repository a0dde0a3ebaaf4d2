"""The screen of one run: overview · segments · gate · requests · failures tabs, a page at a time.

The segments tab filters, sorts and pages; a row of the segments, gate or requests tab opens the
token view of its segment.
"""

import json

from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
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

from workbench.store.query import cell
from workbench.tui.data import PAGE, PLOTS, SEGMENT_COLUMNS, Filter, RunData
from workbench.tui.token_screen import TokenScreen

# (tab, store table, what the status line says a row leads to)
PAGED_TABS = (
    ("gate", "gate_decisions", "enter opens the segment"),
    ("requests", "requests", "enter opens the segment"),
    ("failures", "failed_episodes", "the highlighted episode's traceback below"),
)
# the tabs of tables, a page at a time
TABLE_TABS = ("segments", *(name for name, _, _ in PAGED_TABS))


def row_cells(table: DataTable, row_key):
    """{column name: cell} of one row of `table`, whose columns are keyed by their names."""
    return dict(zip(table.columns, table.get_row(row_key), strict=True))


class RunScreen(Screen):
    BINDINGS = [
        ("1", "tab('overview')", "Overview"),
        ("2", "tab('segments')", "Segments"),
        ("3", "tab('gate')", "Gate"),
        ("4", "tab('requests')", "Requests"),
        ("5", "tab('failures')", "Failures"),
        Binding("slash", "filter", "Filter", key_display="/"),
        ("d", "toggle('dropped')", "Dropped"),
        ("m", "toggle('mismatch')", "Mismatch"),
        ("o", "next_sort", "Sort"),
        Binding("right_square_bracket", "page(1)", "Page", key_display="]"),
        Binding("left_square_bracket", "page(-1)", show=False),
        ("escape", "back", "Back"),
    ]

    def __init__(self, data: RunData):
        super().__init__()
        self.data = data
        self.filter = Filter()
        self.sort = "step"
        self.descending = False
        self.offsets = dict.fromkeys(TABLE_TABS, 0)

    def compose(self):
        yield Header()
        with TabbedContent(initial="overview"):
            with TabPane("1 Overview", id="overview"), VerticalScroll():
                yield Static(id="headline")
                with Collapsible(title="resolved config", collapsed=True):
                    yield Static(json.dumps(self.data.run.get("config"), indent=1), id="config")
                for key in PLOTS:
                    yield PlotextPlot(id=f"plot-{key.replace('/', '-')}", classes="plot")
            for number, name in enumerate(TABLE_TABS, start=2):
                with TabPane(f"{number} {name.title()}", id=name):
                    if name == "segments":
                        yield Input(
                            placeholder="filter: dropped mismatch reward>=0.5 text (/)", id="filter"
                        )
                    yield Static(id=f"{name}-status", classes="status")
                    yield DataTable(id=f"{name}-table", cursor_type="row", zebra_stripes=True)
                    if name == "failures":
                        yield Static(id="failures-traceback")
        yield Footer()

    def on_mount(self):
        self.title = f"run {self.data.run['run_id']}"
        self.sub_title = str(self.data.run.get("recipe") or "")
        table = self.query_one("#segments-table", DataTable)
        for column in SEGMENT_COLUMNS:
            table.add_column(column, key=column)
        self.load()
        self.set_interval(self.app.poll, self.poll)

    def poll(self):
        if self.data.refresh():
            self.load()

    def load(self):
        self.query_one("#headline", Static).update(
            "  ".join(f"[b]{k}[/b] {cell(v)}" for k, v in self.data.headline().items())
        )
        for key in PLOTS:
            plot = self.query_one(f"#plot-{key.replace('/', '-')}", PlotextPlot)
            points = self.data.series(key)
            plot.plt.clear_data()
            if points:
                steps, values = zip(*points, strict=True)
                plot.plt.title(key)
                plot.plt.plot(steps, values, marker="braille")
            else:
                plot.plt.title(f"{key} (not recorded)")
            plot.refresh()
        self.load_segments()
        for name, table, hint in PAGED_TABS:
            offset = self.offsets[name]
            columns, rows = self.data.page(table, offset)
            self.fill(self.query_one(f"#{name}-table", DataTable), columns, rows)
            self.query_one(f"#{name}-status", Static).update(
                f"rows {offset + bool(rows)}-{offset + len(rows)} · {hint} · ] [ page"
            )

    def load_segments(self):
        count = self.data.segment_count(self.filter)
        offset = self.offsets["segments"]
        rows = self.data.segment_page(self.filter, offset, self.sort, self.descending)
        self.fill(self.query_one("#segments-table", DataTable), None, rows)
        status = (
            f"rows {offset + bool(rows)}-{offset + len(rows)} of {count} · sort {self.sort} "
            f"{'↓' if self.descending else '↑'}"
        )
        if self.filter.dropped:
            status += " · only dropped"
        if self.filter.mismatch:
            status += " · only mismatches"
        self.query_one("#segments-status", Static).update(status)

    def load_tab(self, name):
        if name == "segments":
            self.load_segments()
        else:
            self.load()

    @staticmethod
    def fill(table: DataTable, columns, rows):
        cursor = table.cursor_row
        table.clear(columns=columns is not None)
        for column in columns or []:
            table.add_column(column, key=column)
        for row in rows:
            table.add_row(*(cell(value, "") for value in row))
        table.move_cursor(row=cursor)

    def action_tab(self, name):
        self.query_one(TabbedContent).active = name
        if name == "overview":
            self.query_one(VerticalScroll).focus()
        else:
            self.query_one(f"#{name}-table").focus()

    def action_filter(self):
        self.action_tab("segments")
        self.query_one("#filter", Input).focus()

    def action_toggle(self, word):
        box = self.query_one("#filter", Input)
        words = box.value.split()
        if word in words:
            words = [w for w in words if w != word]
        else:
            words.append(word)
        box.value = " ".join(words)
        self.action_tab("segments")

    def on_input_changed(self, event: Input.Changed):
        self.filter = Filter.parse(event.value)
        self.offsets["segments"] = 0
        self.load_segments()

    def on_input_submitted(self):
        self.query_one("#segments-table", DataTable).focus()

    def action_page(self, delta):
        name = self.query_one(TabbedContent).active
        if name in self.offsets:
            old = self.offsets[name]
            self.offsets[name] = max(0, old + delta * PAGE)
            self.load_tab(name)
            # past the end: stay
            if delta > 0 and not self.query_one(f"#{name}-table", DataTable).row_count:
                self.offsets[name] = old
                self.load_tab(name)

    def action_back(self):
        if isinstance(self.focused, Input):
            self.query_one("#segments-table", DataTable).focus()
        else:
            self.app.pop_screen()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected):
        self.sort_by(str(event.column_key.value))

    def action_next_sort(self):
        following = (SEGMENT_COLUMNS.index(self.sort) + 1) % len(SEGMENT_COLUMNS)
        self.sort_by(SEGMENT_COLUMNS[following])

    def sort_by(self, column):
        """Sort on `column` (largest first for numbers worth ranking); sorting on it again flips
        the order."""
        if column == self.sort:
            self.descending = not self.descending
        else:
            self.descending = column in ("reward", "mismatched", "num_tokens")
        self.sort = column
        self.offsets["segments"] = 0
        self.load_segments()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted):
        if event.data_table.id == "failures-table" and event.data_table.row_count:
            row = row_cells(event.data_table, event.row_key)
            self.query_one("#failures-traceback", Static).update(
                self.data.traceback(int(row["step"]), int(row["rollout_id"]))
            )

    def on_data_table_row_selected(self, event: DataTable.RowSelected):
        table = event.data_table
        # a failed episode has no segment; its traceback is shown below
        if table.id == "failures-table":
            return
        row = row_cells(table, event.row_key)
        step = int(row["step"])
        rollout = int(row["rollout_id"])
        if "segment_idx" in row:
            segment = int(row["segment_idx"])
        else:
            # a request: its rollout's first segment
            step, segment = self.data.siblings(rollout)[0]
        self.app.push_screen(TokenScreen(self.data, step, rollout, segment))
